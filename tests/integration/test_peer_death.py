"""A process of a multi-process job dies (kill -9): the others stop within a bound, never hang.

Two `realm-jax train` processes x 2 fake CPU devices (gloo collectives), as a pod runs them.
Process 1 is killed at the last step, after checkpoint 4, as the final checkpoint is being
saved; process 0, which hosts JAX's coordination service, must then exit non-zero within the
heartbeat bound (realm_jax/runtime.py) saying that another task died, instead of waiting in a
collective for ever. Relaunching both resumes from checkpoint 4 and logs the same losses, step
for step, as the first launch did before the kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from realm_jax import runtime
from realm_jax import workdir as paths
from realm_jax.config import load_config
from realm_jax.data import prepare
from realm_jax.train.metrics import read_scalars
from tests.conftest import REPO
from tests.support.realm_fixtures import TINY_NETWORKS

STEPS, EVERY = 8, 4  # checkpoints at 0, 4, 8: the kill lands after 4, the relaunch resumes there
HEARTBEAT_S = 10  # REALM_JAX_HEARTBEAT_TIMEOUT for these runs: a short bound keeps the test short
# How long the survivor may take after the kill: the heartbeat timeout, the coordination
# service's next check, and the abort; with slack for 2 busy shared cores.
BOUND_S = HEARTBEAT_S + 20
# What JAX's client prints when the coordination service reports a dead task (or is gone).
JAX_PEER_DIED = "Terminating process because the JAX distributed service detected fatal errors"
DATA = ["data.block_len=64", "data.query_len=32", "data.max_predictions=5", "data.masking=random"]
OVERRIDES = [
    *TINY_NETWORKS,
    *DATA,
    "train.batch_size=8",
    "train.num_candidates=4",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.lr=1e-3",
    "train.log_every=1",
    f"train.checkpoint_every={EVERY}",
    "train.eval_every=0",
    "train.record_example_ids=true",
    "refresh.mode=inprocess",
    f"refresh.every={EVERY}",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """60 passages of the bundled sample, prepared with random masking."""
    root = tmp_path_factory.mktemp("corpus")
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        (root / "corpus.jsonl").write_text("".join(f.readlines()[:60]))
    ddir = str(root / "prepared")
    spec = os.path.join(REPO, "configs", "realm.py") + ":smoke"
    prepare.prepare(load_config(spec, [*DATA, f"data.corpus={root / 'corpus.jsonl'}"]), ddir)
    return ddir


def _launch(workdir: str, data_dir: str, log_dir, env: dict) -> list[subprocess.Popen]:
    """Both processes of a 2-process `realm-jax train` job on loopback, each logging to
    log_dir/<basename(workdir)>.p<I>.log (appended: a relaunch adds to the same log)."""
    import portpicker

    port = portpicker.pick_unused_port()
    procs = []
    for i in range(2):
        cmd = [
            *(sys.executable, "-m", "realm_jax", "train", "--workdir", workdir),
            *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
            *("--cpu_devices", "2", "--coordinator", f"127.0.0.1:{port}"),
            *("--num_processes", "2", "--process_id", str(i)),
            *[f"--config.{o}" for o in OVERRIDES],
            f"--config.data.data_dir={data_dir}",
        ]
        with open(log_dir / f"{os.path.basename(workdir)}.p{i}.log", "ab") as log:
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


def _wait_for_final_step(workdir: str, log_path, procs, timeout: float) -> None:
    """Until process 0 has logged the last step (it prints it before it saves that step's
    checkpoint) with the checkpoint of step EVERY complete (orbax renames its temporary folder
    to the bare step number once the save is done)."""
    ckpt_dir = paths.checkpoint_dir(workdir)
    deadline = time.time() + timeout
    while time.time() < deadline:
        names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
        if str(EVERY) in names and f"step {STEPS}/{STEPS} |" in log_path.read_text(
            "utf-8", "replace"
        ):
            return
        ended = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert not ended, f"process {ended} ended before step {STEPS}"
        time.sleep(0.02)
    raise AssertionError(f"step {STEPS} not reached in {timeout} s")


def _wait_all(procs, timeout: float) -> list[int]:
    """The exit codes of `procs`, all within `timeout` seconds (else kill them all)."""
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


def _example_ids(workdir: str) -> list[tuple[int, list]]:
    """(step, example ids) per line of train.record_example_ids' file, in order: a relaunch
    appends the steps it trains again."""
    with open(paths.example_ids_path(workdir)) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(r["step"], r["example_ids"]) for r in records]


@pytest.mark.system  # a kill -9 drill of a 2-process job (~2 min); CI: the heartbeat setting
def test_a_killed_process_stops_the_job_and_a_relaunch_resumes_the_loss_curve(data_dir, tmp_path):
    """Process 1 is killed at the last step, as the final checkpoint is being saved: the run
    is uninterrupted up to there (its logged losses are the reference) and the relaunch has to
    go back to checkpoint EVERY, train the same steps again and log the same losses."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not conftest's fake devices
    env.update(
        JAX_PLATFORMS="cpu",
        **{runtime.HEARTBEAT_TIMEOUT_ENV: str(HEARTBEAT_S)},
        # The relaunch reuses the first launch's compiled programs.
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    workdir, survivor_log = str(tmp_path / "run"), tmp_path / "run.p0.log"
    procs = _launch(workdir, data_dir, tmp_path, env)
    try:
        _wait_for_final_step(workdir, survivor_log, procs, timeout=400)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        try:
            code = procs[0].wait(timeout=BOUND_S + 60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.time() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = survivor_log.read_text("utf-8", "replace")
    assert code is not None and code != 0, f"process 0 still running {took:.0f} s after the kill"
    assert took <= BOUND_S, f"process 0 took {took:.0f} s to stop (bound {BOUND_S} s)"
    assert JAX_PEER_DIED in text, text[-3000:]
    if "Traceback" in text:  # a collective raised before JAX stopped the process: the loop
        # said why in one line, before the traceback
        said = text.find("another process of this job has died or stalled")
        assert 0 <= said < text.index("Traceback"), text[-3000:]
    before = read_scalars(workdir)["loss"]  # steps 1..STEPS, never interrupted
    assert sorted(before) == list(range(1, STEPS + 1)), text[-3000:]
    saved = os.listdir(paths.checkpoint_dir(workdir))
    assert str(STEPS) not in saved, f"the kill came after checkpoint {STEPS} was complete: {saved}"

    relaunched = _launch(workdir, data_dir, tmp_path, env)
    codes = _wait_all(relaunched, timeout=300)
    text = survivor_log.read_text("utf-8", "replace")
    assert codes == [0, 0], f"exit codes {codes}: {text[-3000:]}"
    resumed_from = [int(w.split()[-1]) for w in text.splitlines() if "resumed from checkpoint" in w]
    assert resumed_from == [EVERY], text[-3000:]

    after = read_scalars(workdir)["loss"]  # the relaunch's values for the steps it trained
    for step in range(EVERY + 1, STEPS + 1):
        np.testing.assert_allclose(after[step], before[step], rtol=1e-5, err_msg=f"step {step}")
    ids = _example_ids(workdir)
    first, last = dict(reversed(ids)), dict(ids)  # the first launch's line, the relaunch's
    assert [s for s, _ in ids] == [*range(1, STEPS + 1), *range(EVERY + 1, STEPS + 1)]
    assert first == last
    metrics = json.loads(open(paths.metrics_path(workdir)).read())
    assert metrics["complete"] and metrics["step"] == STEPS, metrics


def test_heartbeat_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(runtime.HEARTBEAT_TIMEOUT_ENV, raising=False)
    assert runtime.heartbeat_timeout() == runtime.HEARTBEAT_TIMEOUT_S
    monkeypatch.setenv(runtime.HEARTBEAT_TIMEOUT_ENV, "45")
    assert runtime.heartbeat_timeout() == 45
    for bad in ("0", "-5", "1.5", "soon"):
        monkeypatch.setenv(runtime.HEARTBEAT_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="REALM_JAX_HEARTBEAT_TIMEOUT"):
            runtime.heartbeat_timeout()


def test_peer_lost_message_names_a_lost_peer_only_in_a_multi_process_job(monkeypatch):
    import jax

    gloo = RuntimeError(
        "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
        "Read error [127.0.0.1]:22663: Connection reset by peer"
    )
    assert runtime.peer_lost_message(gloo) is None  # one process: nothing to lose
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    message = runtime.peer_lost_message(gloo)
    assert message.startswith("process 0 of 2: a collective with the other processes failed")
    assert "Connection reset by peer" in message and "\n" not in message
    assert runtime.peer_lost_message(RuntimeError("RESOURCE_EXHAUSTED: out of memory")) is None
