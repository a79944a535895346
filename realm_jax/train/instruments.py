"""The loop's instruments, in every run (REALM, ICT, fine-tuning): step time, examples/s and
tokens/s, TFLOP/s per device and MFU, compile time, device memory and goodput (goodput.py),
as one dict (`Meter.values`) that the console line, TensorBoard and metrics.json all read;
and train.profile_steps' jax.profiler trace (`Profile`).

FLOPs come from XLA's cost analysis of the executables the first step call compiled (the
tasks' steps are closures around their jitted functions, so the loop cannot `.lower` them;
the executables JAX built during that call are the step's, compiled once, nothing again).
The executable is the partitioned, per-device program: its flops are one device's."""

from __future__ import annotations

import functools
import logging
import os
import resource
import time

import jax
import jax.numpy as jnp

from realm_jax import hlo_cost
from realm_jax.config import ConfigError
from realm_jax.train import goodput

log = logging.getLogger("realm_jax.train")

# Dense bf16 peak FLOP/s per JAX device, by a lowercased substring of device_kind (first match
# wins: "v5 lite" before "v5"). A v2/v3 chip is 2 JAX devices (cores); v4 and v5p are one.
PEAK_FLOPS = (
    ("v6 lite", 918e12),  # v6e (Trillium)
    ("v6e", 918e12),
    ("v5 lite", 197e12),  # v5e
    ("v5e", 197e12),
    ("v5", 459e12),  # v5p
    ("v4", 275e12),
    ("v3", 61.5e12),  # 123e12 a chip
    ("v2", 22.5e12),  # 45e12 a chip
    ("h200", 989e12),  # SXM, dense
    ("h100 pcie", 756e12),
    ("h100", 989e12),  # SXM, dense
    ("a100", 312e12),
)
# the batch's input sequences (padding included); blocks a step gathers on device are not
TOKEN_KEYS = ("query_ids", "question_ids", "block_ids")
GIB = float(1 << 30)


@functools.cache
def cpu_matmul_flops(n: int = 1024) -> float:
    """A measured ceiling: FLOP/s of an n^3 float32 matmul on the default device, the best of
    3 (after a warm-up), once per process."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def peak_flops(device=None) -> float | None:
    """Peak FLOP/s of one device: PEAK_FLOPS by device_kind; on a CPU the measured matmul
    ceiling shared by the process's CPU devices; None for an accelerator not in the table."""
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        return cpu_matmul_flops() / jax.local_device_count()
    kind = device.device_kind.lower()
    return next((p for k, p in PEAK_FLOPS if k in kind), None)


def mfu(flops: float | None, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: one device's flops a step / step time / its peak FLOP/s."""
    if not flops or not peak or step_seconds <= 0:
        return None
    return flops / step_seconds / peak


def memory_bytes() -> tuple[float, float]:
    """(in use, peak) bytes: the first local device's memory_stats() where it has them (TPU,
    GPU), else the host process's resident set (now, and its peak)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        used = float(stats["bytes_in_use"])
        return used, float(stats.get("peak_bytes_in_use", used))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        used = peak
    return float(used), peak


def _live() -> list:
    return list(jax.local_devices()[0].client.live_executables())


def executables_flops(executables) -> float | None:
    """The summed flops of `executables` (None when no cost analysis has any): XLA's cost
    analysis, which counts a loop's body once, plus its loops' later trips (hlo_cost.loop_cost
    on the optimized HLO): a step whose layers run in a scan (model.remat) or whose
    micro-batches do (train.grad_accum) reported 1/layers of its FLOPs without them."""
    total, known = 0.0, False
    for exe in executables:
        try:
            cost = exe.cost_analysis()
        except Exception:  # a backend without cost analysis
            continue
        for c in cost if isinstance(cost, list | tuple) else [cost]:
            if c and "flops" in c:
                total, known = total + float(c["flops"]), True
        if known:
            total += _loop_flops(exe)
    return total if known and total > 0 else None


def _loop_flops(exe) -> float:
    """The FLOPs of a compiled executable's loops' trips after the first (0 when its HLO
    cannot be read)."""
    try:
        text = "\n".join(m.to_string() for m in exe.hlo_modules())
    except Exception:  # a backend that does not expose the optimized module
        return 0.0
    return hlo_cost.loop_cost(text)[0]


class Meter:
    """What the loop measures: step calls (the first: compile and FLOPs), the goodput buckets,
    and the speed between log points. `values` is the one place the figures are computed."""

    def __init__(self, batch_size: int, start: int, redone_steps: int = 0, clock=time.perf_counter):
        self.batch_size = batch_size
        self.goodput = goodput.Goodput(clock, redone_steps)
        self.flops = None  # one device's, a step
        self.tokens = 0  # a global step's input tokens
        self.compiled = False
        self.compile_seconds = 0.0
        self.peak = None
        self.last = (self.goodput.clock(), start, 0.0)  # (time, step, excluded seconds)
        self.speed: dict[str, float] = {}

    def timed(self, bucket: str):
        return self.goodput.timed(bucket)

    def call_step(self, step_fn, state, batch, local: dict):
        """step_fn(state, batch), timed: the first call as compile (and the executables it
        built give the step's FLOPs), the others as steps."""
        self.goodput.steps += 1
        if self.compiled:
            with self.timed("step"):
                return step_fn(state, batch)
        before = {id(e) for e in _live()}
        with self.timed("compile"):
            out = step_fn(state, batch)
        self.compiled = True
        self.compile_seconds = self.goodput.seconds["compile"]
        self.flops = executables_flops(e for e in _live() if id(e) not in before)
        self.peak = peak_flops()
        if self.flops is None or self.peak is None:
            log.warning("MFU not reported: no %s", "step FLOPs" if not self.flops else "peak")
        n = sum(v.size for k, v in local.items() if k in TOKEN_KEYS)
        self.tokens = n * jax.process_count()
        return out

    def _excluded(self) -> float:
        s = self.goodput.seconds
        return s["compile"] + s["checkpoint"] + s["eval"] + s["index"]

    def _update_speed(self, step: int) -> None:
        """Step time since the last log: wall time less compilation, saves, evaluations and
        index swaps (data waits stay in), over the steps taken. Measured after the metrics'
        fetch, which waited for the device: no blocking of its own."""
        now, excluded = self.goodput.clock(), self._excluded()
        t, s, ex = self.last
        self.last = (now, step, excluded)
        if step <= s:
            return
        step_time = max(1e-9, (now - t - (excluded - ex)) / (step - s))
        speed = {
            "step_time": step_time,
            "examples_per_sec": self.batch_size / step_time,
            "tokens_per_sec": self.tokens / step_time,
        }
        if self.flops:
            speed["tflops_per_device"] = self.flops / step_time / 1e12
        if (m := mfu(self.flops, step_time, self.peak)) is not None:
            speed["mfu"] = m
        self.speed = speed

    def values(self, step: int) -> dict[str, float]:
        """The instruments at `step` (flat floats, for the log line and TensorBoard): speed,
        compile_seconds, memory (GiB), goodput and goodput/<part> (seconds)."""
        self._update_speed(step)
        used, peak = memory_bytes()
        split = self.goodput.split()
        out = dict(self.speed)
        out.update(compile_seconds=self.compile_seconds, memory_gib=used / GIB)
        out.update(peak_memory_gib=peak / GIB, goodput=goodput.ratio(split))
        out.update({f"goodput/{k}": v for k, v in split.items()})
        return out


def summary(values: dict[str, float]) -> dict:
    """metrics.json's part: `mfu` (None when unknown), `goodput` (the ratio), `goodput_split`
    ({part: seconds}, with "wall") and `instruments` (the rest), from a Meter.values dict."""
    split = {k[8:]: v for k, v in values.items() if k.startswith("goodput/")}
    rest = {k: v for k, v in values.items() if not k.startswith("goodput")}
    rest.pop("mfu", None)
    return {
        "mfu": values.get("mfu"),
        "goodput": values.get("goodput"),
        "goodput_split": split,
        "instruments": rest,
    }


class Profile:
    """train.profile_steps = "A:B": a jax.profiler trace of steps A..B (1-based, as logged)
    under `logdir`, where TensorBoard's profile plugin finds it (plugins/profile/<run>/)."""

    def __init__(self, spec: str, logdir: str, start: int, steps: int):
        self.logdir, self.span, self.on = logdir, None, False
        if not spec:
            return
        try:
            a, b = (int(x) for x in spec.split(":"))
        except ValueError:
            msg = f"train.profile_steps={spec!r}: expected A:B (steps, A <= B)"
            raise ConfigError(msg) from None
        if not start < a <= b <= steps:
            log.warning(
                "train.profile_steps=%s: not within this run's steps %d..%d; no trace",
                spec,
                start + 1,
                steps,
            )
            return
        self.span = (a, b)

    def before(self, step: int) -> None:
        """Before the call that trains step `step` (1-based)."""
        if self.span and step == self.span[0] and not self.on:
            try:
                jax.profiler.start_trace(self.logdir)
            except Exception as e:  # a trace is not worth the run (a logdir it cannot write)
                log.warning("train.profile_steps: no trace (%s)", e)
                return
            self.on = True

    def after(self, step: int, metrics) -> None:
        """After step `step`'s call: at B, wait for its results, then stop the trace."""
        if self.on and step >= self.span[1]:
            jax.block_until_ready(metrics)
            self.stop()

    def stop(self) -> None:
        if self.on:
            self.on = False
            jax.profiler.stop_trace()
            log.info("profile of steps %d..%d in %s", *self.span, self.logdir)
