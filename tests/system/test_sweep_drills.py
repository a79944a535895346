"""The sweep engine's drills (issue 60): a worker killed with -9 mid-trial (the study goes on, the
dead trial fails and is retried once in its folder, resuming from its checkpoint, nothing else
lost); the SQLite study locked for seconds while two workers run (the study completes with every
evaluation reported); Ctrl-C (the trial checkpoints, exit 130, the same command resumes it); and
a pruner stopping a deliberately bad trial at its first evaluation (PRUNED in the table, a
checkpoint at that step). Each runs `realm-jax sweep` as its own process on tiny runs, and reads
the study's SQLite file with sqlite3."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.support import sweeps
from tests.support.realm_fixtures import TINY_NETWORKS
from tests.support.sweeps import ICT, REALM, read_trials

pytestmark = pytest.mark.system

# Tiny ICT runs on 60 passages of the sample, stop requests checked every step
ICT_RUNS = sweeps.ICT_COMMON + ["train.log_every=5", "train.stop_check_every=1"]
REALM_COMMON = TINY_NETWORKS + [
    "data.block_len=64",
    "data.query_len=32",
    "data.max_predictions=5",
    "data.masking=random",
    "data.eval_split_key=doc_id",
    "data.eval_fraction=0.25",
    "train.batch_size=8",
    "train.num_candidates=4",
    "train.warmup_steps=1",
    "train.eval_batch_size=8",
    "refresh.mode=inprocess",
]
STARTED = []  # the sweeps a test started: stopped at its end if still running


@pytest.fixture(autouse=True)
def _stop_leftovers():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:  # its workers and trainers die with it (PR_SET_PDEATHSIG)
            proc.kill()
            proc.wait(timeout=60)


def _start(tmp_path, task, body, overrides, *flags, prefix=None):
    """`realm-jax sweep` as its own process (its output in tmp_path/sweep-N.out)."""
    config = sweeps.sweep_config(tmp_path, body, task=task)
    prefix = prefix or str(tmp_path / "sweep")
    n = len(list(tmp_path.glob("sweep-*.out")))
    out = open(tmp_path / f"sweep-{n}.out", "w")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env["XLA_FLAGS"] = sweeps.two_device_flags(env.get("XLA_FLAGS", ""))
    cmd = [sys.executable, "-m", "realm_jax", "sweep", "--config", f"{config}:smoke"]
    cmd += ["--workdir", prefix, f"--config.data.corpus={sweeps.sample_corpus(tmp_path)}", *flags]
    cmd += [f"--config.{o}" for o in overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    proc.out_path, proc.prefix = out.name, prefix
    STARTED.append(proc)
    return proc


def _output(proc) -> str:
    return open(proc.out_path).read()


def _wait(what, predicate, timeout=300.0, proc=None):
    end = time.time() + timeout
    while time.time() < end:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the sweep ended (exit {proc.returncode}) before {what}:\n"
                        + _output(proc)[-4000:])  # fmt: skip
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}" + (f":\n{_output(proc)[-4000:]}" if proc else ""))


def _log(workdir) -> str:
    try:
        return open(os.path.join(workdir, "sweep.log"), errors="replace").read()
    except FileNotFoundError:
        return ""


def _training_past(prefix, step):
    """(number, trial) of a running trial whose log shows a step past `step`, else None."""
    try:
        trials = read_trials(prefix)
    except sqlite3.OperationalError:  # not there yet, or its tables being made
        return None
    for number, t in trials.items():
        workdir = t["attrs"].get("workdir")
        if t["state"] == "RUNNING" and workdir and "worker" in t["attrs"]:
            log = _log(workdir)
            if any(f"step {s}/" in log for s in range(step, step + 30, 5)):
                return number, t
    return None


def _metrics(workdir) -> dict:
    with open(os.path.join(workdir, "metrics.json")) as f:
        return json.load(f)


def test_a_worker_killed_mid_trial(tmp_path):
    """kill -9 of one of two workers while its trial trains: its trainer gets SIGTERM and
    checkpoints, the trial goes FAIL after the grace period (heartbeats) and runs once more in
    its own folder from its checkpoint; the other trials are untouched, the study completes."""
    body = "[{'train.seed': 0}, {'train.seed': 1}, {'train.seed': 2}]"
    over = [*ICT_RUNS, "train.steps=120", "train.checkpoint_every=10", "train.eval_every=60"]
    proc = _start(tmp_path, ICT, body, over, "--workers", "2", "--heartbeat_s", "1",
                  "--grace_s", "6")  # fmt: skip
    number, victim = _wait("a trial training past step 20",
                           lambda: _training_past(proc.prefix, 20), proc=proc)  # fmt: skip
    pid = int(victim["attrs"]["worker"].rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, _output(proc)[-5000:]
    out = _output(proc)
    assert f"sweep: trial {number} failed: no heartbeat for" in out
    assert "was killed (signal 9)" in out
    trials = read_trials(proc.prefix)
    retry = [n for n, t in trials.items() if t["system"].get("failed_trial") == number]
    assert len(retry) == 1, trials
    (retry,) = retry
    assert len(trials) == 4  # three points, one retry: nothing else ran again
    assert trials[number]["state"] == "FAIL"
    assert "no heartbeat" in trials[number]["attrs"]["fail_reason"]
    assert [n for n, t in trials.items() if t["state"] == "FAIL"] == [number]
    assert trials[retry]["params"] == victim["params"]
    workdir = victim["attrs"]["workdir"]
    assert trials[retry]["attrs"]["workdir"] == workdir  # the same folder ...
    log = _log(workdir)
    assert "stop requested (signal 15)" in log  # ... where the orphaned trainer checkpointed
    resumed = int(log.split("resumed from checkpoint ")[1].split()[0])
    assert resumed >= 20  # ... and the retry went on from there
    seeds = sorted(t["params"]["train.seed"] for t in trials.values() if t["state"] == "COMPLETE")
    assert seeds == [0, 1, 2]
    for t in trials.values():
        if t["state"] == "COMPLETE":
            m = _metrics(t["attrs"]["workdir"])
            assert m["complete"] and m["step"] == 120
            assert t["values"] == [pytest.approx(m["eval"]["recall@5"], rel=1e-9)]
    rows = open(os.path.join(proc.prefix, "sweep.csv")).read()
    assert f"FAIL (retried as #{retry}; no heartbeat for" in rows


def test_a_locked_sqlite_study(tmp_path):
    """Two workers run while another connection holds the study's SQLite file under an
    exclusive lock for 8 s: heartbeats, reports and tells wait or retry; the study completes with
    every evaluation of both trials in it."""
    body = "[{'train.seed': 0}, {'train.seed': 1}]"
    over = [*ICT_RUNS, "train.steps=60", "train.checkpoint_every=20", "train.eval_every=10"]
    proc = _start(tmp_path, ICT, body, over, "--workers", "2", "--heartbeat_s", "1")
    _wait("both trials training",
          lambda: _training_past(proc.prefix, 5) and sum(
              "step 5/" in _log(t["attrs"].get("workdir", "/nonexistent"))
              for t in read_trials(proc.prefix).values()) == 2, proc=proc)  # fmt: skip
    con = sqlite3.connect(os.path.join(proc.prefix, "study.db"), timeout=60, isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    time.sleep(8)
    con.execute("COMMIT")
    con.close()
    assert proc.wait(timeout=600) == 0, _output(proc)[-5000:]
    assert "database is locked" in _output(proc)  # a trainer's report met the lock, retried
    trials = read_trials(proc.prefix)
    assert sorted(t["state"] for t in trials.values()) == ["COMPLETE", "COMPLETE"]
    for t in trials.values():
        assert t["steps"] == [0, 10, 20, 30, 40, 50, 60]  # no evaluation lost
        m = _metrics(t["attrs"]["workdir"])
        assert t["values"] == [pytest.approx(m["eval"]["recall@5"], rel=1e-9)]


def test_ctrl_c_checkpoints_and_the_same_command_resumes(tmp_path):
    body = "[{'train.seed': 0}]"
    over = [*ICT_RUNS, "train.steps=120", "train.checkpoint_every=10", "train.eval_every=60"]
    proc = _start(tmp_path, ICT, body, over)
    number, t = _wait("the trial training past step 20",
                      lambda: _training_past(proc.prefix, 20), proc=proc)  # fmt: skip
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130, _output(proc)[-4000:]
    assert "re-run the same command to go on" in _output(proc)
    trials = read_trials(proc.prefix)
    assert [trials[n]["state"] for n in sorted(trials)] == ["FAIL", "WAITING"]
    assert "interrupted" in trials[0]["attrs"]["fail_reason"]
    workdir = t["attrs"]["workdir"]
    log = _log(workdir)
    assert "stop requested (signal 2)" in log
    stopped = _metrics(workdir)["step"]
    assert 20 <= stopped < 120

    again = _start(tmp_path, ICT, body, over, prefix=proc.prefix)
    assert again.wait(timeout=600) == 0, _output(again)[-4000:]
    trials = read_trials(proc.prefix)
    assert [trials[n]["state"] for n in sorted(trials)] == ["FAIL", "COMPLETE"]
    assert trials[1]["attrs"]["workdir"] == workdir and trials[1]["attrs"]["rerun_of"] == 0
    assert f"resumed from checkpoint {stopped}" in _log(workdir)
    rows = open(os.path.join(proc.prefix, "sweep.csv")).read()
    assert "FAIL (retried as #1; interrupted" in rows


def test_a_bad_trial_is_pruned_at_its_first_evaluation(tmp_path):
    """REALM's held-out loss (minimized), a median pruner deciding from step 2 against one
    complete trial: the trial with a learning rate of 1e-9 (nothing learnt) is pruned at step 2,
    where its checkpoint is saved (checkpoints every 4 steps otherwise)."""
    body = """space.Grid([{"train.lr": 3e-3}, {"train.lr": 1e-9}], objective="eval/loss",
        direction="minimize", pruner="median",
        pruner_args={"n_startup_trials": 1, "n_warmup_steps": 1})"""
    over = [*REALM_COMMON, "train.steps=4", "train.log_every=2", "train.checkpoint_every=4",
            "train.eval_every=2", "refresh.every=2"]  # fmt: skip
    proc = _start(tmp_path, REALM, body, over)
    assert proc.wait(timeout=900) == 0, _output(proc)[-5000:]
    trials = read_trials(proc.prefix)
    assert [trials[n]["state"] for n in (0, 1)] == ["COMPLETE", "PRUNED"]
    good, bad = trials[0], trials[1]
    assert good["steps"] == [0, 2, 4] and bad["steps"] == [0, 2]
    workdir = bad["attrs"]["workdir"]
    pruned = json.load(open(os.path.join(workdir, "PRUNED")))
    assert pruned["step"] == 2
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", "2"]
    assert _metrics(workdir)["complete"] is False
    rows = open(os.path.join(proc.prefix, "sweep.md")).read()
    assert "| 1 | lr=1e-09 | PRUNED at step 2 |" in rows
    png = os.path.join(proc.prefix, "plots", "intermediate_values.png")
    assert open(png, "rb").read(4) == b"\x89PNG"
    assert "sweep: trial 1 PRUNED at step 2" in _output(proc)
