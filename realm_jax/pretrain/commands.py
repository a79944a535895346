"""REALM pre-training as a task of the shared loop (train/loop.py): mesh, data, state,
weight import, the index feed, the step, held-out evaluation; and the `train` and `local`
commands."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from realm_jax import checkpoint, fs, runtime, sharding
from realm_jax import workdir as paths
from realm_jax.config import ConfigError
from realm_jax.data import datasets, pipeline, versions
from realm_jax.index import bm25_candidates
from realm_jax.index.feed import IndexFeed
from realm_jax.lock import workdir_lock
from realm_jax.model.bert import ModelConfig
from realm_jax.model.realm import doc_embedder_name
from realm_jax.pretrain import step as pretrain_step
from realm_jax.pretrain.evaluation import RealmEvaluator
from realm_jax.train import loop
from realm_jax.train.warm_start import params_hook

log = logging.getLogger("realm_jax.train")


def _train(
    config,
    workdir: str,
    stop_event: threading.Event | None = None,
    health: Callable[[], None] | None = None,
    no_job_grace: float = 0.0,
) -> list[dict]:
    """Pre-train REALM; resumable. Returns the metrics logged by this run (one dict per log).

    health() is called while waiting for the first index and before every step; it raises
    when something the run depends on has died (`local`'s refresh job)."""
    tc = config.train
    mesh, ddir = _setup(config, workdir)
    # the block token table [N, Lb], row-sharded: this host read only its own devices' rows
    # (and the titles of those, exchanged for the held-out evaluation's)
    curriculum = int(tc.get("own_block_steps", 0)) > 0
    separate = bool(config.data.get("sentences", ""))  # a separate text: documents by title
    with_titles = tc.eval_every > 0 or curriculum or separate
    # the workdir's newest corpus version (`update`'s; the prepared data when there is none):
    # its live blocks, in position order, are the blocks retrieved, embedded and refreshed;
    # the examples (prepared sentences) name their blocks by prepared row, mapped to positions
    view = versions.open_view(config, workdir)
    tokens = view.device_tokens(mesh, with_titles=with_titles)
    positions = view.positions()
    titles = tokens.titles
    if tc.eval_every > 0:
        sharding.check_batch(tc.eval_batch_size, mesh, "train.eval_batch_size")
    extra_m = int(tc.get("bm25_candidates", 0))
    check_candidates(tc.num_candidates, tokens.shape[0], mesh, extra_m)
    log.info(
        "mesh %s over %d devices (%d processes); %d blocks (%s)",
        dict(mesh.shape),
        mesh.devices.size,
        jax.process_count(),
        tokens.shape[0],
        view,
    )
    # Everything that can refuse the data (too few examples for a batch) before the first
    # checkpoint is written.
    gold_of = None
    if curriculum or separate:  # a separate text's sentences: their document's block (the
        # first of its title), for the curriculum and the own-document coverage metrics
        gold_of = titles  # datasets.TitleIds: .get(title) is its first block
    extra = None
    if extra_m > 0 or int(tc.get("article_block_steps", 0)) > 0:  # (the file holds both)
        extra = bm25_candidates.ensure(ddir, max(extra_m, 1)).truncated(extra_m)
    loader = pipeline.train_loader(
        config,
        ddir,
        global_batch_size=tc.batch_size,
        seed=config.data.seed,
        gold_of=gold_of,
        extra=extra,
        positions=positions,
    )
    eval_batches = None
    if tc.eval_every > 0 and datasets.has_held_out(ddir, "held-out evaluation (train.eval_every)"):
        eval_batches = pipeline.eval_batches(
            config,
            ddir,
            batch_size=tc.eval_batch_size,
            max_examples=tc.eval_examples,
            positions=positions,
        )
    mgr = checkpoint.manager(workdir, keep=tc.keep_checkpoints)
    hook = None if mgr.all_steps() else params_hook(config)  # a resume restores the weights
    model, optimizer, state, shardings = pretrain_step.create_state(
        config, mesh, jax.random.key(tc.seed), hook
    )
    it = iter(loader)
    start, state = loop.init_or_resume(
        mgr,
        state,
        shardings,
        it,
        (pipeline.iterator_save_args, pipeline.iterator_restore_args),
        fingerprint=loop.fingerprint(config, ddir),
    )
    export = _embedder_export(config, workdir, start)  # before a stale export is read
    feed = IndexFeed(config, workdir, mesh, model, tokens, index_dir=view.index_dir)
    feed.start(state.params, start, health, no_job_grace)
    step_fn = pretrain_step.compile_train_step(
        config, mesh, model, optimizer, shardings, feed.num_blocks
    )
    # the steps before train.embedders_frozen_steps: the reader's gradient alone (compiled
    # only when a step before it is run: a resume past it never compiles it)
    frozen = pretrain_step.frozen_steps(config)
    frozen_fn = None
    if frozen > 0:
        frozen_fn = pretrain_step.compile_train_step(
            config, mesh, model, optimizer, shardings, feed.num_blocks, frozen=True
        )
    evaluator = None
    if eval_batches is not None:
        evaluator = RealmEvaluator(config, mesh, model, feed, eval_batches, titles)

    def before_step(step: int, state) -> dict:
        if health is not None:
            health()
        out = {}  # the export first: a lockstep refresh may wait for its index below
        if export is not None and step > start and export.maybe_save(step, state.params):
            out["embedder_export_seconds"] = export.last_seconds
        if step > start and feed.due(step) and feed.maybe_refresh(state.params, step):
            out["index_swap_seconds"] = feed.last_swap_seconds
        return out

    def before_step_waits(step: int) -> bool:  # it reads the params (not amortized's slices)
        if step <= start:
            return False
        if export is not None and step % export.every == 0:
            return True
        return feed.due(step) and (feed.mode == "inprocess" or feed.lockstep)

    def run_with(fn):
        def step(state, batch):
            return fn(state, batch, feed.emb, feed.tokens, jnp.int32(feed.step))

        return step

    step = run_with(step_fn)
    frozen_step = run_with(frozen_fn) if frozen_fn is not None else None

    task = loop.Task(
        name="realm",
        step=step,
        evaluate=evaluator,
        before_step=before_step,
        before_step_waits=before_step_waits,
        console_keys=CONSOLE_KEYS,
        eval_console_keys=EVAL_CONSOLE_KEYS,
        close=lambda: _close(feed, export),
        step_for=pretrain_step.step_for(step, frozen_step, frozen) if frozen_step else None,
    )
    return loop.run(
        config, workdir, task, state, it, mgr, start, pipeline.iterator_save_args, stop_event
    )


def _embedder_export(config, workdir: str, start: int):
    """The trainer's exports of the document embedder for the refresh job (external mode,
    every refresh.export_every steps: checkpoint.EmbedderExport); None when it writes none."""
    every = checkpoint.export_every(config)
    if every <= 0:
        return None
    name = doc_embedder_name(ModelConfig.from_config(config.model, "embedder"))
    return checkpoint.EmbedderExport(workdir, name, every, start)


def _close(feed: IndexFeed, export) -> None:
    feed.close()
    if export is not None:
        export.close()  # the last export complete before the trainer exits


def _setup(config, workdir: str):
    """loop.setup without its read of every block: (mesh, data dir), the workdir made, the
    global batch checked against the mesh and the prepared data against the config."""
    fs.makedirs(workdir)
    mesh = sharding.make_mesh(config.mesh)
    accum = int(config.train.get("grad_accum", 1))
    sharding.check_batch(config.train.batch_size, mesh, grad_accum=accum)
    ddir = paths.data_dir(config, workdir)
    datasets.check_prepared(config, ddir)
    return mesh, ddir


def check_candidates(num_candidates: int, num_blocks: int, mesh, extra: int = 0) -> None:
    """REALM retrieves num_candidates - 1 blocks besides the null document, never the
    query's own block, so the corpus must hold at least num_candidates blocks (each device
    keeps a local top-k of its rows; ops/mips.py merges them); a second retriever's `extra`
    blocks (train.bm25_candidates) come from the same corpus less the own block."""
    del mesh  # any number of rows per device works
    if not 2 <= num_candidates <= num_blocks:
        raise ConfigError(
            f"train.num_candidates={num_candidates}: must be at least 2 and at most "
            f"{num_blocks} here (the null document + up to {num_blocks - 1} retrieved blocks "
            "of a corpus that excludes the query's own); lower train.num_candidates"
        )
    if not 0 <= extra < num_blocks:
        raise ConfigError(
            f"train.bm25_candidates={extra}: must be at least 0 and at most {num_blocks - 1} "
            "here (BM25's blocks of a corpus that excludes the query's own)"
        )


train = loop.trainer_locked(_train)  # `local` takes the lock itself, then calls _train


CONSOLE_KEYS = (
    "loss",
    "accuracy",
    "retrieval_utility",
    "retrieval_entropy",
    "null_doc_prob",
    "span_in_candidates",
    "span_in_candidates_dense",
    "doc_in_candidates",
    "doc_in_candidates_dense",
    "signal_span",
    "signal_doc",
    "inbatch_outside_mass",
    "imitation_loss",
    "imitation_accuracy",
    "staleness",
)


EVAL_CONSOLE_KEYS = (
    "accuracy",
    "null_only_accuracy",
    "retrieval_utility",
    "retrieval_entropy",
    "null_doc_prob",
    "same_title_fraction",
    "same_title_random",
    "title_recall@1",
    "title_recall@5",
    "copy_gain",
    "top1_share",
)


def train_command(config, args) -> int:
    """`realm-jax train` with a REALM config: the trainer alone (pair it with `refresh`, or
    refresh in process). With refresh.mode=external and no refresh job in sight within
    NO_JOB_GRACE_S (at most refresh.wait_seconds), one error line (exit 2), not a long wait."""
    train(config, args.workdir, no_job_grace=NO_JOB_GRACE_S)
    return 0


NO_JOB_GRACE_S = 60.0  # `train`: how long a first index may come without a refresh job seen


def _passthrough_args(args) -> list[str]:
    """The refresh child's command line: the parent's config, every override (the workdir's
    recorded ones included: cli sets args.overrides), so both run the same config."""
    out = ["--config", args.config, "--workdir", args.workdir]
    given = getattr(args, "overrides", None)
    if given is None:
        return out + [a for a in sys.argv[1:] if a.startswith("--config.")]
    return out + [f"--config.{o}" for o in given]


def local(config, args) -> int:
    """`realm-jax local`: the trainer in this process, the refresher as a child process;
    both stop together. The trainer lock is taken before the child starts (it takes the
    refresher lock itself)."""
    with workdir_lock(args.workdir, "trainer", enabled=jax.process_index() == 0):
        return _local(config, args)


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (R, S, D, T for stopped, Z...; "" unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class _Supervised:
    """`local`'s refresh job: restarted when it exits (its own watchdog exits 75 when it hangs
    alive) or stays stopped (SIGSTOP, state T) for refresh.stopped_grace_s, up to
    refresh.max_restarts times; then the run stops, its last checkpoint kept."""

    def __init__(self, cmd: list[str], config):
        self.cmd, self.restarts = cmd, 0
        self.max_restarts = int(config.refresh.get("max_restarts", 3))
        self.grace = float(config.refresh.get("stopped_grace_s", 30.0))
        self.stopped_since: float | None = None
        self.child = self._start()

    def _start(self) -> subprocess.Popen:
        # the child dies with this process (runtime.die_with_parent: no preexec_fn, no fork
        # of this multithreaded process through Python)
        env = {**os.environ, runtime.PARENT_ENV: str(os.getpid())}
        child = subprocess.Popen(self.cmd, env=env)
        log.info("local: started refresher (pid %d)", child.pid)
        self.stopped_since = None
        return child

    def check(self) -> None:
        child, why = self.child, None
        if child.poll() is not None:
            why = f"exited with code {child.returncode}"
        elif _process_state(child.pid) == "T":
            now = time.monotonic()
            self.stopped_since = self.stopped_since or now
            if now - self.stopped_since >= self.grace:
                why = f"has been stopped (state T) for {now - self.stopped_since:.0f} s"
                child.kill()
                child.wait()
        else:
            self.stopped_since = None
        if why is None:
            return
        if self.restarts >= self.max_restarts:
            raise loop.TrainingStopped(
                f"the refresh job (pid {child.pid}) {why}, after {self.restarts} restarts "
                f"(refresh.max_restarts): the index would go stale; stopping (its log is "
                "above). The last checkpoint is kept."
            )
        self.restarts += 1
        log.warning(
            "local: the refresh job (pid %d) %s: restarting it (%d of refresh.max_restarts %d)",
            child.pid, why, self.restarts, self.max_restarts,
        )  # fmt: skip
        self.child = self._start()

    def stop(self) -> None:
        child = self.child
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)  # a stopped child cannot act on SIGTERM
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
            log.info("local: refresher stopped")


def _local(config, args) -> int:
    # the prepared data against the config before the refresh child starts (one error line)
    datasets.check_prepared(config, paths.data_dir(config, args.workdir))
    supervised = None
    if config.refresh.mode == "external":
        cmd = [sys.executable, "-m", "realm_jax", "refresh", *_passthrough_args(args)]
        supervised = _Supervised(cmd, config)

    def refresher_alive() -> None:
        if supervised is not None:
            supervised.check()

    try:
        _train(config, args.workdir, None, refresher_alive)  # the lock is held: not train()
    finally:
        if supervised is not None:
            supervised.stop()
    return 0
