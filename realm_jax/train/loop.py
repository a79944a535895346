"""One loop for every task: resume / warm start / scratch, data, step, evaluation,
checkpoints, preemption, TensorBoard and progress. A task supplies the rest (`Task`), as
big_vision's trainers and t5x's models do: its state, its jitted step, its evaluation, its
metrics. A fix here (checkpointing, the stop signal, logging) lands once for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from realm_jax import checkpoint, fs, runtime, sharding, watchdog
from realm_jax import workdir as paths
from realm_jax.lock import LEASE_SECONDS, workdir_lock
from realm_jax.train import goodput, instruments
from realm_jax.train.metrics import MetricWriter, Progress, line

log = logging.getLogger("realm_jax.train")


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. non-finite steps); the message says why and what is kept."""


@dataclasses.dataclass
class Task:
    """What a task gives the loop.

    step(state, global_batch) -> (state, metrics): the jitted update (metrics stay on device
    until a log step). before_step(step, state) -> dict: host work before a step (REALM's
    index swap), extra values to log. before_step_waits(step) -> bool: whether that host work
    will read the state on the device (an in-process refresh, an export): the loop then waits
    for the steps in flight first, so their run is step time, not the index's (instruments.py);
    a check that does not (run before every step, waiting would stall the dispatch) says False.
    evaluate(state, step) -> dict of floats: held-out metrics, logged under "eval/".
    console_keys: the metrics printed on the console line.
    step_for(step) -> the step function for `step` (another compiled variant of `step` for
    some steps: REALM's frozen-embedders step); None: `step` for every step.
    """

    name: str
    step: Callable[[Any, dict], tuple[Any, dict]]
    evaluate: Callable[[Any, int], dict[str, float]] | None = None
    before_step: Callable[[int, Any], dict] | None = None
    before_step_waits: Callable[[int], bool] | None = None
    console_keys: tuple[str, ...] = ("loss",)
    eval_console_keys: tuple[str, ...] = ()
    close: Callable[[], None] | None = None
    step_for: Callable[[int], Callable[[Any, dict], tuple[Any, dict]]] | None = None


# config.model fields that say how the networks compute, not what a checkpoint holds: a resume
# may change them (the init_* weight sources are read only before the first checkpoint).
UNFINGERPRINTED_MODEL_FIELDS = ("dtype", "remat", "remat_policy", "dropout", "proj_dropout")


def _flat(prefix: str, tree, out: dict) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _flat(f"{prefix}.{k}", v, out)
        else:
            out[f"{prefix}.{k}"] = v


def fingerprint(config, data_dir: str) -> dict:
    """What a run's checkpoints depend on, as flat "field": value pairs (JSON values): the
    task, the model's architecture (config.model but the weight sources and the fields in
    UNFINGERPRINTED_MODEL_FIELDS), the prepared data's identity (its summary's fingerprint,
    config and counts, under "prepared.") and what the data iterator's saved state depends on
    (train.batch_size, data.seed, REALM's read-time data.mask_mode). init_or_resume compares
    it with the checkpoint's."""
    model = {
        k: v
        for k, v in config.model.to_dict().items()
        if not k.startswith("init_") and k not in UNFINGERPRINTED_MODEL_FIELDS
    }
    for k, v in model.items():
        if isinstance(v, dict):
            model[k] = {f: x for f, x in v.items() if f not in UNFINGERPRINTED_MODEL_FIELDS}
    from realm_jax.data import datasets  # TFDS: not for every command that imports the loop

    out = {"task": config.get("task", "")}
    _flat("model", model, out)
    summary = datasets.load_summary(data_dir)
    out["datasets.fingerprint"] = summary.get("fingerprint")
    _flat("datasets.config", summary.get("config", {}), out)
    _flat("datasets.counts", summary.get("counts", {}), out)
    out["train.batch_size"] = config.train.batch_size
    out["data.seed"] = config.data.seed
    if config.get("task") == "realm":  # the masks it reads (absent in older checkpoints)
        out["data.mask_mode"] = config.data.get("mask_mode", "salient")
    return json.loads(json.dumps(out))  # tuples as lists: as it reads back from the metadata


def trainer_locked(train_fn):
    """A task's train(config, workdir, ...) that holds the workdir's trainer lock for the whole
    run, taken before any data or checkpoint is touched (LockError when another trainer holds
    it). Only process 0 locks. A sweep trial's link (REALM_JAX_TRIAL) is checked first."""

    @functools.wraps(train_fn)
    def train(config, workdir: str, *args, **kwargs):
        _trial_link()  # a malformed sweep link (REALM_JAX_TRIAL): its error before anything
        with workdir_lock(workdir, "trainer", enabled=jax.process_index() == 0):
            # the others start once process 0 holds the lock (it may wait out a dead lease)
            runtime.barrier("trainer-lock", LEASE_SECONDS + 60)
            return train_fn(config, workdir, *args, **kwargs)

    return train


def setup(config, workdir: str):
    """What every task does first: the workdir, the mesh (the global batch must divide over
    it), the prepared data checked against the config. Returns (mesh, data dir, (tokens
    [N, block_len], doc_ids, titles))."""
    from realm_jax.data import datasets  # TFDS: not for every command that imports the loop

    fs.makedirs(workdir)
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_batch(config.train.batch_size, mesh)
    ddir = paths.data_dir(config, workdir)
    datasets.check_prepared(config, ddir)
    return mesh, ddir, datasets.load_blocks(ddir)


def drop_stale_start(mgr, fingerprint: dict) -> None:
    """A workdir whose only checkpoint is step 0 (a first run that failed before its first
    step) written with another config or other data: that checkpoint (the initial state,
    nothing trained) is moved aside (checkpoint.set_aside) so the rerun starts afresh rather
    than being refused. Call before the warm start is decided (it reads mgr.all_steps())."""
    if list(mgr.all_steps()) != [0]:
        return
    try:
        checkpoint.check_fingerprint(mgr, 0, fingerprint, warn=False)
    except checkpoint.CheckpointMismatch as e:
        log.warning(
            "checkpoint 0 is the initial state of a run that stopped before its first step, "
            "written with another config or other data (%s): moving it aside and starting "
            "afresh",
            str(e).split(": ", 1)[-1].split(". Revert")[0],
        )
        checkpoint.set_aside(mgr, [0])


def init_or_resume(mgr, state, shardings, it, data_args, *, fingerprint=None):
    """(start step, state): resume from the newest restorable checkpoint (weights, optimizer
    and data iterator), else keep the given (scratch or warm-started) state and save it as
    step 0, which the refresh job embeds first. `data_args` are pipeline's iterator
    (save_args, restore_args) functions.

    `fingerprint` (fingerprint(config, data_dir)) is checked against the checkpoint's before
    it is restored (checkpoint.CheckpointMismatch when the config or the data changed) and
    recorded in every checkpoint this run saves. A damaged newest checkpoint is moved aside and
    the run resumes from the one before (checkpoint.restore_latest).

    The checkpoint may have been written by another number of JAX processes (a pod slice with
    another host count): orbax reshards the state onto this run's mesh, and the data iterator
    is re-sharded at the checkpoint's global batch (`data_args` of data/pipeline.py: the global
    batches do not depend on the process count), so the run goes on with the batches an
    uninterrupted run would have had."""
    save_args, restore_args = data_args
    if fingerprint is not None:
        mgr.fingerprint = fingerprint  # every later checkpoint.save records it
    wd = watchdog.current()  # the CLI's: a restore or first save that hangs exits
    with wd.stage("checkpoint restore", slow=True) if wd else contextlib.nullcontext():
        restored = checkpoint.restore_latest(
            mgr,
            checkpoint.abstract_like(state, shardings),
            lambda: restore_args(it),
            fingerprint=fingerprint,
        )
    if restored is not None:
        log.info("resumed from checkpoint %d", restored[0])
        return restored
    with wd.stage("checkpoint save", slow=True, step=0) if wd else contextlib.nullcontext():
        checkpoint.save(mgr, 0, state, save_args(it))
        mgr.wait_until_finished()
    return 0, state


class StopSignal:
    """Set by SIGTERM/SIGINT (preemption): the loop saves a checkpoint and exits."""

    def __init__(self, external: threading.Event | None = None):
        self.event = external or threading.Event()
        self.signum = None
        self.previous = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, _frame):
            self.signum = signum
            self.event.set()

        for s in (signal.SIGTERM, signal.SIGINT):
            self.previous[s] = signal.signal(s, handler)

    def uninstall(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)

    def any_process(self) -> bool:
        flag = self.event.is_set()
        if jax.process_count() > 1:
            flag = bool(multihost_utils.process_allgather(np.array(flag)).any())
        return flag

    def check(self, step: int, at_save: bool, every: int) -> bool:
        """Whether the run stops after `step`. One process: its own flag at every step (an
        Event read, no sync). Several: any_process() (an allgather and a blocking read, so
        the host could not dispatch step N+1 before step N ended) only every `every` steps and
        at checkpoint steps, which depend on the step alone: every process decides at the
        same steps. A stop waits at most `every` steps (train.stop_check_every).

        Not jax's multihost_utils.reached_preemption_sync_point: it needs jax.distributed's
        preemption sync manager (absent in a one-process run and on CPU), and it learns only
        of the notices the coordination service catches itself, not of this Event, which
        `local` and the tests set from other threads."""
        if jax.process_count() == 1:
            return self.event.is_set()
        if not at_save and step % max(1, every) != 0:
            return False
        return self.any_process()


def _check_finite(values: dict, step: int, limit: int, mgr) -> None:
    """Stop past `limit` non-finite steps in a row (counted on device; skipped steps changed
    nothing). Raises before any save, so the newest checkpoint stays the last good one."""
    streak = int(values.get("nonfinite", 0))
    if streak == 0:
        return
    bad = [k for k in ("loss", "grad_norm") if not np.isfinite(values.get(k, 0.0))]
    log.warning("step %d: %s not finite (%d steps in a row; skipped)", step, bad, streak)
    if streak > limit:
        raise TrainingStopped(
            f"step {step}: {' and '.join(bad) or 'loss/grad_norm'} not finite for {streak} "
            f"steps in a row (train.max_nonfinite = {limit}); those updates were not applied "
            f"and nothing was saved: the newest checkpoint ({mgr.latest_step()}) is the last "
            "good one. Lower train.lr or check the data, then resume."
        )


def _console(prefix: str, step: int, total: int, values: dict, keys, prog: dict) -> str:
    shown = {k: values[k] for k in keys if k in values}
    return prefix + line(step, total, shown, prog)


class _ExampleIdsLog:
    """train.record_example_ids' file: appended a line a step, flushed at once (a kill -9
    loses at most that line). On a gs:// workdir, where an object cannot be appended to, the
    lines go to a local copy (fs.cache_root()/example-ids/<bucket>/<folder>/) that starts as
    the bucket's file (so a run resumed on another host, or after a host's disk is gone, goes
    on from it) and is uploaded whole, replacing the object, at every checkpoint save and when
    the run ends. A kill then loses the lines since the last save, which the resumed run
    trains and records again anyway (its checkpoint is at most that new). Refusing gs:// would
    take the record from exactly the runs it is for: pod runs, resumed on another host count.
    The upload rewrites the whole file, fine for the drills and data-order checks it serves;
    an upload that fails is logged and retried at the next save, not fatal to the run."""

    def __init__(self, path: str):
        self.remote = path if fs.is_remote(path) else None
        self.local = path
        if self.remote is not None:
            rel = path.partition("://")[2]
            self.local = os.path.join(fs.cache_root(), "example-ids", *rel.split("/"))
            os.makedirs(os.path.dirname(self.local), exist_ok=True)
            try:
                with fs.open(path, "rb") as src, open(self.local, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 22)
            except FileNotFoundError:  # the first run in this workdir
                open(self.local, "wb").close()
        self.file = open(self.local, "ab+")  # appends; reads follow seek
        if self.file.seek(0, io.SEEK_END) > 0:
            self.file.seek(-1, io.SEEK_END)
            # a line cut by a kill stays alone, never joins the next one
            if self.file.read(1) != b"\n":
                self.file.write(b"\n")
        self.file.flush()

    def write(self, step: int, example_ids) -> None:
        record = {"step": step, "example_ids": example_ids.tolist()}
        self.file.write(json.dumps(record).encode() + b"\n")
        self.file.flush()  # one write(2): a kill -9 loses at most this line

    def upload(self) -> None:
        """The local copy to the gs:// file, whole (nothing to do for a local workdir)."""
        if self.remote is None:
            return
        self.file.flush()
        try:
            with open(self.local, "rb") as src, fs.open(self.remote, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)  # visible, whole, at close
        except Exception as e:  # the record must not end the run: the next save retries
            log.warning("could not upload %s to %s: %s", self.local, self.remote, e)

    def close(self) -> None:
        self.upload()
        self.file.close()


def _example_ids_log(config, workdir: str) -> _ExampleIdsLog | None:
    """What train.record_example_ids appends to (None when off): one JSON line per step,
    {"step": s, "example_ids": [...]}, the ids of the prepared examples step s trained on
    (process 0's share), taken from the host batch so it costs no device sync. A resumed run
    appends the steps it redoes again: the last line of a step is what it trained on. The
    workdir may be gs:// (_ExampleIdsLog: a local copy uploaded at each checkpoint save)."""
    if not config.train.get("record_example_ids", False) or jax.process_index() != 0:
        return None
    return _ExampleIdsLog(paths.example_ids_path(workdir))


def run(
    config,
    workdir: str,
    task: Task,
    state,
    it,
    mgr,
    start: int,
    save_args: Callable,
    stop_event: threading.Event | None = None,
) -> list[dict]:
    """Train `task` from `start` to train.steps; returns the logged metrics (one dict per log,
    evaluations included with "eval/" keys)."""
    tc = config.train
    mesh = sharding.make_mesh(config.mesh)
    # the steps a restart trains again: read before this run's writer starts its event file
    redone = goodput.redone_steps(workdir, start) if jax.process_index() == 0 else 0
    meter = instruments.Meter(tc.batch_size, start, redone)
    profile = instruments.Profile(
        tc.get("profile_steps", ""), paths.profile_dir(workdir), start, tc.steps
    )
    writer = MetricWriter(paths.tb_dir(workdir))
    progress = Progress(tc.steps, start)
    stop = StopSignal(stop_event)
    stop.install()
    history: list[dict] = []
    step, extra = start, {}
    ids_log = _example_ids_log(config, workdir)
    ready = -1  # the step before_step last ran for
    # a main thread stuck while its JAX client keeps beating exits (watchdog.py): the
    # process's, started by the CLI before the restore, else one of the loop's own
    wd = watchdog.current() or watchdog.from_config(tc, f"{config.task} training step")
    own_watchdog = wd is not watchdog.current()
    stop_every = int(tc.get("stop_check_every", 10))  # steps between the stop checks
    trial = _trial_link()  # a sweep's trial (REALM_JAX_TRIAL), else None

    def prepare(step: int) -> None:
        """The task's host work before `step` (REALM: take up a newer index), once per step."""
        nonlocal ready
        if task.before_step is not None and ready != step:
            waits = task.before_step_waits is not None and task.before_step_waits(step)
            with meter.timed("index", settle=waits):
                extra.update(task.before_step(step, state) or {})
        ready = step

    def evaluate(step: int) -> dict | None:
        if task.evaluate is None or tc.eval_every <= 0:
            return None
        prepare(step)  # evaluate against the index the next step would use, not an older one
        values = {f"eval/{k}": v for k, v in task.evaluate(state, step).items()}
        values["step"] = step
        writer.scalars(step, values)
        history.append(values)
        if jax.process_index() == 0:
            keys = [f"eval/{k}" for k in task.eval_console_keys]
            print(_console("eval ", step, tc.steps, values, keys, {}), flush=True)
        return values

    def pruned(step: int, values: dict | None) -> bool:
        """Report an evaluation to the sweep's trial; whether its pruner stops the run here.
        Step 0 is reported (the curve's start, which the study's plots show) but never pruned
        on: nothing is trained yet, and trials differ there only by chance. The last step is
        not pruned on either: the run is complete, its value a finished trial's, nothing left
        to save."""
        if trial is None or values is None:
            return False
        with wd.stage("sweep report", slow=True, step=step):  # bounded by trial.retry_s too
            return trial.report(step, values, may_prune=0 < step < tc.steps)

    try:
        if start == 0:
            with wd.stage("evaluation", slow=True, step=0), meter.timed("eval"):
                values = evaluate(0)
            pruned(0, values)
        while step < tc.steps:
            with wd.stage("index swap", slow=True, step=step):
                prepare(step)
            with wd.stage("data", step=step), meter.timed("data"):
                local = next(it)
                example_ids = local.pop("example_id", None)  # host-side: never to the device
                batch = sharding.global_batch(local, mesh)
            profile.before(step + 1)
            with wd.stage("step", step=step):
                step_fn = task.step if task.step_for is None else task.step_for(step)
                state, metrics = meter.call_step(step_fn, state, batch, local)
            step += 1
            profile.after(step, metrics)
            if ids_log is not None and example_ids is not None:
                ids_log.write(step, example_ids)
            at_log = step % tc.log_every == 0 or step == tc.steps
            at_save = step % tc.checkpoint_every == 0 or step == tc.steps
            if at_log or at_save:  # the host reads the metrics only here
                # waits for the device, collectives
                with wd.stage("step results", step=step), meter.timed("step"):
                    last = {k: float(v) for k, v in sharding.to_host(metrics).items()}
                _check_finite(last, step, tc.max_nonfinite, mgr)
            if at_log:
                last.update(extra)
                last["step"], extra = step, {}
                prog = progress.update(step)
                perf = meter.values(step)  # the instruments: console, TensorBoard, metrics.json
                writer.scalars(step, {**last, **prog, **perf})
                history.append(last)
                if jax.process_index() == 0:
                    prog = {**prog, **perf}
                    print(_console("", step, tc.steps, last, task.console_keys, prog), flush=True)
            if at_save:
                with wd.stage("checkpoint save", slow=True, step=step), meter.timed("checkpoint"):
                    checkpoint.save(mgr, step, state, save_args(it))
                    if ids_log is not None:  # on gs://: the ids up to this checkpoint, uploaded
                        ids_log.upload()
            if tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.steps):
                with wd.stage("evaluation", slow=True, step=step), meter.timed("eval"):
                    values = evaluate(step)
                if pruned(step, values):  # its checkpoint, PRUNED, the run ends (exit 0)
                    with wd.stage("checkpoint save", slow=True, step=step):
                        if not at_save:  # (saving a step twice raises StepAlreadyExistsError)
                            checkpoint.save(mgr, step, state, save_args(it), force=True)
                        mgr.wait_until_finished()  # PRUNED names a checkpoint that is there
                    _write_pruned(trial, workdir, step, values)
                    break  # as a stop does: metrics.json says complete=false
            wd.beat(step)
            if tc.preemption_save and stop.check(step, at_save, stop_every):
                log.warning(
                    "stop requested (signal %s): %s checkpoint %d and exiting",
                    stop.signum,
                    "saved" if at_save else "saving",
                    step,
                )
                if not at_save:  # saving the same step twice raises StepAlreadyExistsError
                    with meter.timed("checkpoint"):
                        checkpoint.save(mgr, step, state, save_args(it), force=True)
                break  # ids_log is uploaded by its close() below
        profile.stop()  # a stop before the profile's last step
    except Exception as e:  # multi-process: a peer that died shows up as a failed collective
        if (message := runtime.peer_lost_message(e)) is not None:
            log.error(message)
        raise
    finally:
        with wd.stage("final save", slow=True, step=step):  # storage that never answers exits
            mgr.wait_until_finished()
            writer.close()
            if ids_log is not None:
                ids_log.close()
        if own_watchdog:
            wd.close()
        else:  # the CLI's watches the command's work after the loop, then closes
            wd.phase(f"after the {config.task} loop")
        stop.uninstall()
        if task.close is not None:
            task.close()
    if history and jax.process_index() == 0:
        write_final_metrics(workdir, step, tc.steps, history, task, meter.values(step))
    return history


def _trial_link():
    """The sweep trial REALM_JAX_TRIAL links this run to (sweep/trial.py), else None; Optuna
    is imported only for a linked run."""
    if not os.environ.get("REALM_JAX_TRIAL", "").strip():
        return None
    from realm_jax.sweep.trial import TrialLink

    return TrialLink.from_env()


def _write_pruned(trial, workdir: str, step: int, values: dict) -> None:
    """A run the sweep's pruner stopped at `step` (its checkpoint saved): WORKDIR/PRUNED,
    which the sweep's worker reads (process 0), and one line."""
    value = trial.value(values)
    if jax.process_index() == 0:
        trial.write_pruned(workdir, step, value)
    log.warning("pruned by the sweep at step %d (objective=%.6g)", step, value)


def write_final_metrics(
    workdir: str, step: int, steps: int, history: list[dict], task: Task, perf=None
):
    """WORKDIR/metrics.json, for sweeps (`realm-jax sweep`) and scripts: the last step, the
    last logged train metrics and the latest held-out evaluation, with the keys the task shows
    on the console; `perf` (instruments.Meter.values at the end of the run): `mfu`, `goodput`,
    `goodput_split` and `instruments` (instruments.summary), this run's. A resumed run updates
    the file, keeping an evaluation it did not redo."""
    path = paths.metrics_path(workdir)
    out = {}
    if fs.exists(path):
        out = json.loads(fs.read_text(path))
    train = [h for h in history if not any(k.startswith("eval/") for k in h)]
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    out.update(step=step, steps=steps, complete=step >= steps, task=task.name)
    out["console_keys"] = {"train": list(task.console_keys), "eval": list(task.eval_console_keys)}
    if train:
        out["train_step"] = train[-1]["step"]
        out["train"] = {k: v for k, v in train[-1].items() if k != "step"}
    if evals:
        out["eval_step"] = evals[-1]["step"]
        out["eval"] = {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval/")}
    if perf is not None:
        out.update(instruments.summary(perf))
    fs.write_text(path, json.dumps(out, indent=2, sort_keys=True, default=float))
