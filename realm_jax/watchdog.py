"""A progress watchdog: a process that is alive but stuck (a collective whose peer hangs, a data
loader, a storage call that is never answered) exits instead of holding a pod's chips for ever.

JAX's coordination service ends a job whose process dies or stops (SIGSTOP stops its heartbeat
thread too). A process whose main thread blocks while its heartbeat thread goes on is never
noticed by it: this watchdog is. The loop calls `beat()` after every completed step (the refresh
job after every published index, a long evaluation after every batch); a daemon thread checks
that the last beat is recent. When it is not, the process writes one line saying which stage
stalled and for how long, then every thread's Python stack (faulthandler), to stderr, and exits
with EXIT_STALLED, so the launcher's restart resumes from the last good checkpoint.

Bounds (config fields of the train section; the refresh job's in refresh.*):
  stall_timeout_s      0 = automatic: max(stall_floor_s, STEP_FACTOR x the mean time between the
                       last WINDOW beats, 3 x the longest time between two beats so far: steps
                       are dispatched ahead and the host waits for the device only at a log or
                       save step, so one interval in log_every holds many steps); else this
                       many seconds
  stall_floor_s        the automatic bound's floor
  first_step_timeout_s the bound before the first beat (compilation, restore, the first step)
                       and of the stages that compile or may be slow on their own (an evaluation,
                       a checkpoint save): not a stall
`stage(name)` names what the main thread is doing (the data, the step, a checkpoint save, an
evaluation): the stall line says which, so a hung data loader is named as such.

A test-only fault hook, REALM_JAX_TEST_HANG="<stage>:<step>" (e.g. "step:3": when the training
loop starts the step after step 3; "data:3" in its data loader), blocks the main thread for ever
when it enters that stage at that step while every other thread runs on: the hang drills
(docs/reliability.md) use it; nothing else reads it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time

log = logging.getLogger(__name__)

EXIT_STALLED = 75  # EX_TEMPFAIL: the launcher restarts; a resume continues from a checkpoint
STEP_FACTOR = 20.0  # automatic bound: this many median steps without one completing
WINDOW = 50  # the step times the median is taken over
TEST_HANG = "REALM_JAX_TEST_HANG"


class Watchdog:
    """Watches one loop (`what`: "training step", "refresh", ...). Use as a context manager, or
    call close()."""

    def __init__(
        self,
        what: str,
        timeout_s: float = 0.0,
        floor_s: float = 300.0,
        first_timeout_s: float = 3600.0,
        *,
        out=None,
        exit_fn=os._exit,
    ):
        if timeout_s < 0 or floor_s <= 0 or first_timeout_s <= 0:
            raise ValueError(
                f"watchdog bounds must be positive (timeout_s {timeout_s} >= 0, floor_s "
                f"{floor_s}, first_timeout_s {first_timeout_s})"
            )
        self.what, self.fixed, self.floor, self.first = what, timeout_s, floor_s, first_timeout_s
        self.out, self._exit = out or sys.stderr, exit_fn
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._times: list[float] = []
        self._longest = 0.0
        self._beats = 0
        self._stage, self._stage_bound, self._step = "start", None, None
        self._closed = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name=f"watchdog:{what}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- the loop side
    def beat(self, step: int | None = None) -> None:
        """One unit of progress completed (a step, a refresh, an evaluation batch)."""
        now = time.monotonic()
        with self._lock:
            if self._beats:
                self._times = (self._times + [now - self._last])[-WINDOW:]
                self._longest = max(self._longest, now - self._last)
            self._beats += 1
            self._last, self._step = now, step

    @contextlib.contextmanager
    def stage(self, name: str, slow: bool = False, step: int | None = None):
        """The main thread is in stage `name`; slow=True: bounded by first_timeout_s (it may
        compile or wait on storage) rather than by the step bound. Time spent in a slow stage
        does not count as a stalled step: the clock restarts when it ends."""
        with self._lock:
            before = (self._stage, self._stage_bound)
            self._stage, self._stage_bound = name, (self.first if slow else None)
            if slow:
                self._last = time.monotonic()
        hang = os.environ.get(TEST_HANG, "")
        if hang and hang == f"{name}:{step}":  # the test-only fault hook (module docstring)
            log.warning("%s=%s: blocking the main thread (test-only fault hook)", TEST_HANG, hang)
            threading.Event().wait()
        try:
            yield
        finally:
            with self._lock:
                self._stage, self._stage_bound = before
                if slow:
                    self._last = time.monotonic()

    def bound(self) -> float:
        """The current bound in seconds (module docstring)."""
        with self._lock:
            return self._bound()

    def _bound(self) -> float:
        if self._stage_bound is not None:
            return self._stage_bound
        if not self._beats:
            return self.first
        if self.fixed > 0:
            return self.fixed
        if not self._times:  # one beat: no step time measured yet
            return self.first
        mean = statistics.fmean(self._times)
        return max(self.floor, STEP_FACTOR * mean, 3.0 * self._longest)

    def close(self) -> None:
        self._closed.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------------- the watching thread
    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, max(0.05, self._poll()))):
            with self._lock:
                idle, limit = time.monotonic() - self._last, self._bound()
                stage, step, beats = self._stage, self._step, self._beats
            if idle > limit:
                self._fire(idle, limit, stage, step, beats)
                return

    def _poll(self) -> float:
        return self.bound() / 10

    def _fire(self, idle: float, limit: float, stage: str, step, beats: int) -> None:
        self.fired = True
        after = f"after step {step}" if step is not None else f"after {beats} completed"
        line = (
            f"realm-jax: stalled: no {self.what} completed for {idle:.3g} s (bound {limit:.3g} s; "
            f"{after}); the main thread is in stage '{stage}'; every thread's stack follows; "
            f"exiting {EXIT_STALLED} so that a restart resumes from the last checkpoint"
        )
        try:
            print(line, file=self.out, flush=True)
            log.error(line)
            faulthandler.dump_traceback(file=self.out, all_threads=True)
            self.out.flush()
        finally:
            self._exit(EXIT_STALLED)


def from_config(section, what: str) -> Watchdog:
    """A Watchdog with the bounds of a config section (train or refresh)."""
    return Watchdog(
        what,
        float(section.get("stall_timeout_s", 0.0)),
        float(section.get("stall_floor_s", 300.0)),
        float(section.get("first_step_timeout_s", 3600.0)),
    )
