"""ICT as a task of the shared loop: the `ict` command (and `train` with configs/ict.py)."""

from __future__ import annotations

import logging
import threading

import jax

from realm_jax import checkpoint
from realm_jax.config import ConfigError
from realm_jax.data import datasets, pipeline
from realm_jax.data import ict as ict_data
from realm_jax.ict.evaluation import IctEvaluator
from realm_jax.ict.step import compile_train_step, create_state
from realm_jax.index import bm25_candidates
from realm_jax.train import loop
from realm_jax.train.warm_start import params_hook

log = logging.getLogger("realm_jax.ict")


def _train(config, workdir: str, stop_event: threading.Event | None = None) -> list[dict]:
    """ICT pre-training of the embedders; resumable. Returns the logged metrics."""
    tc = config.train
    mesh, ddir, (tokens, doc_ids, titles) = loop.setup(config, workdir)
    train_ids = ict_data.train_block_ids(config.data, titles, doc_ids)
    log.info(
        "ICT: %d training blocks of %d; mesh %s", len(train_ids), len(titles), dict(mesh.shape)
    )
    if config.ict.get("positives", "own_block") == "bm25":  # the BM25-imitation control
        extra = bm25_candidates.ensure(ddir, 1)
        loader = ict_data.imitation_loader(config, ddir, extra, tokens)
        log.info("ICT positives: BM25's top block for each masked pre-training sentence")
    else:  # ORQA's: a sentence's own block (too few blocks: an error before checkpoints)
        loader = ict_data.train_loader(config, ddir, train_ids)
    mgr = checkpoint.manager(workdir, keep=tc.keep_checkpoints)
    loop.drop_stale_start(mgr, loop.fingerprint(config, ddir))
    hook = None if mgr.all_steps() else params_hook(config, reader=False)
    model, optimizer, state, shardings = create_state(config, mesh, jax.random.key(tc.seed), hook)
    evaluator = None  # built before checkpoint 0: what refuses the data refuses it first
    if tc.eval_every > 0 and datasets.has_held_out(ddir, "held-out evaluation (train.eval_every)"):
        evaluator = IctEvaluator(config, mesh, model, ddir, tokens)
    it = iter(loader)
    start, state = loop.init_or_resume(
        mgr,
        state,
        shardings,
        it,
        (pipeline.iterator_save_args, pipeline.iterator_restore_args),
        fingerprint=loop.fingerprint(config, ddir),
    )
    step_fn = compile_train_step(config, mesh, model, optimizer, shardings)
    keys = tuple(f"recall@{k}" for k in config.ict.recall_ks)
    task = loop.Task(
        name="ict",
        step=step_fn,
        evaluate=evaluator,
        console_keys=("loss", "accuracy"),
        eval_console_keys=keys + tuple(f"bm25_{k}" for k in keys),
    )
    return loop.run(
        config, workdir, task, state, it, mgr, start, pipeline.iterator_save_args, stop_event
    )


train = loop.trainer_locked(_train)


def command(config, args) -> int:
    """`realm-jax ict` (or `train`/`local` with configs/ict.py)."""
    if config.task != "ict":
        raise ConfigError(f"{args.config} is a {config.task!r} config; use configs/ict.py")
    train(config, args.workdir)
    return 0
