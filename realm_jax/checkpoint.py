"""Orbax checkpoints: async saves of the train state (+ the data iterator), resume, partial
restore of one params subtree (the refresh job's document embedder).

Every save records the run's fingerprint (what the checkpoint's contents depend on: the model
architecture, the prepared data, the batch size and data seed; train/loop.py builds it) in
orbax's step metadata. A resume compares it first: a checkpoint of another config or other data
is a CheckpointMismatch, never taken for damage. A checkpoint that fails to restore while an
older one restores is damaged: it is moved to <workdir>/checkpoints-damaged/<step>-<UTC time>/
(never deleted), so it leaves the rotation, the run saves that step again, and retention keeps
the checkpoint it resumed from until a newer one is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from realm_jax import fs
from realm_jax import workdir as paths

log = logging.getLogger(__name__)

FINGERPRINT_KEY = "fingerprint"  # in orbax's custom_metadata of every step


def _not_read_only_notice(record: logging.LogRecord) -> bool:
    """orbax warns "Given directory is read only=<dir>" (through absl) for every read-only
    CheckpointManager, which is how `ask`, `evaluate`, realm_jax.load and the refresh job read
    checkpoints on purpose: that notice dropped, every other absl/orbax warning kept."""
    return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_not_read_only_notice)


class CheckpointMismatch(ValueError):
    """The checkpoint was written for another config or other data (not damage)."""


class NoRestorableCheckpoint(RuntimeError):
    """Checkpoints exist but none restores onto this run's state."""


class Manager(ocp.CheckpointManager):
    """orbax's CheckpointManager; `fingerprint` (set by the trainer's resume) is recorded in
    every step it saves."""

    fingerprint: dict | None = None


def manager(workdir: str, *, keep: int = 3, with_data: bool = True, read_only: bool = False):
    """A CheckpointManager over <workdir>/checkpoints with items 'state' (+ 'data_iter')."""
    items = ("state", "data_iter") if with_data else ("state",)
    options = ocp.CheckpointManagerOptions(
        # read-only: what orbax would set, with a warning each, when given anything else
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        enable_async_checkpointing=not read_only,
        read_only=read_only,
    )
    return Manager(paths.checkpoint_dir(workdir), item_names=items, options=options)


def save(mgr, step: int, state, data_save_args=None, *, force: bool = False) -> bool:
    """Start an async save of `state` (and the data iterator) at `step`, with the manager's
    fingerprint in the step's metadata."""
    args = {"state": ocp.args.PyTreeSave(state)}
    if data_save_args is not None:
        args["data_iter"] = data_save_args
    fingerprint = getattr(mgr, "fingerprint", None)
    saved = mgr.save(
        step,
        args=ocp.args.Composite(**args),
        force=force,
        custom_metadata={FINGERPRINT_KEY: fingerprint} if fingerprint else None,
    )
    if saved:
        log.info("checkpoint %d: save started", step)
    return saved


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (restore onto any mesh)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def restore(mgr, step: int, abstract_state, data_restore_args=None):
    """Restore the full state (onto the shardings in abstract_state) and the data iterator."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
    args = {"state": ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)}
    if data_restore_args is not None:
        args["data_iter"] = data_restore_args
    out = mgr.restore(step, args=ocp.args.Composite(**args))
    return out["state"]


# ------------------------------------------------------------------------------ fingerprints


def read_fingerprint(mgr, step: int) -> dict | None:
    """The fingerprint saved with checkpoint `step`; None when it has none (written before
    fingerprints were recorded, or its metadata file is unreadable)."""
    with _quiet_logs():  # orbax logs an unreadable metadata file at ERROR and returns {}
        try:
            custom = mgr.metadata(step).custom_metadata or {}
        except Exception:  # a metadata file that is not there or not JSON
            return None
    return custom.get(FINGERPRINT_KEY) or None


def _show(value) -> str:
    if isinstance(value, str) and len(value) > 40:  # a sha256: its first 12 digits
        value = value[:12] + "..."
    return json.dumps(value)


def fingerprint_changes(saved: dict, now: dict) -> list[str]:
    """'field: checkpoint X, now Y' for every field both fingerprints hold and that differs
    (a field only one of them has, e.g. added by a newer realm-jax, is not compared)."""
    return [
        f"{k}: checkpoint {_show(saved[k])}, now {_show(now[k])}"
        for k in sorted(saved.keys() & now.keys())
        if saved[k] != now[k]
    ]


def check_fingerprint(mgr, step: int, fingerprint: dict, *, warn: bool = True) -> None:
    """Raise CheckpointMismatch when checkpoint `step` was written for another config or other
    data than `fingerprint` describes; one warning (when `warn`) when it carries none."""
    saved = read_fingerprint(mgr, step)
    if saved is None:
        if warn:
            log.warning(
                "checkpoint %d carries no fingerprint (written by an older realm-jax, or its "
                "metadata is unreadable): its config and data are not checked against this run's",
                step,
            )
        return
    changes = fingerprint_changes(saved, fingerprint)
    if changes:
        raise CheckpointMismatch(
            f"checkpoint {step} in {mgr.directory} was written with another config or other "
            f"data than this run's: {'; '.join(changes)}. Revert the change to resume this "
            "run, or pass a new --workdir to start a new one (nothing was moved or deleted)"
        )


# ---------------------------------------------------------------- restore attempts, quietly

# Loggers that report a failed read at length (orbax, through absl; tensorstore; asyncio).
_QUIET_LOGGERS = ("absl", "orbax", "tensorstore", "asyncio")
_debris = {"installed": False, "dropped": 0}


def _in_orbax(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


# absl status codes: how tensorstore's errors begin ("OUT_OF_RANGE: Error reading ...").
_TENSORSTORE_ERROR = re.compile(
    r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
    r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
    r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): "
)


def _from_tensorstore(exc: BaseException | None) -> bool:
    """An error tensorstore set on a future (never raised in Python: no traceback)."""
    return (
        exc is not None
        and exc.__traceback__ is None
        and _TENSORSTORE_ERROR.match(str(exc)) is not None
    )


def _raised_in_orbax(exc: BaseException | None) -> bool:
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if _in_orbax(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


def _is_unraisable_debris(unraisable) -> bool:
    """Two kinds of report a failed orbax restore leaves behind through sys.unraisablehook,
    when a tensorstore thread or the garbage collector gets to them: tensorstore reads that
    finish after orbax closed its event loop ("Event loop is closed", from
    loop.call_soon_threadsafe in tensorstore's threads), and orbax's unfinished read coroutines
    when collected (their `except BaseException` turns coroutine.close()'s GeneratorExit into
    an Exception)."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    code = getattr(unraisable.object, "cr_code", None)
    return (
        code is not None
        and _in_orbax(code.co_filename)
        and isinstance(exc.__cause__, GeneratorExit)
    )


class _AsyncioDebris(logging.Filter):
    """asyncio's reports of orbax's read tasks and tensorstore's futures, logged when they are
    collected: "Task/Future exception was never retrieved" (an exception raised in orbax, or
    set by tensorstore) and "Task was destroyed but it is pending!" (an orbax coroutine)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        exc = record.exc_info[1] if record.exc_info else None
        debris = (
            "exception was never retrieved" in message
            and (_raised_in_orbax(exc) or _from_tensorstore(exc))
        ) or ("Task was destroyed but it is pending" in message and _in_orbax(message))
        if debris:
            _debris["dropped"] += 1
        return not debris


def _install_debris_filters() -> None:
    """Drop what a failed restore leaves behind: thousands of lines of tracebacks, each with a
    TensorStore spec, reported long after the restore returned (so the filters stay for the
    rest of the process). They match only orbax's and tensorstore's leftovers; every other
    report goes where it went."""
    if _debris["installed"]:
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if _is_unraisable_debris(unraisable):
            _debris["dropped"] += 1
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_AsyncioDebris())
    _debris["installed"] = True


@contextlib.contextmanager
def _quiet_logs():
    loggers = [logging.getLogger(n) for n in _QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _reason(error: BaseException) -> str:
    """Why a restore failed, in one line: the innermost cause (tensorstore's error names the
    file and the fault; orbax's wrapper repeats a multi-line TensorStore spec)."""
    for _ in range(20):
        if error.__cause__ is None:
            break
        error = error.__cause__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a restore that fails on one host fails on all, so
    every process goes on with the same checkpoint)."""
    if jax.process_count() == 1:
        return ok
    return bool(multihost_utils.process_allgather(np.array(ok)).all())


def _mismatch(error: BaseException) -> CheckpointMismatch | None:
    """The CheckpointMismatch that `error` is or was raised from (`raise ... from`: orbax may
    wrap what a handler raised), else None."""
    for _ in range(20):
        if error is None or isinstance(error, CheckpointMismatch):
            return error
        error = error.__cause__
    return None


def try_restore(fn: Callable[..., Any], *args) -> tuple[Any, str | None]:
    """(fn(*args), None), or (None, a one-line reason) when it raised here or on another
    process; run with orbax's, tensorstore's and asyncio's reports of the failure silenced.

    A CheckpointMismatch raised by the restore (e.g. the data iterator's state saved for
    another data order) is raised again, after every process has taken part in the check that
    keeps them together: a checkpoint of another config is not damage."""
    _install_debris_filters()
    result, reason, mismatch = None, None, None
    with _quiet_logs():
        try:
            result = fn(*args)
        except Exception as e:  # orbax/tensorstore raise various types for damaged files
            reason, mismatch = _reason(e), _mismatch(e)
    if not everywhere(reason is None):
        if mismatch is not None:
            raise mismatch
        return None, reason or "it failed on another process"
    return result, None


def set_aside(mgr, steps) -> None:
    """Move damaged checkpoints out of rotation into <workdir>/checkpoints-damaged/
    <step>-<UTC time>/ (never deleted). Process 0 moves, every process waits for it, then
    reloads the manager so that it no longer lists them."""
    if not steps:
        return
    ckpt_dir = os.fspath(mgr.directory)
    if jax.process_index() == 0:
        dest_root = paths.damaged_checkpoint_dir(fs.dirname(ckpt_dir))
        fs.makedirs(dest_root)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for step in steps:
            src, dest = (fs.join(ckpt_dir, str(step)), fs.join(dest_root, f"{step}-{stamp}"))
            n = 1
            while fs.exists(dest):
                n += 1
                dest = fs.join(dest_root, f"{step}-{stamp}-{n}")
            try:
                # On gs:// a copy then a delete, not atomic: a reader may see the step half
                # gone, which orbax already treats as damaged (its commit marker goes first or
                # last); nothing here publishes.
                fs.rename(src, dest)
            except OSError as e:
                log.error("checkpoint %d: could not move it aside to %s: %s", step, dest, e)
                continue
            log.warning("checkpoint %d moved out of rotation to %s", step, dest)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("realm_jax.checkpoint.set_aside")
    mgr.reload()


def restore_latest(mgr, abstract_state, data_restore_args_fn=None, *, fingerprint=None):
    """(step, state) from the newest checkpoint that restores; None when there is none.

    With a `fingerprint`, each checkpoint's is compared before it is restored: a difference is
    a CheckpointMismatch, as is one the restore itself finds (try_restore: e.g. a data iterator
    saved for another data order); neither moves anything. A damaged checkpoint (truncated,
    zero-filled or missing files) is reported in one line and the next older one is tried; the
    damaged ones newer than the one restored are then moved aside (set_aside). When none
    restores, nothing is moved.
    """
    steps = sorted(mgr.all_steps(), reverse=True)
    failed = []
    for i, step in enumerate(steps):
        if fingerprint is not None:
            check_fingerprint(mgr, step, fingerprint, warn=i == 0)  # legacy: one warning
        data_args = data_restore_args_fn() if data_restore_args_fn else None
        state, reason = try_restore(restore, mgr, step, abstract_state, data_args)
        if reason is None:
            set_aside(mgr, failed)
            return step, state
        older = f"; trying checkpoint {steps[i + 1]}" if i + 1 < len(steps) else ""
        log.error(
            "checkpoint %d in %s cannot be restored: %s%s", step, mgr.directory, reason, older
        )
        failed.append(step)
    if steps:
        raise NoRestorableCheckpoint(
            f"no checkpoint in {mgr.directory} could be restored (tried {steps}; the errors "
            "are above): if the config or the data changed since they were written, revert "
            "the change, or pass a new --workdir; nothing was moved or deleted"
        )
    return None


def restore_params_subtree(mgr, step: int, name: str, abstract_subtree):
    """Only params[name] (no optimizer state) from checkpoint `step`: a partial restore."""
    target = {"params": {name: abstract_subtree}}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    out = mgr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            )
        ),
    )
    return out["state"]["params"][name]


def find_checkpoint(config, workdir: str, which="best"):
    """(read-only manager, step, "best"/"latest"/"requested") of the checkpoint `which` names in a
    workdir, for answering with it: "best" (a fine-tuned workdir's kept best dev checkpoint,
    else the newest), "latest" (the newest in checkpoints/) or a step number held in
    checkpoints/ or best/ (validation.existing_step's error otherwise)."""
    from realm_jax import validation

    which = validation.checkpoint(which)
    qa = config.get("task") == "qa" and "qa" in config
    best = None
    if qa and fs.isdir(paths.best_dir(workdir)):
        best = best_manager(paths.best_dir(workdir), config.qa.best_metric, read_only=True)
    if which == "best" and best is not None and (step := best.best_step()) is not None:
        return best, step, "best"
    has_dir = fs.isdir(paths.checkpoint_dir(workdir))
    mgr = manager(workdir, with_data=False, read_only=True) if has_dir else None
    if isinstance(which, int):
        if mgr is not None and which in mgr.all_steps():
            return mgr, which, "requested"
        if best is not None and which in best.all_steps():
            return best, which, "requested"
        held = set(mgr.all_steps() if mgr else ()) | set(best.all_steps() if best else ())
        validation.existing_step(which, held, workdir)
    if mgr is None:
        raise FileNotFoundError(f"{workdir}: no checkpoints: train this workdir first")
    step = mgr.latest_step()
    if step is None:
        raise FileNotFoundError(f"{paths.checkpoint_dir(workdir)}: no checkpoint yet")
    return mgr, step, "latest"


def best_manager(directory: str, metric: str, *, read_only: bool = False):
    """A CheckpointManager keeping the one checkpoint with the highest `metric` (orbax's
    best_fn): item 'state' holds {"params": ...} only, so restore_params_subtree reads it."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else 1,
        save_interval_steps=0 if read_only else 1,
        best_fn=lambda m: m[metric],
        best_mode="max",
        keep_checkpoints_without_metrics=False,
        create=not read_only,
        enable_async_checkpointing=False,
        read_only=read_only,
    )
    return ocp.CheckpointManager(directory, item_names=("state",), options=options)


def save_params(mgr, step: int, params, metrics: dict) -> bool:
    """Save params with their metrics into a best_manager (kept only while the best)."""
    args = ocp.args.Composite(state=ocp.args.PyTreeSave({"params": params}))
    return mgr.save(step, args=args, metrics=metrics, force=True)


# ------------------------------------------------------------ document-embedder exports
# The refresh job needs only the document embedder: a full checkpoint (3 BERTs + Adam's two
# moments, ~9x the embedder) every refresh would cost the trainer a full save each time. The
# trainer exports params[doc_embedder_name] alone to <workdir>/embedder/<step> instead.

# Exports kept: what guarantees a read without leases or copies. orbax picks the steps to
# delete when a save starts (after waiting for the previous save) and deletes them once that
# save is complete, so export s goes when export s + 3 * every is complete. When a refresh job
# finds s the newest complete export, s + every is not complete, so the trainer has not passed
# step s + 2 * every: the job has at least `every` training steps plus one export's write to
# restore s (the embedder alone: about a second at base). With 2 kept it would have only the
# writes. One deleted mid-read anyway is passed over for the newest, not taken for damage.
EXPORTS_KEPT = 3


def export_every(config) -> int:
    """Steps between the trainer's document-embedder exports; 0 when it writes none (a mode
    without a refresh job, or refresh.export_every negative). refresh.export_every 0 means
    refresh.every."""
    r = config.refresh
    every = int(r.get("export_every", 0))
    if r.mode != "external" or every < 0:
        return 0
    return every or int(r.every)


def export_manager(workdir: str, *, read_only: bool = False):
    """A CheckpointManager over <workdir>/embedder whose item 'state' holds {"params": {name:
    ...}} alone, so restore_params_subtree reads an export as it reads a checkpoint. Saves
    are async: the step waits only for the device-to-host copy. EXPORTS_KEPT kept (above)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else EXPORTS_KEPT,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        enable_async_checkpointing=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(
        paths.embedder_export_dir(workdir), item_names=("state",), options=options
    )


class EmbedderExport:
    """The trainer's exports of params[name] every `every` steps. Every process calls
    maybe_save at the same steps and writes the shards it holds (orbax: a collective)."""

    def __init__(self, workdir: str, name: str, every: int, start: int):
        self.name, self.every = name, every
        self.mgr = export_manager(workdir)
        self.last_seconds = 0.0  # how long the last save held the step (device-to-host copy)
        for step in [s for s in self.mgr.all_steps() if s > start]:
            # written before a crash, past the checkpoint this run resumed from: the steps
            # will be trained (and exported) again
            log.warning("embedder export %d is newer than resume point %d: deleted", step, start)
            self.mgr.delete(step)

    def maybe_save(self, step: int, params) -> bool:
        """Start an async save of params[name] at `step` when it is a multiple of `every`."""
        if step % self.every:
            return False
        tree = {"params": {self.name: params[self.name]}}
        t0 = time.time()
        saved = self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
        self.last_seconds = time.time() - t0
        if saved:
            size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
            log.info(
                "embedder export %d: %.1f MB save started (the step waited %.3fs)",
                step,
                size / 1e6,
                self.last_seconds,
            )
        return saved

    def close(self) -> None:
        """Wait for the last export to be complete."""
        self.mgr.wait_until_finished()
        self.mgr.close()
