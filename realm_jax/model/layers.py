"""Building blocks with logical axis names: LayerNorm (closed-form backward), hashed dropout, dense,
activations. The axis names map to the mesh in `sharding.py`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

Array = jax.Array


def activation(name: str):
    """BERT activations: 'gelu' is the exact erf form, 'gelu_new' the tanh approximation."""
    table = {
        "gelu": functools.partial(jax.nn.gelu, approximate=False),
        "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
        "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
        "relu": jax.nn.relu,
    }
    if name not in table:
        raise ValueError(f"unknown hidden_act {name!r}; choose one of {sorted(table)}")
    return table[name]


def _init(axes, std=0.02):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def _zeros(axes):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
    like_x = jnp.zeros((0,), x.dtype)  # dx must come back in x's dtype (bfloat16 compute)
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    centred = x - mean
    rstd = jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + eps)
    xhat = centred * rstd
    return xhat * scale + bias, (xhat, rstd, scale, like_x)


def _layer_norm_bwd(eps, residuals, dy):
    """The closed-form LayerNorm gradient: one pass for the two row means, one for dx."""
    xhat, rstd, scale, like_x = residuals
    dy = dy.astype(jnp.float32)
    dxhat = dy * scale
    dx = rstd * (
        dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    )
    lead = tuple(range(dy.ndim - 1))
    return dx.astype(like_x.dtype), (dy * xhat).sum(lead), dy.sum(lead)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis in float32 (flax's parameter names: scale, bias) with a
    closed-form backward pass: XLA:CPU spent more on differentiating flax's LayerNorm
    statistics than on the forward (profiled); this is tested against nn.LayerNorm."""

    epsilon: float
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        n = x.shape[-1]
        scale = self.param("scale", _ones((self.axis_name,)), (n,))
        bias = self.param("bias", _zeros((self.axis_name,)), (n,))
        return _layer_norm(x, jnp.asarray(scale), jnp.asarray(bias), self.epsilon)


def layer_norm(cfg, name: str, eps: float | None = None, axis_name="embed"):
    eps = cfg.layer_norm_eps if eps is None else eps
    return LayerNorm(epsilon=eps, axis_name=axis_name, name=name)


def dense(features, axes, cfg, name: str):
    return nn.Dense(
        features,
        dtype=cfg.compute_dtype,
        kernel_init=_init(axes),
        bias_init=_zeros(axes[-1:]),
        name=name,
    )


def _mix32(x: Array) -> Array:
    """A 32-bit integer finaliser (lowbias32: xor-shift / multiply, full avalanche)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(key: Array, shape: tuple[int, ...], rate: float) -> Array:
    """Bernoulli(1 - rate) keep mask: a counter-based hash of each element's index.

    Two threefry words per call seed a hash of (row, column) indices, so the mask is a pure
    function of the key and the element's global position: the same on any mesh, and it fuses
    into the consumer. Drawing a threefry word per element instead (flax's nn.Dropout) was over
    15x slower on XLA:CPU (benchmarks/train_throughput.py) and the largest cost of a dropout-on
    train step at the 4x256 size (profiled). Rows are the flattened leading axes (under 2^32
    at any configured size).
    """
    k = jax.random.bits(key, (2,), jnp.uint32)
    row = jnp.zeros(shape, jnp.uint32)
    for axis in range(len(shape) - 1):
        row = row * jnp.uint32(shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    col = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    h = _mix32(_mix32(row ^ k[0]) ^ (col * jnp.uint32(0x9E3779B9) + k[1]))
    return h >= jnp.uint32(min(int(round(rate * 2**32)), 2**32 - 1))


class Dropout(nn.Module):
    """Inverted dropout with `dropout_keep` masks; keys from the 'dropout' rng collection."""

    rate: float

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        if deterministic or self.rate <= 0.0:
            return x
        if self.rate >= 1.0:
            return jnp.zeros_like(x)
        keep = dropout_keep(self.make_rng("dropout"), x.shape, self.rate)
        return jnp.where(keep, x * (1.0 / (1.0 - self.rate)), 0).astype(x.dtype)
