"""tpu/launch.sh, tpu/refresh_slice.sh and tpu/sweep.sh with --dry-run: the gcloud commands they
would run, for gs:// workdirs (no gcsfuse mount) and shared-filesystem paths, and the arguments
they refuse (the refresh job on its own slice; --prepare detached, on Dataflow, and refused
without the user's corpus; --env's names; the sweep's storage, prefix and slices); launch.sh run
for real against a gcloud that runs the ssh command here (--prepare returns at once and its log
reaches WORKDIR; --env reaches the trainers, JSON intact, and not the refresher); and
tpu/sweep.sh's study command, printed and run (against a fake gcloud and python)."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

LAUNCH = os.path.join(REPO, "tpu", "launch.sh")
SWEEP = os.path.join(REPO, "tpu", "sweep.sh")
# what the scripts read from the environment (cleared for the tests, set where a test says)
SCRIPT_ENV = (
    "LAUNCH_FLAGS", "REFRESH_PLATFORMS", "REFRESH_TPU_NAME", "REFRESH_ZONE",
    "REFRESH_ACCELERATOR_TYPE", "REFRESH_RUNTIME_VERSION", "PREPARE_FLAGS", "DATAFLOW_PROJECT",
    "DATAFLOW_REGION", "DATAFLOW_TEMP_LOCATION", "DATAFLOW_OPTIONS", "CLOUDSDK_CORE_PROJECT",
    "REALM_JAX_TRIAL",
)  # fmt: skip


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return _run_env({}, script, *args)


def _run_env(extra: dict, script: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    env.update(extra)
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
    r = _run(LAUNCH, "--dry-run", "tpu1", "us-central2-b", wd + "/", "configs/realm.py:base")
    assert r.returncode == 0, r.stderr
    refresh, train = _commands(r.stdout)
    assert f"realm_jax refresh --config configs/realm.py:base --workdir {wd} " in refresh
    assert f"realm_jax train --config configs/realm.py:base --workdir {wd} --multihost" in train
    assert "gcsfuse" not in r.stdout + r.stderr
    assert "logs/base1/" in train  # the run name is the URL's last folder
    assert f"tpu/launch.sh --stop --run base1 tpu1 us-central2-b {wd} " in r.stdout


# ------------------------------------------------- the refresh job on its own slice

REFRESH_SLICE = os.path.join(REPO, "tpu", "refresh_slice.sh")
WD = "gs://my-bucket/runs/base1"


def _ssh_lines(stdout: str) -> list[list[str]]:
    return [
        _words(x) for x in stdout.splitlines() if x.startswith("gcloud compute tpus tpu-vm ssh")
    ]


def _flag(words: list[str], flag: str) -> str:
    (value,) = [w.split("=", 1)[1] for w in words if w.startswith(flag + "=")]
    return value


@pytest.mark.parametrize("accel", [None, "v5litepod-8"])
def test_refresh_slice_create_uses_the_requested_accelerator_type(accel):
    """Its name, zone and accelerator type from the environment (defaults: NAME-refresh, the
    trainer's zone, v4-8), created by tpu/create.sh; setup installs it as tpu/setup.sh does."""
    env = {"REFRESH_ACCELERATOR_TYPE": accel} if accel else {}
    r = _run_env(env, REFRESH_SLICE, "--dry-run", "create", "tpu1", "us-central2-b")
    assert r.returncode == 0, r.stderr
    (create,) = [_words(x) for x in r.stdout.splitlines() if x.startswith("gcloud ")]
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "tpu1-refresh"]
    assert _flag(create, "--accelerator-type") == (accel or "v4-8")
    assert _flag(create, "--zone") == "us-central2-b"

    r = _run(
        REFRESH_SLICE, "--dry-run", "--name", "refresher", "--zone", "europe-west4-a",
        "--accelerator-type", "v3-8", "--spot", "create", "tpu1", "us-central2-b",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (create,) = [_words(x) for x in r.stdout.splitlines() if x.startswith("gcloud ")]
    assert create[5] == "refresher" and "--spot" in create
    assert _flag(create, "--accelerator-type") == "v3-8"
    assert _flag(create, "--zone") == "europe-west4-a"

    r = _run(REFRESH_SLICE, "--dry-run", "setup", "tpu1", "us-central2-b")
    assert r.returncode == 0, r.stderr
    assert {w[5] for w in _ssh_lines(r.stdout)} == {"tpu1-refresh"}
    assert all("--worker=all" in w for w in _ssh_lines(r.stdout))
    assert any("pip install" in _flag(w, "--command") for w in _ssh_lines(r.stdout))


def test_refresh_slice_start_runs_the_refresh_job_on_every_worker():
    r = _run(
        REFRESH_SLICE, "--dry-run", "start", "tpu1", "us-central2-b", WD + "/",
        "configs/realm.py:base", "--config.mesh.shape=16,1", "--config.refresh.every=500",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (ssh,) = _ssh_lines(r.stdout)
    assert ssh[5] == "tpu1-refresh" and "--worker=all" in ssh and "--zone=us-central2-b" in ssh
    command = _flag(ssh, "--command")
    assert (
        "setsid nohup .venv/bin/python -m realm_jax refresh --config configs/realm.py:base "
        f"--workdir {WD} --multihost" in command
    )
    assert "--config.refresh.every=500" in command and "--config.refresh.mode=external" in command
    assert "mesh.shape" not in command  # the trainer's mesh: the refresher uses its own devices
    assert "logs/base1/refresh-w$W.log" in command and "JAX_PLATFORMS" not in command

    r = _run(REFRESH_SLICE, "--dry-run", "stop", "tpu1", "z", WD, "configs/realm.py:base")
    assert r.returncode == 0, r.stderr
    (ssh,) = _ssh_lines(r.stdout)
    assert ssh[5] == "tpu1-refresh" and "--worker=all" in ssh
    assert "logs/base1/refresh-w*.pid" in _flag(ssh, "--command")


@pytest.mark.parametrize(
    "args, message",
    [
        (["start", "tpu1", "z", WD, "configs/realm.py:base", "--config.refresh.mode=inprocess"],
         "a refresh slice serves refresh.mode=external"),
        (["start", "tpu1", "z", "runs/rel", "configs/realm.py:base"], "gs://BUCKET/FOLDER"),
        (["start", "tpu1", "z"], "start expects NAME ZONE WORKDIR CONFIG_SPEC"),
        (["--name", "tpu1", "create", "tpu1", "z"], "must not be the training slice"),
        (["--accelerator-type", "tpu4", "create", "tpu1", "z"], "does not look like v4-8"),
        (["resize", "tpu1", "z"], "unknown ACTION 'resize'"),
    ],
)  # fmt: skip
def test_refresh_slice_refuses_bad_arguments(args, message):
    r = _run(REFRESH_SLICE, "--dry-run", *args)
    assert r.returncode == 2 and message in r.stderr and r.stdout == "", r.stderr
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("queued", [False, True])
def test_refresh_slice_teardown_deletes_the_refresh_slice(queued):
    env = {"REFRESH_TPU_NAME": "my-refresher", "REFRESH_ZONE": "us-east5-a"}
    r = _run_env(env, REFRESH_SLICE, "--dry-run", *(["--queued"] * queued), "delete", "tpu1", "z")
    assert r.returncode == 0, r.stderr
    (delete,) = [_words(x) for x in r.stdout.splitlines() if x.startswith("gcloud ")]
    kind = ["queued-resources", "delete"] if queued else ["tpu-vm", "delete"]
    assert delete[:6] == ["gcloud", "compute", "tpus", *kind, "my-refresher"]
    assert "--zone=us-east5-a" in delete and "tpu1" not in delete


@pytest.mark.parametrize("wait", [False, True])
def test_launch_with_a_refresh_slice_starts_no_refresher_on_worker_0(wait):
    """--refresh-slice: the refresh job on every worker of NAME-refresh, the trainers on the
    training slice with refresh.mode=external and no refresher beside them; --wait and --stop
    stop it there."""
    r = _run(
        LAUNCH, "--dry-run", *(["--wait"] * wait), "--refresh-slice", "tpu1", "us-central2-b",
        WD, "configs/realm.py:base", "--config.mesh.shape=8,2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = _ssh_lines(r.stdout)
    hosts = [(w[5], _flag(w, "--worker")) for w in lines]
    start = [("tpu1-refresh", "all"), ("tpu1", "all")]
    assert hosts == start + [("tpu1-refresh", "all")] * wait  # nothing on tpu1's worker 0
    refresh, train = (_flag(w, "--command") for w in lines[:2])
    assert f"realm_jax refresh --config configs/realm.py:base --workdir {WD} --multihost" in refresh
    assert f"realm_jax train --config configs/realm.py:base --workdir {WD} --multihost" in train
    assert "--config.refresh.mode=external" in train and "refresh.pid" not in r.stdout
    assert "--config.mesh.shape=8\\,2" in train and "mesh.shape" not in refresh
    if wait:
        assert "refresh-w*.pid" in _flag(lines[2], "--command")  # stopped after training
    else:
        assert (
            f"tpu/launch.sh --stop --refresh-slice --run base1 tpu1 us-central2-b {WD} " in r.stdout
        )

    r = _run(
        LAUNCH, "--dry-run", "--stop", "--refresh-slice", "tpu1", "z", WD, "configs/realm.py:base"
    )
    assert r.returncode == 0, r.stderr
    hosts = [(w[5], _flag(w, "--worker")) for w in _ssh_lines(r.stdout)]
    assert hosts == [("tpu1", "all"), ("tpu1-refresh", "all")]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.refresh.mode=inprocess"], "--refresh-slice needs refresh.mode=external"),
        (["--no-refresh"], "--refresh-slice and --no-refresh do not go together"),
    ],
)
def test_launch_refresh_slice_refuses_a_trainer_that_refreshes_itself(args, message):
    r = _run(
        LAUNCH, "--dry-run", "--refresh-slice", "tpu1", "z", WD, "configs/realm.py:base", *args
    )
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


# ------------------------------------------------- tpu/launch.sh --prepare


def test_launch_prepare_without_a_corpus_is_one_line():
    """The config's corpus is the bundled sample: --prepare refuses it unless named."""
    r = _run(LAUNCH, "--dry-run", "--prepare", "tpu1", "z", WD, "configs/realm.py:base")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.splitlines()
    assert "--prepare needs your corpus: add --config.data.corpus=" in line
    assert "408-passage sample" in line
    r = _run(
        LAUNCH, "--dry-run", "--prepare", "tpu1", "z", WD, "configs/realm.py:base",
        "--config.data.corpus=data/sample/corpus.jsonl",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr  # named explicitly: prepared


def test_launch_prepare_runs_detached_with_its_log_on_gcs():
    corpus = "gs://my-bucket/input/wiki.jsonl"
    r = _run_env(
        {"PREPARE_FLAGS": "--overwrite"}, LAUNCH, "--dry-run", "--prepare", "tpu1",
        "us-central2-b", WD, "configs/realm.py:base", f"--config.data.corpus={corpus}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (ssh,) = _ssh_lines(r.stdout)  # prepare only: no refresher, no trainers
    assert ssh[5] == "tpu1" and "--worker=0" in ssh
    command = _flag(ssh, "--command")
    words = _words(command.split(" -- ")[1].split(">")[0])
    assert words[:5] == [".venv/bin/python", "-m", "realm_jax", "prepare", "--config"]
    assert f"--config.data.corpus={corpus}" in words and "--overwrite" in words
    assert (
        "setsid nohup bash tpu/run_logged.sh ~/realm-jax/logs/base1/prepare.log "
        f"{WD}/logs/prepare.log --" in command
    )
    assert "> /dev/null 2>&1 < /dev/null &" in command and "logs/base1/prepare.pid" in command
    assert f"gcloud storage cat {WD}/logs/prepare.log" in r.stdout
    assert "tail -f ~/realm-jax/logs/base1/prepare.log" in r.stdout

    # with --wait (tpu/sweep.sh): in the foreground, then the refresher and the trainers
    r = _run(
        LAUNCH, "--dry-run", "--wait", "--prepare", "tpu1", "z", WD, "configs/realm.py:base",
        f"--config.data.corpus={corpus}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    prep, refresh, train, stop = _commands(r.stdout)
    assert "realm_jax prepare" in prep and "nohup" not in prep and "run_logged" not in prep
    assert "realm_jax refresh" in refresh and "realm_jax train" in train


def test_launch_prepare_on_dataflow():
    corpus = "gs://my-bucket/input/wiki.jsonl"
    env = {"DATAFLOW_PROJECT": "proj-1", "DATAFLOW_OPTIONS": "--max_num_workers=64"}
    args = ["--dry-run", "--prepare", "--runner", "dataflow", "tpu1", "us-central2-b", WD,
            "configs/realm.py:base"]  # fmt: skip
    r = _run_env(env, LAUNCH, *args, f"--config.data.corpus={corpus}")
    assert r.returncode == 0, r.stderr
    (ssh,) = _ssh_lines(r.stdout)
    command = _flag(ssh, "--command")
    assert "setsid nohup bash tpu/run_logged.sh" in command
    words = _words(command.split(" -- ")[1].split(">")[0])
    assert "--beam_runner=DataflowRunner" in words
    (options,) = [
        w.removeprefix("--beam_options=") for w in words if w.startswith("--beam_options=")
    ]
    assert options.split() == [
        "--project=proj-1", "--region=us-central2", f"--temp_location={WD}/dataflow/tmp",
        f"--staging_location={WD}/dataflow/staging", "--setup_file=./pyproject.toml",
        "--requirements_file=requirements.txt", "--max_num_workers=64",
    ]  # fmt: skip
    for extra, message in (
        (["--config.data.corpus=/local/wiki.jsonl"], "needs --config.data.corpus=gs://"),
        ([], "needs --config.data.corpus=gs://"),
    ):
        r = _run_env(env, LAUNCH, *args, *extra)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1
    r = _run_env(env, LAUNCH, "--dry-run", "--runner", "dataflow", *args[4:])
    assert r.returncode == 2 and "--runner goes with --prepare" in r.stderr


# A gcloud that runs each `ssh --command=...` here, in a fake home whose ~/realm-jax has the real
# tpu/ scripts and a .venv/bin/python whose `-m realm_jax COMMAND` prints REALM_JAX_TRIAL when set
# and runs until a release file appears (or SIGTERM); a curl that fails (no metadata server: the
# worker id is the hostname).
EXEC_GCLOUD = """#!{python}
import os, signal, subprocess, sys
command = next(a for a in sys.argv if a.startswith("--command=")).removeprefix("--command=")
env = dict(os.environ, HOME=os.environ["FAKE_HOME"])
def remote():  # as on the worker: none of this side's ignored signals, nor its process group
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)
    os.setsid()
sys.exit(subprocess.run(["bash", "-c", command], env=env, preexec_fn=remote).returncode)
"""
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1 $2" = "-m realm_jax" ]; then
  trap 'echo "$3 stopped"; exit 0' TERM
  echo "$3 started: $*"
  [ -z "${{REALM_JAX_TRIAL+set}}" ] || printf 'REALM_JAX_TRIAL=%s\\n' "$REALM_JAX_TRIAL"
  for i in $(seq 600); do [ -e "$RELEASE" ] && break; sleep 0.1; done
  echo "$3 done"; exit 0
fi
exec {python} "$@"
"""


@pytest.fixture
def exec_pod(tmp_path):
    """(environment, fake home's repo, release file) for running tpu/ scripts for real here."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    (home / "realm-jax" / ".venv" / "bin").mkdir(parents=True)
    (home / "realm-jax" / "tpu").symlink_to(os.path.join(REPO, "tpu"))
    fake_python = home / "realm-jax" / ".venv" / "bin" / "python"
    fake_python.write_text(FAKE_PYTHON.format(python=sys.executable))
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(EXEC_GCLOUD.format(python=sys.executable))
    (bin_dir / "curl").write_text("#!/bin/sh\nexit 7\n")
    for f in (fake_python, bin_dir / "gcloud", bin_dir / "curl"):
        f.chmod(0o755)
    release = tmp_path / "release"
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=REPO, PYTHON=sys.executable,
        FAKE_HOME=str(home), RELEASE=str(release),
    )  # fmt: skip
    yield env, home / "realm-jax", release
    release.touch()  # whatever a failed test left running ends


BUCKET = "realm-test"


@pytest.fixture(scope="module")
def gcs():
    """fake-gcs-server for the module, its environment set here (the scripts inherit it)."""
    from tests.support import fake_gcs

    if fake_gcs.binary() is None:
        pytest.skip("fake-gcs-server is not installed: the gs:// prepare test needs a local GCS")
    with fake_gcs.FakeGCS(buckets=(BUCKET,)) as server, pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        import gcsfs  # after the environment: it reads some of it when first imported

        gcsfs.GCSFileSystem.clear_instance_cache()
        yield server
        gcsfs.GCSFileSystem.clear_instance_cache()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(predicate, seconds: float = 60.0) -> bool:
    deadline = time.time() + seconds
    while not predicate():
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("where", ["gs", "shared"])
def test_launch_prepare_detached_returns_at_once_and_its_log_arrives(where, exec_pod, request):
    """For real, against a gcloud that runs the ssh command here: launch.sh returns while the
    prepare still runs (its ssh session gone), and the log reaches WORKDIR/logs/prepare.log,
    ending with the exit status, once it finishes."""
    env, repo, release = exec_pod
    if where == "gs":
        env.update(request.getfixturevalue("gcs").env)  # after exec_pod made env
        workdir = f"gs://{BUCKET}/runs/prep1"
    else:
        workdir = str(repo.parent.parent / "shared" / "runs" / "prep1")
    t0 = time.time()
    r = subprocess.run(
        ["bash", LAUNCH, "--prepare", "tpu1", "z", workdir, "configs/realm.py:base",
         "--config.data.corpus=gs://elsewhere/wiki.jsonl"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    local_log = repo / "logs" / "prep1" / "prepare.log"
    pid = int((repo / "logs" / "prep1" / "prepare.pid").read_text())
    try:
        assert _alive(pid) and time.time() - t0 < 50  # launch.sh did not wait for it
        started = lambda: local_log.exists() and "prepare started" in local_log.read_text()  # noqa: E731
        assert _wait_for(started, 30)
        assert "prepare done" not in local_log.read_text()
        assert "-m realm_jax prepare --config configs/realm.py:base" in local_log.read_text()
        assert f"prepare pid {pid}" in r.stdout
    finally:
        release.touch()
    from realm_jax import fs

    log_url = f"{workdir}/logs/prepare.log"
    done = lambda: fs.exists(log_url) and fs.read_text(log_url).endswith("exit status 0\n")  # noqa: E731
    assert _wait_for(done), fs.exists(log_url) and fs.read_text(log_url)
    text = fs.read_text(log_url)
    assert text.startswith("prepare started:") and text.endswith("prepare done\nexit status 0\n")


def test_launch_detaches_the_trainer_and_refresher_and_stops_them(exec_pod, tmp_path):
    """launch.sh's ssh commands return at once (nothing keeps the session's output open), each
    process's pid file names it, and --stop sends it SIGTERM."""
    env, repo, _ = exec_pod
    args = ["tpu1", "z", str(tmp_path / "shared" / "run1"), "configs/realm.py:base"]
    t0 = time.time()
    r = subprocess.run(
        ["bash", LAUNCH, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.time() - t0 < 50
    logs = repo / "logs" / "run1"
    host = os.uname().nodename
    pids = {f: int((logs / f).read_text()) for f in ("refresh.pid", f"train-w{host}.pid")}
    assert all(_alive(p) for p in pids.values()), pids
    for log, command in (("refresh.log", "refresh"), (f"train-w{host}.log", "train")):
        started = lambda: f"{command} started" in (logs / log).read_text()  # noqa: E731,B023
        assert _wait_for(started, 30)
    r = subprocess.run(
        ["bash", LAUNCH, "--stop", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert _wait_for(lambda: not any(_alive(p) for p in pids.values()), 30)
    assert "train stopped" in (logs / f"train-w{host}.log").read_text()
    assert "refresh stopped" in (logs / "refresh.log").read_text()
    assert not list(logs.glob("*.pid"))


# SIGINT in the system tier: on a clean clone under `make test` it failed twice on 2026-11-29
# (once past the wait, once launch.sh ending 0 with "training finished", its trap not run), and
# passed alone: a race to find (docs/testing.md); SIGTERM, the killed worker's case, stays here.
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.system)]
)
def test_launch_wait_stops_the_trainers_when_it_is_stopped(exec_pod, tmp_path, signum):
    """launch.sh --wait (a sweep trial) stopped as its sweep worker stops it: SIGINT to its
    process group (the worker stopping), or SIGTERM (the worker killed: PR_SET_PDEATHSIG). The
    trainers on the workers get SIGTERM (they would checkpoint), then the refresher; it exits
    143 once they have ended, leaving no pid file and nothing running."""
    env, repo, _ = exec_pod
    p = subprocess.Popen(
        ["bash", LAUNCH, "--wait", "tpu1", "z", str(tmp_path / "shared" / "t1"),
         "configs/realm.py:base"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    logs = repo / "logs" / "t1"
    train_log = logs / f"train-w{os.uname().nodename}.log"
    try:
        started = lambda: train_log.exists() and "train started" in train_log.read_text()  # noqa: E731
        assert _wait_for(started, 60)
        pids = [int(f.read_text()) for f in logs.glob("*.pid")]
        assert len(pids) == 2 and all(_alive(x) for x in pids)  # the trainer and the refresher
        os.killpg(p.pid, signum)
        out, err = p.communicate(timeout=240)  # each stop runs python on a loaded CI machine
    finally:
        p.kill()
    assert p.returncode == 143, out + err
    assert "stopping run t1 on tpu1" in err
    assert "train stopped" in train_log.read_text()  # before launch.sh exited
    assert not list(logs.glob("*.pid"))
    assert _wait_for(lambda: "refresh stopped" in (logs / "refresh.log").read_text(), 30)
    assert _wait_for(lambda: not any(_alive(x) for x in pids), 30)


def test_run_logged_passes_sigterm_on_and_keeps_the_exit_status(tmp_path):
    """tpu/run_logged.sh: SIGTERM reaches the command; its status ends the log (copied)."""
    log, url = tmp_path / "w" / "a.log", tmp_path / "remote" / "logs" / "a.log"
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=REPO)
    script = "trap 'echo got TERM; exit 7' TERM; echo up; while :; do sleep 0.1; done"
    p = subprocess.Popen(
        ["bash", os.path.join(REPO, "tpu", "run_logged.sh"), "--every", "1", str(log), str(url),
         "--", "bash", "-c", script],
        cwd=REPO, env=env,
    )  # fmt: skip
    deadline = time.time() + 30
    while not (url.exists() and "up" in url.read_text()) and time.time() < deadline:
        time.sleep(0.2)  # copied while it runs
    assert url.read_text() == "up\n"
    p.terminate()
    assert p.wait(timeout=30) == 7
    assert url.read_text() == log.read_text() == "up\ngot TERM\nexit status 7\n"


def test_scripts_parse_and_pass_shellcheck():
    scripts = sorted(glob.glob(os.path.join(REPO, "tpu", "*.sh")))
    names = {os.path.basename(s) for s in scripts}
    assert names >= {"launch.sh", "refresh_slice.sh", "run_logged.sh"}
    for script in scripts:
        r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    r = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


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


# ------------------------------------------------- tpu/launch.sh --env

# A trial link as the sweep's worker passes it: quotes, braces, colons, slashes, and characters
# a shell would act on unquoted ($, `, ', &, ;, a newline).
TRIAL = json.dumps(
    {"storage": "postgresql://u:p@db.example:5432/optuna?sslmode=require&x=$HOME",
     "study": "lr's `x`; ok", "trial_id": 7, "objective": "eval/recall_at_5",
     "direction": "maximize", "retry_s": 300, "n": "a\nb"}
)  # fmt: skip


def _exported(command: str) -> dict:
    """What the `export NAME=VALUE` words of a printed --command set, as bash reads them."""
    exports = [part for part in command.split(" && ") if part.startswith("export ")]
    script = "".join(f"{e}; " for e in exports) + "env -0"
    out = subprocess.run(
        ["env", "-i", "bash", "-c", script], capture_output=True, text=True, check=True
    ).stdout
    env = dict(x.split("=", 1) for x in out.split("\0") if "=" in x)
    return {k: v for k, v in env.items() if k not in ("PWD", "SHLVL", "_", "OLDPWD")}


@pytest.mark.parametrize("wait", [False, True])
def test_launch_env_reaches_the_trainers_command_only(wait):
    """--env NAME=VALUE (repeatable): exported in the trainers' command on every worker, the
    value intact through two rounds of quoting (local printf %q, the workers' shell); not in
    the refresher's command."""
    r = _run(
        LAUNCH, "--dry-run", *(["--wait"] * wait), "--env", f"REALM_JAX_TRIAL={TRIAL}",
        "--env", "B_2=x=y", "tpu1", "z", WD, "configs/realm.py:base",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = _ssh_lines(r.stdout)
    refresh, train = (_flag(w, "--command") for w in lines[:2])
    assert "--worker=all" in lines[1] and "realm_jax train" in train
    assert _exported(train) == {"REALM_JAX_TRIAL": TRIAL, "B_2": "x=y"}
    assert json.loads(_exported(train)["REALM_JAX_TRIAL"])["trial_id"] == 7
    assert "realm_jax refresh" in refresh and "REALM_JAX_TRIAL" not in refresh
    assert _exported(refresh) == {}


@pytest.mark.parametrize("value", ["bad=1", "1X=1", "A-B=1", "NOVALUE", "=1"])
def test_launch_env_refuses_a_bad_name(value):
    r = _run(LAUNCH, "--dry-run", "--env", value, "tpu1", "z", WD, "configs/realm.py:base")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.splitlines()
    assert "--env needs NAME=VALUE with NAME in [A-Z_][A-Z0-9_]*" in line
    r = _run(LAUNCH, "--dry-run", "tpu1", "z", WD, "configs/realm.py:base", "--env")
    assert r.returncode == 2 and "--env needs NAME=VALUE" in r.stderr


def test_launch_env_arrives_in_the_trainers_environment(exec_pod, tmp_path):
    """For real, with a gcloud that runs the ssh command in bash here: the trainer process sees
    REALM_JAX_TRIAL as given, the refresher does not see it."""
    env, repo, release = exec_pod
    release.touch()  # the fake trainer and refresher end at once
    r = subprocess.run(
        ["bash", LAUNCH, "--wait", "--env", f"REALM_JAX_TRIAL={TRIAL}", "tpu1", "z",
         str(tmp_path / "shared" / "t7"), "configs/realm.py:base"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    logs = repo / "logs" / "t7"
    train = (logs / f"train-w{os.uname().nodename}.log").read_text()
    assert train.split("REALM_JAX_TRIAL=", 1)[1].split("\ntrain done")[0] == TRIAL
    assert _wait_for(lambda: "refresh done" in (logs / "refresh.log").read_text(), 30)
    assert "REALM_JAX_TRIAL" not in (logs / "refresh.log").read_text()


# ------------------------------------------------- tpu/sweep.sh: the study on TPU slices

GRPC = "grpc://10.1.2.3:13000"


def _sweep_words(stdout: str) -> list[str]:
    (line,) = stdout.splitlines()
    return _words(line)


@pytest.mark.parametrize("prefix", ["gs://my-bucket/sweeps/lr", "/mnt/nfs/sweeps/lr"])
def test_sweep_dry_run_prints_the_study_command(prefix):
    """One Optuna worker per slice: `realm_jax sweep --tpu SLICES --workers <slices>`, with the
    storage, the trial budget, the study and the overrides as given."""
    slices = "realm-a:us-central2-b,realm-b:europe-west4-a"
    r = _run_env(
        {"PYTHON": "/opt/py/bin/python3"}, SWEEP, "--dry-run", "--storage", GRPC, "--trials", "12",
        "--study", "lr1", prefix + "/", "configs/realm.py:base", slices, "--config.train.steps=200",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _sweep_words(r.stdout) == [
        "/opt/py/bin/python3", "-m", "realm_jax", "sweep", "--config", "configs/realm.py:base",
        "--workdir", prefix, "--storage", GRPC, "--tpu", slices, "--workers", "2",
        "--trials", "12", "--study", "lr1", "--config.train.steps=200",
    ]  # fmt: skip

    url = "postgresql+psycopg2://optuna:hunter2@db.example:5432/sweeps"
    r = _run(SWEEP, "--dry-run", "--storage", url, prefix, "configs/ict.py", "t1:us-east5-a")
    assert r.returncode == 0, r.stderr
    words = _sweep_words(r.stdout)
    assert words[1:] == [
        "-m", "realm_jax", "sweep", "--config", "configs/ict.py", "--workdir", prefix,
        "--storage", "postgresql+psycopg2://optuna:***@db.example:5432/sweeps",
        "--tpu", "t1:us-east5-a", "--workers", "1",
    ]  # fmt: skip
    assert "hunter2" not in r.stdout + r.stderr  # a password is never printed


def test_sweep_command_is_one_the_cli_accepts():
    """The printed command parses with realm_jax's own parser, to the values given."""
    from realm_jax import cli

    r = _run(
        SWEEP, "--dry-run", "--storage", GRPC, "--trials", "3", "--study", "s1",
        "gs://my-bucket/sw", "configs/realm.py:base", "a:us-central2-b,b:us-central2-b",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    args = cli._parser().parse_args(_sweep_words(r.stdout)[3:])
    assert (args.command, args.workdir, args.storage, args.study) == (
        "sweep", "gs://my-bucket/sw", GRPC, "s1",
    )  # fmt: skip
    assert int(args.workers) == 2 and int(args.trials) == 3
    assert "a:us-central2-b,b:us-central2-b" in str(args.tpu)


def test_the_sweep_workers_launch_command_runs_as_launch_sh_takes_it():
    """A --tpu worker's trial command (realm_jax/sweep/worker.py) is one tpu/launch.sh accepts:
    its trainers on the worker's slice in the trial's workdir, with the trial's link exported
    intact and the point's overrides."""
    from realm_jax.sweep.worker import Plan, trial_command

    plan = Plan(
        spec=os.path.join(REPO, "configs/realm.py:base"), extra=["train.steps=100"],
        prefix="gs://my-bucket/sw", storage=GRPC, study="s1", tpu=["sweep-b", "us-central2-b"],
    )  # fmt: skip
    link = json.dumps({"storage": GRPC, "study": "s1", "trial_id": 3, "objective": "eval/accuracy",
                       "direction": "maximize", "retry_s": 300.0,
                       "pruner": {"name": "median", "n_startup_trials": 2}})  # fmt: skip
    name = "lr=0.0001,num_candidates=8"
    point = {"train.lr": 0.0001, "train.num_candidates": 8}
    cmd = trial_command(plan, "realm", name, f"gs://my-bucket/sw/{name}", point,
                        "gs://my-bucket/sw/data", link)  # fmt: skip
    assert cmd[0] == LAUNCH
    r = _run(LAUNCH, "--dry-run", *cmd[1:])
    assert r.returncode == 0, r.stderr
    (train,) = [_flag(w, "--command") for w in _ssh_lines(r.stdout) if "--worker=all" in w]
    assert {w[5] for w in _ssh_lines(r.stdout)} == {"sweep-b"}
    assert _exported(train) == {"REALM_JAX_TRIAL": link}
    words = _words(train.split(" && exec ")[1].split(" > ")[0])
    assert words[:9] == [
        ".venv/bin/python", "-m", "realm_jax", "train", "--config", "configs/realm.py:base",
        "--workdir", f"gs://my-bucket/sw/{name}", "--multihost",
    ]  # fmt: skip
    assert words[9:] == [
        "--config.train.steps=100", "--config.train.lr=0.0001",
        "--config.train.num_candidates=8", "--config.data.data_dir=gs://my-bucket/sw/data",
    ]  # fmt: skip
    assert f"logs/{name}/train-w" in train


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--storage is required"),
        (["--storage", "sqlite:////tmp/study.db"], "is a file on this machine"),
        (["--storage", "postgresql://u:p@localhost/db"], "names localhost, which on each TPU VM"),
        (["--storage", "mysql://u@127.0.0.1:3306/db"], "names 127.0.0.1, which on each TPU VM"),
        (["--storage", "postgresql:///db"], "names no host"),
        (["--storage", "grpc://proxy-host"], "must be postgresql://USER:PASSWORD@HOST/DB"),
        (["--storage", "redis://h/0"], "must be postgresql://USER:PASSWORD@HOST/DB"),
        ([GRPC, "--trials", "0"], "--trials must be a positive whole number"),
        ([GRPC, "--study", "my study"], "--study 'my study'"),
        ([GRPC, "sweeps/lr"], "PREFIX must be gs://BUCKET/FOLDER or an absolute path"),
        ([GRPC, "gs://my-bucket"], "PREFIX must be gs://BUCKET/FOLDER (a folder inside"),
        ([GRPC, "SPEC", "/abs/configs/realm.py"], "CONFIG_FILE must be relative to the repo root"),
        ([GRPC, "SPEC", "configs/nope.py"], "config file not found"),
        ([GRPC, "SLICES", "tpu1"], "slice 'tpu1' must be NAME:ZONE"),
        ([GRPC, "SLICES", "tpu1:z"], "slice 'tpu1:z' must be NAME:ZONE"),
        ([GRPC, "SLICES", "Tpu1:us-central2-b"], "slice 'Tpu1:us-central2-b' must be NAME:ZONE"),
        ([GRPC, "SLICES", "a:us-central2-b,"], "with no empty entry"),
        ([GRPC, "SLICES", "a:us-central2-b,a:us-east5-a"], "slice a is named twice"),
        ([GRPC, "--config.train.lr"], "must be --config.section.field=value"),
        ([GRPC, "--workers", "2"], "unknown option --workers"),
    ],
)  # fmt: skip
def test_sweep_refuses_bad_arguments(args, message):
    """One line, exit 2, nothing printed or run. GRPC stands for `--storage GRPC`; a bare prefix,
    SPEC or SLICES replaces that positional argument."""
    pos = {"PREFIX": "gs://my-bucket/sw", "SPEC": "configs/realm.py:base",
           "SLICES": "a:us-central2-b"}  # fmt: skip
    opts = []
    it = iter(args)
    for a in it:
        if a == GRPC:
            opts += ["--storage", GRPC]
        elif a in ("SPEC", "SLICES"):
            pos[a] = next(it)
        elif a.startswith(("gs:", "sweeps")):
            pos["PREFIX"] = a
        else:
            opts.append(a)
    r = _run(SWEEP, "--dry-run", *opts, *pos.values())
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.splitlines()
    assert message in line


# Stand-ins for the sweep run for real: gcloud answers `tpu-vm describe NAME` with the state
# FAKE_STATES gives NAME (no entry: no such TPU VM), python records its arguments, its working
# folder and PYTHONPATH.
DESCRIBE_GCLOUD = """#!/usr/bin/env bash
[ "$1 $2 $3 $4" = "compute tpus tpu-vm describe" ] || exit 9
for pair in $FAKE_STATES; do [ "${pair%%=*}" = "$5" ] && echo "${pair#*=}" && exit 0; done
echo "ERROR: NOT_FOUND" >&2; exit 1
"""
RECORD_PYTHON = """#!/usr/bin/env bash
{ pwd; printf '%s\\n' "$PYTHONPATH" "$@"; } > "$RECORD"
"""


@pytest.fixture
def sweep_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(DESCRIBE_GCLOUD)
    (bin_dir / "python").write_text(RECORD_PYTHON)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
        "RECORD": str(tmp_path / "record"),
    }  # fmt: skip
    return env, tmp_path / "record"


def test_sweep_checks_the_slices_then_runs_the_study(sweep_env):
    env, record = sweep_env
    args = ["--storage", GRPC, "gs://my-bucket/sw", "configs/realm.py:base",
            "a:us-central2-b,b:europe-west4-a", "--config.train.steps=9"]  # fmt: skip
    r = _run_env(dict(env, FAKE_STATES="a=READY b=READY"), SWEEP, *args)
    assert r.returncode == 0, r.stderr
    cwd, pythonpath, *argv = record.read_text().splitlines()
    assert cwd == REPO and pythonpath.split(os.pathsep)[0] == REPO
    assert argv == [
        "-m", "realm_jax", "sweep", "--config", "configs/realm.py:base", "--workdir",
        "gs://my-bucket/sw", "--storage", GRPC, "--tpu", "a:us-central2-b,b:europe-west4-a",
        "--workers", "2", "--config.train.steps=9",
    ]  # fmt: skip
    (add,) = [x for x in r.stdout.splitlines() if x.startswith("add workers from another")]
    assert _words(add.split(": ", 1)[1]) == [
        "tpu/sweep.sh", "--storage", GRPC, "--study", "sweep", "gs://my-bucket/sw",
        "configs/realm.py:base", "OTHER_NAME:ZONE", "--config.train.steps=9",
    ]  # fmt: skip

    for states, message in (
        ("a=READY", "no TPU VM b in europe-west4-a (a queued resource?"),
        ("a=READY b=CREATING", "TPU VM b in europe-west4-a is CREATING, not READY"),
    ):
        record.unlink(missing_ok=True)
        r = _run_env(dict(env, FAKE_STATES=states), SWEEP, *args)
        assert r.returncode == 2 and not record.exists(), r.stdout + r.stderr
        (line,) = r.stderr.splitlines()
        assert message in line
