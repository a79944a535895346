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
from realm_jax.index.embedding import embed_block_tokens, embed_query_tokens
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


def state_parts(config):
    """(model, optimizer, init_params(rng) -> boxed params) of the two embedders."""
    ecfg = ModelConfig.from_config(config.model, "embedder")
    d = config.data
    check_fits("data.query_len", d.query_len, ecfg, "embedder", "query")
    check_fits("data.block_len", d.block_len, ecfg, "embedder", "doc")
    model = RetrieverModel(ecfg)
    q, b = dummy_input(d.query_len), dummy_input(d.block_len)
    return model, make_optimizer(config.train), lambda r: model.init(r, q, b)["params"]


def create_state(config, mesh, rng, params_hook=None):
    """(model, optimizer, state, shardings) of the two embedders, created sharded."""
    model, optimizer, init_params = state_parts(config)
    state, shardings = create_sharded(
        mesh, init_params, optimizer, rng, params_hook, fsdp=config.mesh.get("fsdp", False)
    )
    return model, optimizer, state, shardings


def compile_train_step(config, mesh, model, optimizer, state_shardings):
    """jax.jit of ict_step with explicit in/out shardings; the state is donated."""
    jitted = jax.jit(
        functools.partial(
            ict_step, model=model, optimizer=optimizer, mesh=mesh, seed=config.train.seed
        ),
        in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )
    return sharding.traced_in_mesh(jitted, mesh)
