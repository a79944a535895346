"""The ICT step. Loss (ORQA ict_model.py): logits = q_emb @ b_emb.T over the *global* batch,
softmax cross-entropy with each query's own block as the label. The block embeddings are
gathered across the data axis (an explicit replication constraint), so the negatives grow
with the pod."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from realm_jax import sharding
from realm_jax.index.corpus import embed_block_tokens, embed_query_tokens
from realm_jax.model.bert import ModelConfig
from realm_jax.model.inputs import check_fits, dummy_input
from realm_jax.model.realm import RetrieverModel
from realm_jax.train.optimizer import make_optimizer
from realm_jax.train.state import create_sharded, guarded_update


def ict_loss(params, batch, *, model: RetrieverModel, mesh, rng=None):
    """ICT loss and metrics for a global batch: query_ids [B, Lq], block_ids [B, Lb]."""
    q_ids, b_ids = batch["query_ids"], batch["block_ids"]
    q = embed_query_tokens(model, params, q_ids, rng)  # [B, D]
    b = embed_block_tokens(model, params, b_ids, rng)  # [B, D]
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
    return guarded_update(state, grads, metrics, optimizer), metrics


def create_state(config, mesh, rng, params_hook=None):
    """(model, optimizer, state, shardings) of the two embedders, created sharded."""
    ecfg = ModelConfig.from_config(config.model, "embedder")
    d = config.data
    check_fits("data.query_len", d.query_len, ecfg, "embedder")
    check_fits("data.block_len", d.block_len, ecfg, "embedder")
    model = RetrieverModel(ecfg)
    optimizer = make_optimizer(config.train)

    state, shardings = create_sharded(
        mesh,
        lambda r: model.init(r, dummy_input(d.query_len), dummy_input(d.block_len))["params"],
        optimizer,
        rng,
        params_hook,
    )
    return model, optimizer, state, shardings
