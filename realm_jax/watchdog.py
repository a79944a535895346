"""A progress watchdog: a process that is alive but stuck (a collective whose peer hangs, a data
loader, a storage call that is never answered) exits instead of holding a pod's chips for ever.

JAX's coordination service ends a job whose process dies or stops (SIGSTOP stops its heartbeat
thread too). A process whose main thread blocks while its heartbeat thread goes on is never
noticed by it: this watchdog is. The loop calls `beat()` after every completed step (the refresh
job after every published index, a long evaluation after every batch); a daemon thread checks
that the last beat is recent. When it is not, the process writes one line saying which stage
stalled and for how long, then every thread's Python stack (faulthandler), to stderr, and exits
with EXIT_STALLED, so the launcher's restart resumes from the last good checkpoint.

Bounds (config fields of the train section, which the refresh job and `evaluate` read too):
  stall_timeout_s      0 = automatic: max(stall_floor_s, STEP_FACTOR x the mean time between the
                       last WINDOW beats, 3 x the longest time between two beats so far: steps
                       are dispatched ahead and the host waits for the device only at a log or
                       save step, so one interval in log_every holds many steps); else this
                       many seconds
  stall_floor_s        the automatic bound's floor
  first_step_timeout_s the bound before the first beat (compilation, the first step)
                       and of the stages that compile or may be slow on their own (an evaluation,
                       a checkpoint save): not a stall
Each bound must be a finite number of seconds, at least MIN_BOUND_S (stall_timeout_s may be 0):
from_config refuses inf, NaN, negative and sub-second values with one ConfigError naming each
field (an infinite or NaN bound would never fire; a sub-second one fires on a healthy step).
`stage(name)` names what the main thread is doing (the data, the step, a checkpoint save, an
evaluation): the stall line says which, so a hung data loader is named as such; outside every
stage it names the last stage that ended, and before the first it says so.

The stall report can never keep the process alive: the exit is armed before anything is written
(the report runs in its own thread, given EXIT_GRACE_S), the line and the stacks go to stderr's
descriptor without blocking (what a full pipe cannot take is dropped), and only the log line
may block, inside that grace.

A test-only fault hook, REALM_JAX_TEST_HANG="<stage>:<step>" (e.g. "step:3": when the training
loop starts the step after step 3; "data:3" in its data loader), blocks the main thread for ever
when it enters that stage at that step while every other thread runs on: the hang drills
(docs/reliability.md) use it; nothing else reads it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import stat
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

EXIT_STALLED = 75  # EX_TEMPFAIL: the launcher restarts; a resume continues from a checkpoint
STEP_FACTOR = 20.0  # automatic bound: this many median steps without one completing
WINDOW = 50  # the step times the median is taken over
TEST_HANG = "REALM_JAX_TEST_HANG"
EXIT_GRACE_S = 3.0  # the most the stall report may take before the exit (a blocked log handler)
MIN_BOUND_S = 1.0  # the shortest bound a config may set: a healthy step's host work can take it


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
        _check_bounds(timeout_s, floor_s, first_timeout_s)
        self.what, self.fixed, self.floor, self.first = what, timeout_s, floor_s, first_timeout_s
        self.out, self._exit = out or sys.stderr, exit_fn
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._times: list[float] = []
        self._longest = 0.0
        self._beats = 0
        self._stage: str | None = None  # the innermost open stage; None: outside every stage
        self._stage_bound: float | None = None
        self._step = None
        self._ended: tuple[str, float] | None = None  # the last stage that ended, and when
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
    def stage(self, name: str, slow: bool = False, step: int | None = None) -> Iterator[None]:
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
                self._ended = (name, time.monotonic())
                if slow:
                    self._last = time.monotonic()

    def phase(self, name: str) -> None:
        """Enter a slow stage that lasts until close: a command's work after its loop (a final
        evaluation, an export), bounded by first_timeout_s rather than by the steps' bound."""
        with self._lock:
            self._stage, self._stage_bound = name, self.first
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
                now = time.monotonic()
                idle, limit = now - self._last, self._bound()
                where, step, beats = self._where(now), self._step, self._beats
            if idle > limit:
                self._fire(idle, limit, where, step, beats)
                return

    def _poll(self) -> float:
        return self.bound() / 10

    def _where(self, now: float) -> str:
        """Where the main thread is, for the stall line (under the lock)."""
        if self._stage is not None:
            return f"the main thread is in stage '{self._stage}'"
        if self._ended is None:
            return "the main thread has entered no stage yet"
        name, at = self._ended
        ago = f"{now - at:.3g} s ago"
        return f"the main thread is outside every stage (the last, '{name}', ended {ago})"

    def _fire(self, idle: float, limit: float, where: str, step, beats: int) -> None:
        """Report the stall and exit EXIT_STALLED. The exit is armed first: the report runs in
        its own thread, and after EXIT_GRACE_S the process exits whether it is done or not."""
        self.fired = True
        after = f"after step {step}" if step is not None else f"after {beats} completed"
        line = (
            f"realm-jax: stalled: no {self.what} completed for {idle:.3g} s (bound {limit:.3g} s; "
            f"{after}); {where}; every thread's stack follows; "
            f"exiting {EXIT_STALLED} so that a restart resumes from the last checkpoint"
        )
        report = threading.Thread(
            target=_report, args=(line, self.out), name="watchdog:report", daemon=True
        )
        try:
            report.start()
            report.join(EXIT_GRACE_S)
        finally:
            self._exit(EXIT_STALLED)


def _report(line: str, out) -> None:
    """The stall line and every thread's stack to `out`'s descriptor, never blocking (a full
    pipe drops what it cannot take); then the line to the log, which may block (a handler on
    that same pipe): the caller exits after EXIT_GRACE_S regardless."""
    fd, release = _nonblocking_fd(out)
    try:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, (line + "\n").encode())
            faulthandler.dump_traceback(file=fd, all_threads=True)  # drops on EAGAIN
        else:  # no descriptor (a StringIO): a Python write, bounded by the grace
            out.write(line + "\n")
            out.flush()
    finally:
        release()
    log.error(line)


def _nonblocking_fd(out) -> tuple[int | None, Callable[[], None]]:
    """(a descriptor writing where `out` does on which a write never blocks, its release), or
    (None, no-op) when `out` has no descriptor. A pipe is reopened through /proc with O_NONBLOCK:
    a descriptor of its own, so the flag does not change the file description this process
    shares with its parent; a regular file never blocks; anything else (a socket, a tty) is set
    non-blocking for the report and restored."""
    try:
        fd = out.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return None, lambda: None
    if stat.S_ISREG(mode):
        return fd, lambda: None
    if stat.S_ISFIFO(mode):
        try:
            own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
            return own, lambda: os.close(own)
        except OSError:
            pass  # no /proc, or no reader left: the flag on the shared description
    try:
        was = os.get_blocking(fd)
        os.set_blocking(fd, False)
    except OSError:
        return None, lambda: None
    return fd, lambda: os.set_blocking(fd, was)


def _check_bounds(timeout_s: float, floor_s: float, first_timeout_s: float) -> None:
    """The constructor's check: finite, timeout_s >= 0 (0 automatic), the others > 0. NaN
    compares false with everything, so `timeout_s < 0` alone would let it (a bound that never
    fires) through; sub-second bounds are for tests (from_config refuses them)."""
    values = {"timeout_s": timeout_s, "floor_s": floor_s, "first_timeout_s": first_timeout_s}
    bad = [
        f"{name}={value!r}"
        for name, value in values.items()
        if not math.isfinite(value) or value < 0 or (value == 0 and name != "timeout_s")
    ]
    if bad:
        raise ValueError(
            f"watchdog bounds must be finite and positive seconds (timeout_s may be 0, "
            f"automatic): {', '.join(bad)}"
        )


# (field, default, whether 0 means automatic)
CONFIG_FIELDS = (
    ("stall_timeout_s", 0.0, True),
    ("stall_floor_s", 300.0, False),
    ("first_step_timeout_s", 3600.0, False),
)


def config_bounds(section, prefix: str = "train") -> tuple[float, float, float]:
    """(stall_timeout_s, stall_floor_s, first_step_timeout_s) of a config section, checked:
    one ConfigError naming every field that is not a finite number of seconds >= MIN_BOUND_S
    (stall_timeout_s may be 0, automatic)."""
    from realm_jax.config import ConfigError  # ml_collections only: cheap

    values, problems = [], []
    for field, default, zero_ok in CONFIG_FIELDS:
        raw = section.get(field, default)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = math.nan
        allowed = f"a finite number of seconds >= {MIN_BOUND_S:g}"
        if zero_ok:
            allowed = f"0 (automatic) or {allowed}"
        if not (math.isfinite(value) and (value >= MIN_BOUND_S or (zero_ok and value == 0))):
            problems.append(f"{prefix}.{field}={raw!r}: must be {allowed}")
        values.append(value)
    if problems:
        raise ConfigError("the progress watchdog's bounds: " + "; ".join(problems))
    return values[0], values[1], values[2]


def from_config(section, what: str, prefix: str = "train") -> Watchdog:
    """A Watchdog with the bounds of a config section (`prefix`: its name in the config, for
    the error; every caller passes config.train)."""
    return Watchdog(what, *config_bounds(section, prefix))


# The process's watchdog (issue 58: cover the whole process, not only the loop). The CLI makes
# one for a training command before anything else runs, so the checkpoint manager's
# constructor, the restore and data set-up are bounded by first_step_timeout_s too (a storage
# that never answers at start-up exits); the loop uses it for its steps and the final save, and
# the CLI closes it once the command has returned. A caller of loop.run without the CLI (tests,
# scripts) gets a watchdog of the loop's own, as before.
_process: Watchdog | None = None


def for_process(section, what: str, prefix: str = "train") -> Watchdog:
    """Start the process's watchdog (from_config's bounds); the one running if there is one."""
    global _process
    if _process is None:
        _process = from_config(section, what, prefix)
    return _process


def current() -> Watchdog | None:
    """The process's watchdog, None when no command started one."""
    return _process


def release() -> None:
    """Close the process's watchdog (the command is over)."""
    global _process
    if _process is not None:
        _process.close()
        _process = None
