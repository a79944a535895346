"""The loop's instruments (issue 58): the goodput split, MFU by hand, the peak table, the
FLOPs of a compiled step, the profile span's checks and metrics.json's keys."""

import json
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import workdir as paths
from realm_jax.config import ConfigError
from realm_jax.train import goodput, instruments, loop


class Clock:
    """A fake clock: `tick(s)` moves it on."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def tick(self, s):
        self.t += s


def test_goodput_split_sums_to_the_wall_time_and_nests():
    clock = Clock()
    g = goodput.Goodput(clock, redone_steps=2)
    with g.timed("compile"):
        clock.tick(5)
    for _ in range(4):
        g.steps += 1
        with g.timed("data"):
            clock.tick(0.5)
        with g.timed("step"):
            clock.tick(2)
    with g.timed("eval"):  # an evaluation that waits for an index swap: 1 s eval, 3 s index
        clock.tick(1)
        with g.timed("index"):
            clock.tick(3)
    with g.timed("checkpoint"):
        clock.tick(1.5)
    clock.tick(0.7)  # logging: no bucket
    split = g.split()
    parts = {k: split[k] for k in goodput.PARTS}
    assert sum(parts.values()) == pytest.approx(split["wall"]) == 5 + 10 + 4 + 1.5 + 0.7
    assert min(parts.values()) >= 0
    assert parts["eval"] == pytest.approx(1) and parts["index"] == pytest.approx(3)
    assert parts["redone"] == pytest.approx(4) and parts["step"] == pytest.approx(4)
    assert parts["other"] == pytest.approx(0.7)
    assert goodput.ratio(split) == pytest.approx(4 / 21.2)


class Device:
    """A fake asynchronous device on a fake clock: a step call returns at once, its outputs
    ready `seconds` after the device finishes the steps called before it."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds, self.free = clock, seconds, clock()

    def step(self, state, batch):
        self.free = max(self.free, self.clock()) + self.seconds
        return state, {"loss": Pending(self.clock, self.free)}

    def wait(self):  # what reading the state does (an evaluation, a refresh, a save)
        self.clock.t = max(self.clock.t, self.free)


class Pending:
    def __init__(self, clock, at):
        self.clock, self.at = clock, at

    def is_ready(self):
        return self.clock() >= self.at

    def block_until_ready(self):
        self.clock.t = max(self.clock.t, self.at)
        return self


def compiled_meter(clock, batch_size=8):
    m = instruments.Meter(batch_size=batch_size, start=0, clock=clock)
    m.flops, m.peak, m.tokens, m.compiled = 3e12, 1e14, 256, True
    return m


def test_mfu_is_flops_over_step_time_over_peak():
    clock = Clock()
    m = compiled_meter(clock)
    device = Device(clock, 0.4)
    with m.timed("compile"):  # before the window (the compiling call starts it)
        clock.tick(9)
    m.last = (clock(), 0, 0.0)
    for _ in range(10):
        with m.timed("data"):  # stays in: it slows the steady state
            clock.tick(0.1)
        m.call_step(device.step, None, {}, {})
        device.wait()  # a host that waits for every step (the loop's log fetch)
    with m.timed("checkpoint"):  # left out
        clock.tick(2)
    v = m.values(10)
    assert v["step_time"] == pytest.approx(0.5) and v["steps_per_sec"] == pytest.approx(2)
    assert v["mfu"] == pytest.approx(3e12 / 0.5 / 1e14)
    assert v["tflops_per_device"] == pytest.approx(6.0)
    assert v["examples_per_sec"] == pytest.approx(16) and v["tokens_per_sec"] == pytest.approx(512)
    assert instruments.mfu(None, 0.5, 1e14) is None and instruments.mfu(1.0, 0.5, None) is None
    summary = instruments.summary(v)
    assert summary["mfu"] == v["mfu"] and summary["goodput"] == v["goodput"]
    assert summary["goodput_split"]["wall"] == pytest.approx(16)


@pytest.mark.parametrize("bucket", ["eval", "index", "checkpoint"])
def test_speed_counts_the_steps_an_evaluation_or_refresh_waited_for(bucket):
    """The loop dispatches steps back to back (a step call returns before the step ran);
    the evaluation or in-process refresh after them reads the state, so it first waits for
    them. That wait is the steps' time: taken for the evaluation's and left out, it made a
    run's ex/s 3x its steps/s x batch and MFU 193% (steps 41-60, eval and refresh at 50)."""
    clock = Clock()
    m = compiled_meter(clock, batch_size=16)
    device = Device(clock, 1.0)  # a step runs 1 s on the device
    m.last = (clock(), 0, 0.0)
    for _ in range(10):  # steps 1-10: dispatched in 10 ms each, done at t0 + 10 s
        with m.timed("step"):
            m.call_step(device.step, None, {}, {})
            clock.tick(0.01)
    settle = {"settle": True} if bucket == "index" else {}  # the task says it reads the state
    with m.timed(bucket, **settle):  # it waits for the 10 steps, then 5 s of its own
        device.wait()
        clock.tick(5)
    for _ in range(10):  # steps 11-20, then the log step's metrics fetch
        m.call_step(device.step, None, {}, {})
        clock.tick(0.01)
    with m.timed("step"):
        device.wait()
    v = m.values(20)
    assert v["step_time"] == pytest.approx(1.0, rel=0.02)
    assert v["examples_per_sec"] == pytest.approx(16 * v["steps_per_sec"])
    assert v["examples_per_sec"] == pytest.approx(16, rel=0.02)
    assert v["mfu"] == pytest.approx(3e12 / 1.0 / 1e14, rel=0.02)
    split = m.goodput.split()  # the wait is step time in the goodput split too
    assert split[bucket] == pytest.approx(5) and split["step"] == pytest.approx(20, abs=0.15)


def test_an_index_stretch_that_overlapped_running_steps_stays_in_the_step_time():
    """REALM's index check runs before every step: unless the task says it reads the state
    it does not wait for the device (that would stall the dispatch), so while steps run its
    time is theirs, not left out; after they finished, it is left out."""
    clock = Clock()
    m = compiled_meter(clock)
    device = Device(clock, 1.0)
    m.last = (clock(), 0, 0.0)
    for _ in range(4):
        with m.timed("index"):  # the first: no step ran yet, left out; the others overlap
            clock.tick(0.2)  # host work while the step before runs
        m.call_step(device.step, None, {}, {})
    device.wait()
    clock.tick(3)  # idle host: nothing ran
    with m.timed("index"):  # after the steps finished: left out
        clock.tick(7)
    m.call_step(device.step, None, {}, {})
    device.wait()
    v = m.values(5)
    # 15.2 s of wall time: 4 steps done at 4.2 s, 3 s idle, 7 s left out, the 5th step's 1 s
    assert v["step_time"] == pytest.approx((15.2 - 0.2 - 7) / 5)


@pytest.mark.parametrize(
    "kind,peak",
    [("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v6 lite", 918e12)]
    + [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12), ("TPU v9", None)],
)
def test_peak_flops_by_device_kind(kind, peak):
    device = types.SimpleNamespace(platform="tpu", device_kind=kind)
    assert instruments.peak_flops(device) == peak


def test_cpu_peak_is_a_measured_matmul_shared_by_the_cpu_devices():
    measured = instruments.cpu_matmul_flops()
    assert measured > 1e8 and instruments.cpu_matmul_flops() == measured  # once per process
    assert instruments.peak_flops() == pytest.approx(measured / jax.local_device_count())


def test_the_first_call_gives_the_compiled_steps_flops_and_compile_time():
    n = 96
    f = jax.jit(lambda s, b: (s, {"y": (b["query_ids"].astype(jnp.float32) @ s).sum()}))
    m = instruments.Meter(batch_size=n, start=0)
    state = jnp.ones((n, n), jnp.float32)
    local = {"query_ids": np.ones((n, n), np.int32)}
    m.call_step(f, state, {"query_ids": jnp.asarray(local["query_ids"])}, local)
    assert m.flops == pytest.approx(2 * n**3, rel=0.1)
    assert m.compile_seconds > 0 and m.tokens == n * n * jax.process_count()
    used, peak = instruments.memory_bytes()
    assert used > 0 and peak > 0


def test_a_step_whose_layers_run_in_a_scan_counts_every_trip():
    """XLA's cost analysis counts a loop's body once; the Meter adds the later trips (as a
    remat'd model's layers run: model.remat), so 8 matmuls in a scan are 8 x 2 n^3."""
    n, trips = 64, 8

    def step(s, b):
        def layer(x, _):
            return jnp.tanh(x @ s), None

        y = jax.lax.scan(layer, b["query_ids"].astype(jnp.float32), None, length=trips)[0]
        return s, {"y": y.sum()}

    m = instruments.Meter(batch_size=n, start=0)
    local = {"query_ids": np.ones((n, n), np.int32)}
    m.call_step(jax.jit(step), jnp.eye(n), {"query_ids": jnp.asarray(local["query_ids"])}, local)
    assert m.flops == pytest.approx(trips * 2 * n**3, rel=0.1)


def test_profile_span_outside_the_run_is_skipped_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "realm_jax.train"):
        assert instruments.Profile("3:30", str(tmp_path), 0, 20).span is None
        assert instruments.Profile("2:4", str(tmp_path), 5, 20).span is None  # resumed at 5
    assert caplog.text.count("no trace") == 2
    assert instruments.Profile("", str(tmp_path), 0, 20).span is None
    assert instruments.Profile("6:8", str(tmp_path), 5, 20).span == (6, 8)
    with pytest.raises(ConfigError, match="A:B"):
        instruments.Profile("3-4", str(tmp_path), 0, 20)


def test_metrics_json_holds_mfu_and_goodput(tmp_path):
    task = loop.Task(name="t", step=None)
    perf = {"mfu": 0.25, "goodput": 0.5, "goodput/step": 1.0, "goodput/wall": 2.0}
    perf["step_time"] = 0.1
    loop.write_final_metrics(str(tmp_path), 4, 4, [{"step": 4, "loss": 1.0}], task, perf)
    out = json.loads(open(paths.metrics_path(str(tmp_path))).read())
    assert out["mfu"] == 0.25 and out["goodput"] == 0.5
    assert out["goodput_split"] == {"step": 1.0, "wall": 2.0}
    assert out["instruments"] == {"step_time": 0.1} and out["train"] == {"loss": 1.0}


def test_redone_steps_are_the_logged_steps_past_the_restored_checkpoint(tmp_path):
    from realm_jax.train.metrics import MetricWriter

    work = str(tmp_path)
    assert goodput.redone_steps(work, 8) == 0  # nothing logged: not knowable, 0
    writer = MetricWriter(paths.tb_dir(work))  # a run killed after logging step 11
    for s in range(1, 12):
        writer.scalars(s, {"loss": 1.0})
    writer.close()
    assert goodput.redone_steps(work, 8) == 3 and goodput.redone_steps(work, 0) == 0
    assert goodput.redone_steps(work, 12) == 0
