"""The loop's instruments, in every run (REALM, ICT, fine-tuning): step time, examples/s and
tokens/s, TFLOP/s per device and MFU, compile time, device memory and goodput (goodput.py),
as one dict (`Meter.values`) that the console line, TensorBoard and metrics.json all read;
and train.profile_steps' jax.profiler trace (`Profile`).

FLOPs come from XLA's cost analysis of the executables the first step call compiled (the
tasks' steps are closures around their jitted functions, so the loop cannot `.lower` them;
the executables JAX built during that call are the step's, compiled once, nothing again).
The executable is the partitioned, per-device program: its flops are one device's.

The speed figures are measured over completed work: a step call returns once the step is
dispatched, not done, so the step time is taken between points where the device has finished
the steps called (`Meter.settle`): the end of the first, compiling call, and each log point.
The stretches left out of it (saves, evaluations, index swaps) are left out only when no step
was running during them: saves and evaluations first wait for the steps in flight (they read
the state, so they would anyway; the wait counts as step time), as does an index stretch the
task says will read the state (Task.before_step_waits: REALM's in-process refresh, a lockstep
swap, an embedder export); another index stretch (a check before every step, which must not
stall the dispatch) is left out only when the steps before it had finished when it began.
Otherwise a step's run that an evaluation waited for would be taken for the evaluation's, and
ex/s and MFU would count the step as faster than it was. steps/s, ex/s, tokens/s, TFLOP/s and
MFU all come from the one step time, over the same window."""

from __future__ import annotations

import contextlib
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
# goodput buckets whose stretches the step time leaves out, when no step ran during them
EXCLUDED = ("checkpoint", "eval", "index")
# those that first wait for the steps in flight (they read the state: no extra sync)
SETTLED = ("checkpoint", "eval")


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
        self.step_fns: set[int] = set()  # the step functions compiled (a task may have two)
        self.compile_seconds = 0.0
        self.peak = None
        self.pending = None  # the last step call's metrics, until they are known to be ready
        self.calls = 0  # step calls after the compiling one: the steps the speed counts
        self.excluded = 0.0  # seconds of stretches left out of the step time
        self._leaving_out = False  # inside a stretch being left out (nested ones are in it)
        self.last = (self.goodput.clock(), 0, 0.0)  # (time, calls, excluded) at the last log
        self.speed: dict[str, float] = {}

    def settle(self) -> None:
        """Wait for the steps called so far to finish (the wait is step time)."""
        if self.pending is None:
            return
        with self.goodput.timed("step"):
            jax.block_until_ready(self.pending)
        self.pending = None

    def idle(self) -> bool:
        """Whether the steps called so far have finished, without waiting for them."""
        if self.pending is not None:
            leaves = jax.tree.leaves(self.pending)
            if not all(x.is_ready() for x in leaves if hasattr(x, "is_ready")):
                return False
            self.pending = None
        return True

    @contextlib.contextmanager
    def timed(self, bucket: str, settle: bool | None = None):
        """Charge the time inside to goodput's `bucket`. A stretch of EXCLUDED (not inside
        another one) is left out of the step time when no step ran during it: one that
        settles (SETTLED's buckets by default; an index stretch when the task says it will
        read the state) first waits for the steps in flight; another is left out only when
        they had finished (an index check that overlapped them stays in the step time)."""
        if bucket not in EXCLUDED or self._leaving_out:
            with self.goodput.timed(bucket):
                yield
            return
        if bucket in SETTLED if settle is None else settle:
            self.settle()
        leave_out = self.idle()
        self._leaving_out = leave_out
        start = self.goodput.clock()
        try:
            with self.goodput.timed(bucket):
                yield
        finally:
            if leave_out:
                self._leaving_out = False
                self.excluded += self.goodput.clock() - start

    def call_step(self, step_fn, state, batch, local: dict):
        """step_fn(state, batch), timed: the first call as compile (and the executables it
        built give the step's FLOPs), waiting for its step to finish, the speed's window
        starting after it; the others as steps, their outputs kept as in flight. A task's
        other step function (Task.step_for) compiles at its own first call, timed the same
        way, its FLOPs the step's from then on."""
        self.goodput.steps += 1
        if self.compiled and (not self.step_fns or id(step_fn) in self.step_fns):
            with self.timed("step"):
                out = step_fn(state, batch)
            self.calls += 1
            # the metrics, which the same run writes: never the state, which the next call
            # donates (a deleted array's is_ready() crashes the process)
            self.pending = out[1]
            return out
        before = {id(e) for e in _live()}
        with self.timed("compile"):
            out = step_fn(state, batch)
            jax.block_until_ready(out)  # its run, not only its dispatch
        self.compiled = True
        self.step_fns.add(id(step_fn))
        self.compile_seconds = self.goodput.seconds["compile"]
        self.flops = executables_flops(e for e in _live() if id(e) not in before)
        self.peak = peak_flops()
        if self.flops is None or self.peak is None:
            log.warning("MFU not reported: no %s", "step FLOPs" if not self.flops else "peak")
        n = sum(v.size for k, v in local.items() if k in TOKEN_KEYS)
        self.tokens = n * jax.process_count()
        self.last = (self.goodput.clock(), self.calls, self.excluded)  # the window starts here
        return out

    def _update_speed(self) -> None:
        """Step time since the last log (or the end of the compiling call): wall time less
        the stretches left out (saves, evaluations, index swaps during which no step ran; data
        waits stay in), over the step calls in it, all finished (values settles first)."""
        now = self.goodput.clock()
        t, calls, excluded = self.last
        self.last = (now, self.calls, self.excluded)
        if self.calls <= calls:
            return
        step_time = max(1e-9, (now - t - (self.excluded - excluded)) / (self.calls - calls))
        speed = {
            "step_time": step_time,
            "steps_per_sec": 1.0 / step_time,
            "examples_per_sec": self.batch_size / step_time,
            "tokens_per_sec": self.tokens / step_time,
        }
        if self.flops:
            speed["tflops_per_device"] = self.flops / step_time / 1e12
        if (m := mfu(self.flops, step_time, self.peak)) is not None:
            speed["mfu"] = m
        self.speed = speed

    def values(self, step: int | None = None) -> dict[str, float]:
        """The instruments at a log point (flat floats, for the log line and TensorBoard):
        speed, compile_seconds, memory (GiB), goodput and goodput/<part> (seconds). Waits for
        the steps in flight first (at a log step the metrics' fetch already has: no cost), so
        the speed is over finished steps. `step` (the step logged) is not needed: the window
        counts the step calls."""
        del step
        self.settle()
        self._update_speed()
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
