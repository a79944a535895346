"""Metrics: TensorBoard event files (tensorboardX) and console progress with steps/s and ETA."""

from __future__ import annotations

import collections
import logging
import struct
import time

import jax

from realm_jax import fs

log = logging.getLogger("realm_jax")


def view_command(logdir: str) -> str:
    """How to watch the curves written to `logdir` (a workdir's tb/), in words."""
    workdir = fs.dirname(logdir.rstrip("/"))
    if fs.is_remote(logdir):  # TensorBoard reads gs:// with tensorflow's file system
        return f"TensorBoard event files in {logdir}: view with `tensorboard --logdir {logdir}`"
    return (
        f"TensorBoard event files in {logdir}: view with `make tensorboard TB={workdir}` "
        f"(or `tensorboard --logdir {logdir}`), then open http://localhost:6006"
    )


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
            log.info("curves: %s", view_command(logdir))

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


def _events(data: bytes):
    """(tag, step, value) of every scalar in an event file's bytes. TFRecord framing: u64
    length, u32 crc, payload, u32 crc."""
    from tensorboardX.proto import event_pb2

    pos = 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
        pos += 12 + n + 4
        for v in event.summary.value:
            yield v.tag, int(event.step), float(v.simple_value)


def _event_files(workdir: str) -> tuple[str, list[str]]:
    tb = fs.join(fs.abspath(workdir), "tb")
    files = sorted(n for n in fs.listdir(tb) if n.startswith("events.out.tfevents."))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files in {tb}")
    return tb, files


def read_scalars(workdir: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from every event file under <workdir>/tb, local or gs:// (the
    newest file's value of a (tag, step) wins: a resumed run rewrites the steps after its
    checkpoint)."""
    tb, files = _event_files(workdir)
    out: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for name in files:  # names start with the writer's start time: oldest first
        for tag, step, value in _events(fs.read_bytes(fs.join(tb, name))):
            out[tag][step] = value
    return dict(out)


def last_logged_step(workdir: str) -> int:
    """The last step the newest event file under <workdir>/tb logged "loss" at (0: none);
    FileNotFoundError without event files. goodput.redone_steps reads it on a resume."""
    tb, files = _event_files(workdir)
    steps = [s for t, s, _ in _events(fs.read_bytes(fs.join(tb, files[-1]))) if t == "loss"]
    return max(steps, default=0)


def format_seconds(s: float) -> str:
    s = int(max(0, s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


class Progress:
    """The ETA of a long loop: the steps left at the wall-clock rate since the first log line
    (after compilation), evaluations, saves and index swaps included, as they will recur. The
    speed (steps/s, ex/s: instruments.Meter) is the steps' own, without them."""

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
        return {"eta_seconds": eta}


INT_KEYS = ("staleness", "index_step")


def line(step: int, total: int, values: dict[str, float], prog: dict[str, float]) -> str:
    """`step s/total | key value | ... | steps/s | ex/s | MFU | goodput | ETA` for the values
    given, in order; the speed parts where `prog` has them (instruments.Meter's, Progress's)."""
    parts = [f"step {step}/{total}"] + [
        f"{k.removeprefix('eval/')} {int(v)}"
        if k in INT_KEYS
        else f"{k.removeprefix('eval/')} {v:.4f}"
        for k, v in values.items()
    ]
    if "steps_per_sec" in prog:
        parts.append(f"{prog['steps_per_sec']:.2f} steps/s")
    if "examples_per_sec" in prog:
        parts.append(f"{prog['examples_per_sec']:.1f} ex/s")
    if prog.get("mfu") is not None:
        parts.append(f"MFU {100 * prog['mfu']:.2f}%")
    if "goodput" in prog:
        parts.append(f"goodput {100 * prog['goodput']:.1f}%")
    if "eta_seconds" in prog:
        parts.append(f"ETA {format_seconds(prog['eta_seconds'])}")
    return " | ".join(parts)
