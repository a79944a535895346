"""The train state (step, params, optimizer state) and its sharded creation, for every task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh

from realm_jax import sharding


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def create_sharded(
    mesh: Mesh,
    init_params: Callable[[jax.Array], Any],
    optimizer,
    rng,
    params_hook: Callable[[Any], Any] | None = None,
):
    """The state created sharded: eval_shape -> logical specs -> jit(init, out_shardings).

    init_params(rng) returns the (logically boxed) params; params_hook(params) may replace
    them on the host (weight import) before the optimizer state is built from them.
    Returns (state, state_shardings).
    """

    def init(rng):
        params = init_params(rng)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
        )

    shardings = sharding.logical_shardings(mesh, jax.eval_shape(init, rng))
    state = nn.meta.unbox(jax.jit(init, out_shardings=shardings)(rng))
    if params_hook is not None:
        params = jax.device_put(params_hook(jax.device_get(state.params)), shardings.params)
        opt = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
        state = state.replace(params=params, opt_state=opt)
    return state, shardings
