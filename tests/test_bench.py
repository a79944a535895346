"""The benchmark's matmul census (bench/train_throughput.step_matmuls) against hand counts."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from train_throughput import matmuls_alone, step_matmuls  # noqa: E402


def test_step_matmuls_counts_scans_nested_jits_and_batched_dots():
    w = jnp.ones((4, 4))
    q = jnp.ones((2, 3, 5, 4))

    @jax.jit
    def inner(h):
        return h @ w

    def f(h, q):
        h, _ = jax.lax.scan(lambda c, _: (inner(c), None), h, None, length=5)
        return h.sum() + jnp.einsum("bhqd,bhkd->bhqk", q, q).sum()

    counts = step_matmuls(jax.jit(f), jnp.ones((6, 4)), q)
    plain = (((1,), (0,)), ((), ()))
    batched = (((3,), (3,)), ((0, 1), (0, 1)))
    assert counts == {
        ((6, 4), (4, 4), "float32", plain): 5,
        ((2, 3, 5, 4), (2, 3, 5, 4), "float32", batched): 1,
    }
    alone = matmuls_alone(counts)
    assert alone["plain"][1] == 5 * 2 * 6 * 4 * 4  # FLOPs: 2 * M * N * K per dot
    assert alone["batched"][1] == 2 * (2 * 3 * 5 * 5) * 4
    assert alone["plain"][0] > 0 and alone["batched"][0] > 0
