"""Metrics: TensorBoard event files (tensorboardX) and console progress with steps/s and ETA."""

from __future__ import annotations

import logging
import time

import jax

from realm_jax import fs

log = logging.getLogger("realm_jax")


class MetricWriter:
    """Writes scalars to <workdir>/tb (process 0 only).

    On gs:// tensorboardX (through google-cloud-storage) re-uploads the whole event file at
    every flush, so there the file is flushed every REMOTE_FLUSH_SECONDS and at close, not
    after every write."""

    REMOTE_FLUSH_SECONDS = 60

    def __init__(self, logdir: str):
        self.writer = None
        self.flush_each = not fs.is_remote(logdir)
        if jax.process_index() == 0:
            from tensorboardX import SummaryWriter

            fs.makedirs(logdir)
            flush_secs = 120 if self.flush_each else self.REMOTE_FLUSH_SECONDS
            self.writer = SummaryWriter(logdir, flush_secs=flush_secs)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for k, v in values.items():  # TensorBoard tags may not hold '@'
            self.writer.add_scalar(k.replace("@", "_at_"), float(v), step)
        if self.flush_each:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None  # a gs:// record writer uploads once more when collected


def format_seconds(s: float) -> str:
    s = int(max(0, s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


class Progress:
    """steps/s (excluding the first, compiling step) and ETA for long loops."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.start = total, start
        self.t0 = None
        self.s0 = start

    def update(self, step: int) -> dict[str, float]:
        now = time.time()
        if self.t0 is None:  # first call after compilation
            self.t0, self.s0 = now, step
            return {}
        rate = (step - self.s0) / max(now - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        return {"steps_per_sec": rate, "eta_seconds": eta}


INT_KEYS = ("staleness", "index_step")


def line(step: int, total: int, values: dict[str, float], prog: dict[str, float]) -> str:
    """`step s/total | key value | ... | steps/s | ETA` for the values given, in order."""
    parts = [f"step {step}/{total}"] + [
        f"{k.removeprefix('eval/')} {int(v)}"
        if k in INT_KEYS
        else f"{k.removeprefix('eval/')} {v:.4f}"
        for k, v in values.items()
    ]
    if prog:
        parts += [
            f"{prog['steps_per_sec']:.2f} steps/s",
            f"ETA {format_seconds(prog['eta_seconds'])}",
        ]
    return " | ".join(parts)
