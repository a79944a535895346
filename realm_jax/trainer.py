"""REALM pre-training as a task of the shared loop (train/loop.py): mesh, data, state,
weight import (HF folders, an ICT warm start), the index feed, the step, held-out evaluation.

The math lives in train_step.py (pure, jitted once); the loop only orchestrates.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp

from realm_jax import checkpoint, sharding, train_step, weights
from realm_jax.models import ModelConfig, doc_embedder_name
from realm_jax.refresh import IndexFeed
from realm_jax.train import loop

log = logging.getLogger("realm_jax.train")


def data_dir(config, workdir: str) -> str:
    return config.data.data_dir or os.path.join(os.path.abspath(workdir), "data")


def params_hook(config, reader: bool = True):
    """Weight import named in config.model: HF folders for the embedders and the reader, then
    an ICT checkpoint for both embedders (None when nothing to import). Resuming a run
    restores its own weights instead (the loop calls this only for a fresh run)."""
    m = config.model
    if not (m.init_embedder_from or (reader and m.init_reader_from) or m.init_embedders_from_ict):
        return None
    ecfg = ModelConfig.from_config(m, "embedder")
    rcfg = ModelConfig.from_config(m, "reader")

    def hook(params):
        params = dict(params)
        if m.init_embedder_from:
            loaded, fields = weights.embedder_params(m.init_embedder_from)
            weights.check_fields(ecfg, fields, m.init_embedder_from, "config.model.embedder")
            for name in {"query_embedder", doc_embedder_name(ecfg)}:
                params[name] = weights.merge_params(params[name], loaded, name)
            log.info("imported both embedders from %s", m.init_embedder_from)
        if reader and m.init_reader_from:
            loaded, fields = weights.reader_params(m.init_reader_from, with_span_head=False)
            weights.check_fields(rcfg, fields, m.init_reader_from, "config.model.reader")
            params["reader"] = weights.merge_params(params["reader"], loaded, "reader")
            log.info("imported the reader from %s", m.init_reader_from)
        if m.init_embedders_from_ict:
            ict = ict_embedder_params(m.init_embedders_from_ict, ecfg)
            for name in {"query_embedder", doc_embedder_name(ecfg)}:
                src = ict.get(name, ict["query_embedder"])
                params[name] = weights.merge_params(params[name], src, name)
        return params

    return hook


def check_prepared(config, ddir: str) -> None:
    """The prepared data must have the lengths the config trains with."""
    from realm_jax.data import prepare

    built = prepare.load_summary(ddir)["config"]
    bad = [
        f"data.{k} is {config.data[k]} but {ddir} was prepared with {built[k]}"
        for k in ("block_len", "query_len", "max_predictions")
        if built.get(k) != config.data[k]
    ]
    if bad:
        raise ValueError("; ".join(bad) + ": re-run `realm-jax prepare --overwrite`")


def ict_embedder_params(path: str, ecfg) -> dict:
    """{network name: host params} of both embedders from an ICT workdir's newest checkpoint
    (ICT trains the same Embedder modules under the same names; an ICT run with shared
    embedders gives its one embedder to both)."""
    from realm_jax.ict import task as ict_task

    if not os.path.isdir(checkpoint.checkpoint_dir(path)):
        raise FileNotFoundError(
            f"model.init_embedders_from_ict={path!r}: no checkpoints folder there (give the "
            "workdir of a `realm-jax ict` run)"
        )
    mgr = checkpoint.manager(path, with_data=False, read_only=True)
    if not mgr.all_steps():
        raise FileNotFoundError(f"model.init_embedders_from_ict={path!r}: no checkpoint yet")
    step = mgr.latest_step()
    names = ict_task.restore_embedders(mgr, step, ecfg)
    log.info("warm start: both embedders from ICT checkpoint %d in %s", step, path)
    return names


def train(config, workdir: str, stop_event: threading.Event | None = None) -> list[dict]:
    """Pre-train REALM; resumable. Returns the metrics logged by this run (one dict per log)."""
    from realm_jax.data import pipeline, prepare
    from realm_jax.pretrain.evaluation import RealmEvaluator

    os.makedirs(workdir, exist_ok=True)
    tc = config.train
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_batch(tc.batch_size, mesh)
    if tc.num_candidates < 2:
        raise ValueError("train.num_candidates must be >= 2 (the null document + 1 retrieved)")
    ddir = data_dir(config, workdir)
    check_prepared(config, ddir)
    tokens, _, titles = prepare.load_blocks(ddir)  # [N, Lb]
    log.info(
        "mesh %s over %d devices (%d processes); %d blocks",
        dict(mesh.shape),
        mesh.devices.size,
        jax.process_count(),
        tokens.shape[0],
    )
    mgr = checkpoint.manager(workdir, keep=tc.keep_checkpoints)
    hook = None if mgr.all_steps() else params_hook(config)  # a resume restores the weights
    model, optimizer, state, shardings = train_step.create_state(
        config, mesh, jax.random.key(tc.seed), hook
    )
    loader = pipeline.train_loader(
        config, ddir, global_batch_size=tc.batch_size, seed=config.data.seed
    )
    it = iter(loader)
    start, state = loop.init_or_resume(
        mgr, state, shardings, it, (pipeline.iterator_save_args, pipeline.iterator_restore_args)
    )
    feed = IndexFeed(config, workdir, mesh, model, tokens)
    feed.start(state.params, start)
    step_fn = train_step.compile_train_step(
        config, mesh, model, optimizer, shardings, feed.num_blocks
    )
    evaluator = None
    if tc.eval_every > 0:
        batches = pipeline.eval_batches(
            config, ddir, batch_size=tc.eval_batch_size, max_examples=tc.eval_examples
        )
        evaluator = RealmEvaluator(config, mesh, model, feed, batches, titles)

    def before_step(step: int, state) -> dict:
        if step > start and feed.due(step) and feed.maybe_refresh(state.params, step):
            return {"index_swap_seconds": feed.last_swap_seconds}
        return {}

    def step(state, batch):
        state, metrics = step_fn(state, batch, feed.emb, feed.tokens, jnp.int32(feed.step))
        return state, metrics

    task = loop.Task(
        name="realm",
        step=step,
        evaluate=evaluator,
        before_step=before_step,
        console_keys=CONSOLE_KEYS,
        eval_console_keys=EVAL_CONSOLE_KEYS,
        close=feed.close,
    )
    return loop.run(
        config, workdir, task, state, it, mgr, start, pipeline.iterator_save_args, stop_event
    )


CONSOLE_KEYS = (
    "loss",
    "accuracy",
    "retrieval_utility",
    "retrieval_entropy",
    "null_doc_prob",
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
)
