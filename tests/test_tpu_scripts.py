"""tpu/launch.sh and tpu/sweep.sh with --dry-run: the gcloud commands they would run, for gs://
workdirs (no gcsfuse mount) and shared-filesystem paths, and the workdirs they refuse."""

import os
import subprocess

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
