"""The REALM pre-training loop: mesh, data, state, index, step, checkpoints, metrics.

The loop only orchestrates; the math lives in train_step.py (pure, jitted once).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from realm_jax import checkpoint, sharding, train_step, weights
from realm_jax.metrics import MetricWriter, Progress, line
from realm_jax.models import ModelConfig, doc_embedder_name
from realm_jax.refresh import IndexFeed

log = logging.getLogger("realm_jax.train")


def data_dir(config, workdir: str) -> str:
    return config.data.data_dir or os.path.join(os.path.abspath(workdir), "data")


def params_hook(config):
    """Weight import from HF folders named in config.model (None when nothing to import)."""
    m = config.model
    if not (m.init_embedder_from or m.init_reader_from):
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
        if m.init_reader_from:
            loaded, fields = weights.reader_params(m.init_reader_from, with_span_head=False)
            weights.check_fields(rcfg, fields, m.init_reader_from, "config.model.reader")
            params["reader"] = weights.merge_params(params["reader"], loaded, "reader")
            log.info("imported the reader from %s", m.init_reader_from)
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


class _Stop:
    """Set by SIGTERM/SIGINT (preemption): the loop saves a checkpoint and exits."""

    def __init__(self, external: threading.Event | None = None):
        self.event = external or threading.Event()
        self.signum = None

    def install(self) -> None:
        self.previous = {}
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


def train(config, workdir: str, stop_event: threading.Event | None = None) -> list[dict]:
    """Pre-train REALM; resumable. Returns the metrics logged by this run (one dict per log)."""
    from realm_jax.data import pipeline, prepare

    os.makedirs(workdir, exist_ok=True)
    tc = config.train
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_batch(tc.batch_size, mesh)
    if tc.num_candidates < 2:
        raise ValueError("train.num_candidates must be >= 2 (the null document + 1 retrieved)")
    ddir = data_dir(config, workdir)
    check_prepared(config, ddir)
    tokens = prepare.load_blocks(ddir)[0]  # [N, Lb]
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
    restored = checkpoint.restore_latest(
        mgr, checkpoint.abstract_like(state, shardings), lambda: pipeline.iterator_restore_args(it)
    )
    if restored is not None:
        start, state = restored
        log.info("resumed from checkpoint %d", start)
    else:
        start = 0
        checkpoint.save(mgr, 0, state, pipeline.iterator_save_args(it))  # the refresher's step 0
        mgr.wait_until_finished()

    feed = IndexFeed(config, workdir, mesh, model, tokens)
    feed.start(state.params, start)
    step_fn = train_step.compile_train_step(
        config, mesh, model, optimizer, shardings, feed.num_blocks
    )
    return _loop(config, workdir, mesh, state, step_fn, it, mgr, feed, start, _Stop(stop_event))


def _loop(config, workdir, mesh, state, step_fn, it, mgr, feed, start, stop) -> list[dict]:
    from realm_jax.data import pipeline

    tc = config.train
    writer = MetricWriter(os.path.join(workdir, "tb"))
    progress = Progress(tc.steps, start)
    stop.install()
    history: list[dict] = []
    step = start
    swap_seconds = None
    try:
        while step < tc.steps:
            if step > start and step % config.refresh.every == 0:
                if feed.maybe_refresh(state.params, step):
                    swap_seconds = feed.last_swap_seconds
            batch = sharding.global_batch(next(it), mesh)
            state, metrics = step_fn(state, batch, feed.emb, feed.tokens, jnp.int32(feed.step))
            step += 1
            if step % tc.log_every == 0 or step == tc.steps:
                last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                last["index_step"], last["step"] = feed.step, step
                if swap_seconds is not None:
                    last["index_swap_seconds"], swap_seconds = swap_seconds, None
                prog = progress.update(step)
                writer.scalars(step, {**last, **prog})
                history.append(last)
                if jax.process_index() == 0:
                    print(line(step, tc.steps, last, prog), flush=True)
            if step % tc.checkpoint_every == 0 or step == tc.steps:
                checkpoint.save(mgr, step, state, pipeline.iterator_save_args(it))
            if tc.preemption_save and stop.any_process():
                log.warning(
                    "stop requested (signal %s): saving checkpoint %d and exiting",
                    stop.signum,
                    step,
                )
                checkpoint.save(mgr, step, state, pipeline.iterator_save_args(it), force=True)
                break
    finally:
        mgr.wait_until_finished()
        writer.close()
        stop.uninstall()
    return history
