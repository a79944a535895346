"""Goodput: a run's wall time split by what the host was doing, and the share of it spent on
training steps that moved the run forward.

The loop times each stretch in one bucket (`Goodput.timed`; a stretch inside another, e.g. the
index swap an evaluation waits for, counts in its own bucket only). What no bucket timed
(console and TensorBoard writes, the stop check) is "other", so the parts sum to the wall time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from realm_jax import fs
from realm_jax import workdir as paths

log = logging.getLogger("realm_jax.train")

# compile: the first step call (trace, lower, compile) and its run; step: the later step
# calls and the waits for their results (saves and evaluations wait for them first:
# instruments.Meter); data: blocked on the input iterator; checkpoint: saves; eval: held-out
# evaluations; index: the task's host work before a step (REALM's index swap or wait)
TIMED = ("compile", "step", "data", "checkpoint", "eval", "index")
# redone: step time of the steps a restart trains again; other: what no bucket timed
PARTS = TIMED + ("redone", "other")


class Goodput:
    """Seconds per bucket since the run started; `split()` adds redone, other and wall."""

    def __init__(self, clock=time.perf_counter, redone_steps: int = 0):
        self.clock = clock
        self.t0 = clock()
        self.seconds = dict.fromkeys(TIMED, 0.0)
        self.steps = 0  # steps whose time is in "step"
        self.redone_steps = redone_steps
        self._nested: list[float] = []  # time spent in inner stretches, per open stretch

    @contextlib.contextmanager
    def timed(self, bucket: str):
        """Charge the time inside to `bucket`, less what inner `timed` stretches took."""
        start = self.clock()
        self._nested.append(0.0)
        try:
            yield
        finally:
            spent = self.clock() - start
            inner = self._nested.pop()
            self.seconds[bucket] += spent - inner
            if self._nested:
                self._nested[-1] += spent

    def split(self) -> dict[str, float]:
        """{part: seconds} for PARTS, and "wall". The redone steps are the first ones of this
        run: their share of the step time (the mean step's) moves to "redone"."""
        wall = self.clock() - self.t0
        out = dict(self.seconds)
        per_step = out["step"] / self.steps if self.steps else 0.0
        out["redone"] = min(out["step"], per_step * min(self.redone_steps, self.steps))
        out["step"] -= out["redone"]
        out["other"] = max(0.0, wall - sum(out.values()))
        out["wall"] = wall
        return out


def ratio(split: dict[str, float]) -> float:
    """Goodput: productive step time / wall time."""
    return split["step"] / split["wall"] if split["wall"] > 0 else 0.0


def redone_steps(workdir: str, start: int) -> int:
    """Steps a resumed run trains again: from its checkpoint `start` to the last step the runs
    before it logged (the newest TensorBoard event file's last step, or metrics.json's
    train_step). 0 for a fresh run, or when neither says more than `start` (a run killed
    before its first flush of the events leaves nothing to read). Call it before this run's
    writer makes its own event file."""
    if start == 0:
        return 0
    last = 0
    try:
        from realm_jax.train.metrics import last_logged_step

        last = last_logged_step(workdir)
    except FileNotFoundError:
        pass
    except Exception as e:  # a damaged event file: the count is a statistic, not the run
        log.warning("could not read the last logged step: %s", e)
    path = paths.metrics_path(workdir)
    if fs.exists(path):
        try:
            last = max(last, int(json.loads(fs.read_text(path)).get("train_step", 0)))
        except (ValueError, TypeError):
            pass
    return max(0, last - start)
