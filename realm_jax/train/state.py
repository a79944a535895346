"""The train state (step, params, optimizer state) and its sharded creation, for every task."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh

from realm_jax import sharding


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any
    nonfinite: jax.Array  # steps in a row whose loss or gradient norm was not finite


def guarded_update(state: TrainState, grads, metrics: dict, optimizer) -> TrainState:
    """Apply the optimizer unless the loss or the gradient norm is not finite, decided on
    device (no host sync): a skipped step leaves params and optimizer state as they were and
    counts in `nonfinite`; the loop stops the run past train.max_nonfinite in a row. The
    step counter advances either way, as the data iterator does. Adds grad_norm and
    nonfinite to metrics.

    Not optax.apply_if_finite (optax 0.2), on purpose: it checks the gradients only (a NaN
    loss over finite gradients passes), and past max_consecutive_errors in a row it gives up
    and applies the non-finite update, where a run here stops with its last good checkpoint
    (train.max_nonfinite); its counts live inside the optimizer state, so adding or removing
    it changes the checkpoints' tree. The cost is the same: a global norm and a select, on
    device."""
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    metrics["grad_norm"] = grad_norm
    nonfinite = jnp.where(ok, 0, state.nonfinite + 1)
    metrics["nonfinite"] = nonfinite
    return TrainState(
        step=state.step + 1,
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        nonfinite=nonfinite,
    )


def _state_init(init_params: Callable[[jax.Array], Any], optimizer):
    def init(rng):
        params = init_params(rng)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            nonfinite=jnp.zeros((), jnp.int32),
        )

    return init


def abstract_sharded(
    mesh: Mesh, init_params: Callable[[jax.Array], Any], optimizer, fsdp: bool = False
):
    """(the state as ShapeDtypeStructs carrying their shardings, state_shardings), computed
    without allocating anything: what `plan` compiles against."""
    boxed = jax.eval_shape(_state_init(init_params, optimizer), jax.random.key(0))
    shardings = sharding.logical_shardings(mesh, boxed, fsdp)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed),
        shardings,
    )
    return abstract, shardings


def create_sharded(
    mesh: Mesh,
    init_params: Callable[[jax.Array], Any],
    optimizer,
    rng,
    params_hook: Callable[[Any], Any] | None = None,
    fsdp: bool = False,
):
    """The state created sharded: eval_shape -> logical specs -> jit(init, out_shardings).

    init_params(rng) returns the (logically boxed) params; params_hook(params) may replace
    them on the host (weight import) before the optimizer state is built from them. fsdp:
    parameters and optimizer state sharded over 'data' too (config mesh.fsdp).
    Returns (state, state_shardings).
    """
    init = _state_init(init_params, optimizer)
    shardings = sharding.logical_shardings(mesh, jax.eval_shape(init, rng), fsdp)
    state = nn.meta.unbox(jax.jit(init, out_shardings=shardings)(rng))
    if params_hook is not None:
        # on several processes each runs the hook on the same (gathered) host values, and
        # device_put keeps each process's own shards of them
        params = jax.device_put(params_hook(sharding.to_host(state.params)), shardings.params)
        opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
        state = state.replace(params=params, opt_state=opt)
    return state, shardings
