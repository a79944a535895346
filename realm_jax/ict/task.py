"""ICT as a task of the shared loop: state, step, held-out recall, the `ict` command.

Loss (ORQA ict_model.py): logits = q_emb @ b_emb.T over the *global* batch, softmax
cross-entropy with each query's own block as the label. The block embeddings are gathered
across the data axis (an explicit replication constraint), so the negatives grow with the pod.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from realm_jax import checkpoint, sharding, train_step
from realm_jax.models import ModelConfig, RetrieverModel
from realm_jax.train import loop

log = logging.getLogger("realm_jax.ict")


def ict_loss(params, batch, *, model: RetrieverModel, mesh, rng=None):
    """ICT loss and metrics for a global batch: query_ids [B, Lq], block_ids [B, Lb]."""
    q_ids, b_ids = batch["query_ids"], batch["block_ids"]
    drop = train_step.dropout_kwargs
    q = model.apply(
        {"params": params},
        q_ids,
        jnp.zeros_like(q_ids),
        (q_ids != 0).astype(jnp.int32),
        method="embed_query",
        **drop(rng, 0),
    )  # [B, D]
    b = train_step.embed_block_tokens(model, params, b_ids, rng)  # [B, D]
    b = jax.lax.with_sharding_constraint(b, sharding.replicated(mesh))  # all blocks everywhere
    logits = jnp.einsum("qd,bd->qb", q, b)  # [B, B]: every other block is a negative
    labels = jnp.arange(logits.shape[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, -1) == labels).mean()
    return loss, {"loss": loss, "accuracy": accuracy}


def ict_step(state, batch, *, model, optimizer, mesh, seed: int = 0):
    rng = jax.random.fold_in(jax.random.key(seed), state.step) if model.uses_dropout else None
    fn = functools.partial(ict_loss, model=model, mesh=mesh, rng=rng)
    (_, metrics), grads = jax.value_and_grad(fn, has_aux=True)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics["grad_norm"] = optax.tree.norm(grads)
    new = state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state
    )
    return new, metrics


def create_state(config, mesh, rng, params_hook=None):
    """(model, optimizer, state, shardings) of the two embedders, created sharded."""
    ecfg = ModelConfig.from_config(config.model, "embedder")
    d = config.data
    for name, length in (("data.query_len", d.query_len), ("data.block_len", d.block_len)):
        if length > ecfg.max_position_embeddings:
            raise ValueError(
                f"{name} = {length} exceeds model.embedder.max_position_embeddings = "
                f"{ecfg.max_position_embeddings}"
            )
    model = RetrieverModel(ecfg)
    optimizer = train_step.make_optimizer(config.train)

    def t(length):
        ids = jnp.ones((1, length), jnp.int32)
        return ids, jnp.zeros_like(ids), ids

    def init(rng):
        params = model.init(rng, t(d.query_len), t(d.block_len))["params"]
        return train_step.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
        )

    shardings = sharding.logical_shardings(mesh, jax.eval_shape(init, rng))
    state = nn.meta.unbox(jax.jit(init, out_shardings=shardings)(rng))
    if params_hook is not None:
        params = jax.device_put(params_hook(jax.device_get(state.params)), shardings.params)
        opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
        state = state.replace(params=params, opt_state=opt)
    return model, optimizer, state, shardings


def restore_embedders(mgr, step: int, ecfg: ModelConfig) -> dict:
    """{name: host params} of the embedders in checkpoint `step` (a REALM warm start)."""
    import ml_collections

    one = ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (1, 1)})
    mesh = sharding.make_mesh(one, devices=jax.devices()[:1])
    model = RetrieverModel(ecfg)

    def t(length):
        return (jnp.ones((1, length), jnp.int32),) * 3

    boxed = jax.eval_shape(lambda r: model.init(r, t(8), t(8))["params"], jax.random.key(0))
    shard = sharding.logical_shardings(mesh, boxed)
    out = {}
    for name in nn.meta.unbox(boxed):
        target = checkpoint.abstract_like(nn.meta.unbox(boxed)[name], shard[name])
        # position tables may differ in length: shapes come from the checkpoint's metadata
        out[name] = jax.device_get(checkpoint.restore_params_subtree(mgr, step, name, target))
    return out


class IctEvaluator:
    """Recall@k of each held-out sentence's own block over the whole corpus (exact search),
    with every held-out sentence cut out of its own block (ict.data.cut_out), next to BM25's
    recall on the same sentences and the same cut corpus (computed once)."""

    def __init__(self, config, mesh, model, data_dir: str, tokens: np.ndarray):
        from realm_jax.data import prepare
        from realm_jax.ict import data as ict_data

        tc = config.train
        self.ks = tuple(int(k) for k in config.ict.recall_ks)
        self.q, self.own, sentences = ict_data.eval_queries(
            data_dir, config.data.query_len, tc.eval_examples
        )
        keep = self.own >= 0
        self.q, self.own = self.q[keep], self.own[keep]
        sentences = [t for t, k in zip(sentences, keep, strict=True) if k]
        src = prepare.blocks_source(data_dir)
        texts = [
            f"{r['title'].decode()}\n{r['text'].decode()}"
            for r in src.__getitems__(range(len(src)))
        ]
        tokens, texts, cut = ict_data.cut_out(tokens, texts, self.own, self.q, sentences)
        log.info(
            "ICT eval: %d held-out sentences, %d cut out of their own blocks", len(self.q), cut
        )
        self.num_blocks = tokens.shape[0]
        _, tok = train_step.pad_index(None, tokens, mesh)
        self.tokens = sharding.put_rows(tok, mesh)
        self.embed = train_step.embed_blocks_fn(model, mesh, config.refresh.embed_batch_size)
        self.embed_q = jax.jit(
            lambda p, q: model.apply(
                {"params": p},
                q,
                jnp.zeros_like(q),
                (q != 0).astype(jnp.int32),
                method="embed_query",
            )
        )
        self.baseline = self._bm25(texts, sentences) if config.ict.bm25_baseline else {}

    def _bm25(self, texts: list[str], sentences: list[str]) -> dict[str, float]:
        from realm_jax.qa.bm25 import BM25Retriever, recall_at_k

        ids, _ = BM25Retriever(texts).search(sentences, max(self.ks))
        out = recall_at_k(ids, self.own, self.ks)
        log.info("ICT eval: BM25 on the same %d held-out sentences: %s", len(sentences), out)
        return {f"bm25_{k}": v for k, v in out.items()}

    def __call__(self, state, step: int) -> dict[str, float]:
        from realm_jax.qa.bm25 import recall_at_k

        emb = np.asarray(jax.device_get(self.embed(state.params, self.tokens)), np.float32)
        emb = emb[: self.num_blocks]
        q = np.concatenate(
            [
                np.asarray(self.embed_q(state.params, self.q[i : i + 256]))
                for i in range(0, len(self.q), 256)
            ]
        )
        scores = q @ emb.T  # [Q, N]
        k = max(self.ks)
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(scores, top, 1).argsort(1)[:, ::-1]
        top = np.take_along_axis(top, order, 1)
        out = recall_at_k(top, self.own, self.ks)
        out.update(self.baseline)
        out["examples"] = float(len(self.q))
        return out


def train(config, workdir: str, stop_event: threading.Event | None = None) -> list[dict]:
    """ICT pre-training of the embedders; resumable. Returns the logged metrics."""
    from realm_jax import trainer
    from realm_jax.data import pipeline, prepare
    from realm_jax.ict import data as ict_data

    os.makedirs(workdir, exist_ok=True)
    tc = config.train
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_batch(tc.batch_size, mesh)
    ddir = trainer.data_dir(config, workdir)
    trainer.check_prepared(config, ddir)
    tokens, doc_ids, titles = prepare.load_blocks(ddir)
    train_ids = ict_data.train_block_ids(config.data, titles, doc_ids)
    log.info(
        "ICT: %d training blocks of %d; mesh %s", len(train_ids), len(titles), dict(mesh.shape)
    )
    mgr = checkpoint.manager(workdir, keep=tc.keep_checkpoints)
    hook = None if mgr.all_steps() else trainer.params_hook(config, reader=False)
    model, optimizer, state, shardings = create_state(config, mesh, jax.random.key(tc.seed), hook)
    it = iter(ict_data.train_loader(config, ddir, train_ids))
    start, state = loop.init_or_resume(
        mgr, state, shardings, it, (pipeline.iterator_save_args, pipeline.iterator_restore_args)
    )
    step_fn = jax.jit(
        functools.partial(ict_step, model=model, optimizer=optimizer, mesh=mesh, seed=tc.seed),
        in_shardings=(shardings, sharding.batch_sharding(mesh)),
        out_shardings=(shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )
    evaluator = IctEvaluator(config, mesh, model, ddir, tokens) if tc.eval_every > 0 else None
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
