"""tpu/launch.sh and tpu/sweep.sh with --dry-run: the gcloud commands they would run, for gs://
workdirs (no gcsfuse mount) and shared-filesystem paths, and the workdirs they refuse; and
tpu/sweep.sh run for real against a fake gcloud, its DONE/FAILED markers on a gs:// prefix
(fake-gcs-server) and on a local one."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

LAUNCH = os.path.join(REPO, "tpu", "launch.sh")
SWEEP = os.path.join(REPO, "tpu", "sweep.sh")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LAUNCH_FLAGS", "REFRESH_PLATFORMS")}
    return subprocess.run(
        ["bash", script, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )


def _words(line: str) -> list[str]:
    """A printed command line split into words by bash itself (printf %q uses $'...')."""
    out = subprocess.run(
        ["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", line],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split("\0")[:-1]


def _commands(stdout: str) -> list[str]:
    """The --command= of each printed `gcloud ... ssh` line (unquoted as a shell would)."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("gcloud "):
            words = _words(line)
            assert words[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"], line
            out += [w.removeprefix("--command=") for w in words if w.startswith("--command=")]
    return out


def test_launch_dry_run_with_a_gcs_workdir():
    wd = "gs://my-bucket/runs/base1"
    r = _run(
        LAUNCH, "--dry-run", "--prepare", "tpu1", "us-central2-b", wd + "/", "configs/realm.py:base"
    )
    assert r.returncode == 0, r.stderr
    prep, refresh, train = _commands(r.stdout)
    assert f"realm_jax prepare --config configs/realm.py:base --workdir {wd} " in prep
    assert f"realm_jax refresh --config configs/realm.py:base --workdir {wd} " in refresh
    assert f"realm_jax train --config configs/realm.py:base --workdir {wd} --multihost" in train
    assert "gcsfuse" not in r.stdout + r.stderr
    assert "logs/base1/" in train  # the run name is the URL's last folder
    assert f"tpu/launch.sh --stop --run base1 tpu1 us-central2-b {wd} " in r.stdout


def test_launch_dry_run_with_a_shared_filesystem_workdir():
    r = _run(
        LAUNCH, "--dry-run", "--no-refresh", "tpu1", "z", "/mnt/nfs/runs/a", "configs/realm.py:base"
    )
    assert r.returncode == 0, r.stderr
    (train,) = _commands(r.stdout)
    assert "--workdir /mnt/nfs/runs/a --multihost" in train


@pytest.mark.parametrize(
    "spec, task", [("configs/orqa.py:base", "qa"), ("configs/ict.py:base", "ict")]
)
@pytest.mark.parametrize("wait", [False, True])
def test_launch_starts_no_refresher_for_a_run_that_reads_no_refreshed_index(spec, task, wait):
    """QA fine-tuning keeps its index frozen and ICT has none: only the trainers start (and
    with --wait, as tpu/sweep.sh runs them, no refresher is stopped afterwards)."""
    wd = "gs://my-bucket/runs/qa1"
    r = _run(LAUNCH, "--dry-run", *(["--wait"] * wait), "tpu1", "z", wd, spec)
    assert r.returncode == 0, r.stderr
    (train,) = _commands(r.stdout)
    assert f"realm_jax train --config {spec} --workdir {wd} --multihost" in train
    assert "realm_jax refresh" not in r.stdout and "refresh.pid" not in r.stdout
    assert f"no refresher: config task {task} reads no refreshed index" in r.stdout


def test_launch_names_a_bad_override_before_anything_starts():
    r = _run(
        LAUNCH, "--dry-run", "tpu1", "z", "gs://b-1/run", "configs/realm.py:base",
        "--config.train.lrr=1",
    )  # fmt: skip
    assert r.returncode == 2 and "train.lrr" in r.stderr and r.stdout == ""


@pytest.mark.parametrize(
    "workdir, message",
    [
        ("gs://my-bucket", "must be gs://BUCKET/FOLDER (a folder inside the bucket)"),
        ("gs://My_Bucket/run", "must be gs://BUCKET/FOLDER"),
        ("gs:/my-bucket/run", "gs://BUCKET/FOLDER or an absolute path"),
        ("runs/relative", "gs://BUCKET/FOLDER or an absolute path"),
    ],
)
def test_launch_refuses_bad_workdirs(workdir, message):
    r = _run(LAUNCH, "--dry-run", "tpu1", "z", workdir, "configs/realm.py:base")
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


def test_sweep_dry_run_with_a_gcs_prefix():
    r = _run(SWEEP, "--dry-run", "tpu1", "z", "gs://my-bucket/sweeps/lr/", "configs/realm.py")
    assert r.returncode == 0, r.stderr
    lines = [_words(x) for x in r.stdout.splitlines() if x.strip()]
    assert lines, "no sweep points printed"
    for words in lines:
        assert words[0] == LAUNCH and words[1:3] == ["--wait", "--run"]
        point = words[3]
        assert f"gs://my-bucket/sweeps/lr/{point}" in words  # WORKDIR_PREFIX/P, one slash


def test_sweep_refuses_a_relative_prefix():
    r = _run(SWEEP, "--dry-run", "tpu1", "z", "sweeps/lr", "configs/realm.py")
    assert r.returncode == 2 and "gs://BUCKET/... or an absolute path" in r.stderr


# ------------------------------------------------- tpu/sweep.sh's markers on a gs:// prefix

BUCKET = "realm-test"
SPEC = "configs/ict.py"  # 4 points: mask_rate 0.9/1.0 x lr 1e-4/3e-4
SKIPPED, FAILING, STOPPED, FINISHING = (
    "mask_rate=0.9,lr=0.0001",
    "mask_rate=0.9,lr=0.0003",
    "mask_rate=1.0,lr=0.0001",
    "mask_rate=1.0,lr=0.0003",
)

# Stands in for gcloud on PATH: the `ssh --command=...` that would train a point on the pod
# writes what the trainers would (WORKDIR/metrics.json, through realm_jax.fs) and exits as
# they would: FAILING fails, STOPPED is stopped early (SIGTERM: exit 0 before train.steps),
# every other point finishes.
FAKE_GCLOUD = """#!{python}
import json, os, shlex, sys
from realm_jax import fs
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(shlex.join(sys.argv[1:]) + "\\n")
command = next(a for a in sys.argv if a.startswith("--command=")).removeprefix("--command=")
words = shlex.split(command)
workdir = words[words.index("--workdir") + 1]
if workdir.endswith("/{failing}"):
    sys.exit(3)
step = 2 if workdir.endswith("/{stopped}") else 4
metrics = dict(step=step, steps=4, complete=step == 4, train=dict(loss=1.5))
if fs.is_remote(workdir) or os.path.isdir(workdir):  # else mounted on the pod only
    fs.write_text(fs.join(workdir, "metrics.json"), json.dumps(metrics))
"""


@pytest.fixture(scope="module")
def gcs():
    """fake-gcs-server for the module, its environment set here (the scripts inherit it)."""
    from tests import fake_gcs

    if fake_gcs.binary() is None:
        pytest.skip("fake-gcs-server is not installed: the gs:// sweep test needs a local GCS")
    with fake_gcs.FakeGCS(buckets=(BUCKET,)) as server, pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        import gcsfs  # after the environment: it reads some of it when first imported

        gcsfs.GCSFileSystem.clear_instance_cache()
        yield server
        gcsfs.GCSFileSystem.clear_instance_cache()


def _sweep_on_fake_pod(tmp_path, prefix: str) -> subprocess.CompletedProcess:
    """tpu/sweep.sh for real (no --dry-run) over SPEC's points, with the fake gcloud first on
    PATH and no refresher (one ssh per point)."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        fake = FAKE_GCLOUD.format(python=sys.executable, failing=FAILING, stopped=STOPPED)
        (bin_dir / "gcloud").write_text(fake)
        (bin_dir / "gcloud").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "REFRESH_PLATFORMS"}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        PYTHONPATH=REPO,
        PYTHON=sys.executable,
        LAUNCH_FLAGS="--no-refresh",
        FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"),
    )
    return subprocess.run(
        ["bash", SWEEP, "tpu1", "z", prefix, SPEC],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def _ssh_workdirs(tmp_path) -> list[str]:
    """The workdir of each fake `gcloud ... ssh` call, in order (and forget them)."""
    log = tmp_path / "gcloud.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return [line.split("--workdir ")[1].split()[0].replace("\\,", ",") for line in lines]


def test_sweep_marks_points_on_a_gcs_prefix(gcs, tmp_path):
    """With a gs:// prefix (mounted nowhere) a point with DONE is skipped (an older sweep's
    date-only marker too), a finished one gets DONE, a failed or stopped one FAILED, each a
    JSON record through realm_jax.fs; the table reads them (no longer all pending)."""
    from realm_jax import fs
    from realm_jax.sweep import table
    from realm_jax.sweep.points import sweep_points

    prefix = f"gs://{BUCKET}/sweeps/tpu"
    points = sweep_points(SPEC)
    assert [name for name, _ in points] == [SKIPPED, FAILING, STOPPED, FINISHING]
    fs.write_text(f"{prefix}/{SKIPPED}/DONE", "2026-11-23T05:00:00Z\n")
    r = _sweep_on_fake_pod(tmp_path, prefix + "/")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"skipping {SKIPPED}: {prefix}/{SKIPPED}/DONE exists" in r.stdout
    assert f"failed points: {FAILING} {STOPPED}" in r.stderr
    assert _ssh_workdirs(tmp_path) == [f"{prefix}/{n}" for n in (FAILING, STOPPED, FINISHING)]
    done = json.loads(fs.read_text(f"{prefix}/{FINISHING}/DONE"))
    assert (done["name"], done["returncode"], done["step"]) == (FINISHING, 0, 4)
    assert isinstance(done["wall_s"], float)
    assert json.loads(fs.read_text(f"{prefix}/{FAILING}/FAILED"))["returncode"] == 3
    stopped = json.loads(fs.read_text(f"{prefix}/{STOPPED}/FAILED"))
    assert stopped["error"] == "stopped at step 2 of 4"
    assert not fs.exists(f"{prefix}/{FAILING}/DONE") and not fs.exists(f"{prefix}/{STOPPED}/DONE")
    status = {row["name"]: row["status"] for row in table.rows(prefix, points)}
    assert status == {SKIPPED: "done", FAILING: "failed", STOPPED: "failed", FINISHING: "done"}


def test_sweep_marks_points_on_a_local_prefix_only_where_mounted(tmp_path):
    """A shared-filesystem prefix: markers where it is mounted here too, none where it is not
    (the exit status alone then says which points failed)."""
    prefix = tmp_path / "sweep"
    for name in (SKIPPED, FAILING, STOPPED, FINISHING):
        (prefix / name).mkdir(parents=True)
    (prefix / SKIPPED / "DONE").write_text("2026-11-23T05:00:00Z\n")
    r = _sweep_on_fake_pod(tmp_path, str(prefix))
    assert r.returncode == 1 and f"failed points: {FAILING} {STOPPED}" in r.stderr, r.stderr
    assert json.loads((prefix / FINISHING / "DONE").read_text())["step"] == 4
    assert (prefix / FAILING / "FAILED").exists() and (prefix / STOPPED / "FAILED").exists()
    assert len(_ssh_workdirs(tmp_path)) == 3

    elsewhere = str(tmp_path / "not-mounted-here")
    r = _sweep_on_fake_pod(tmp_path, elsewhere)
    assert r.returncode == 1 and r.stderr.endswith(f"failed points: {FAILING}\n"), r.stderr
    assert len(_ssh_workdirs(tmp_path)) == 4 and not os.path.exists(elsewhere)


def test_sweep_stops_on_a_bucket_it_cannot_reach(gcs, tmp_path):
    r = _sweep_on_fake_pod(tmp_path, "gs://no-such-bucket/sweeps/x")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "bucket gs://no-such-bucket does not exist" in r.stderr
    assert _ssh_workdirs(tmp_path) == []
