"""Exact maximum inner product search over a row-sharded document index, on device.

Each device scores the queries against its own rows, keeps a local top-k, and the candidates
of all devices are gathered and merged (shard_map). The same pass fetches the retrieved
blocks' token ids from the row-sharded token table: each device contributes the rows it owns
and a psum assembles them. We keep tokens on device rather than fetching them on the host
between two jitted calls. Measured (benchmarks/token_fetch.py, docs/benchmarks.md): on 8 fake CPU
devices with a SQuAD-sized table (19,706 x 288) both paths cost the same (12.9 vs 12.1 ms per
batch of 64), as expected where host and device share memory; so the choice rests on what the
host path adds on
an accelerator pod: a device->host->device round trip inside every step, the step split into
two programs, and every host holding the whole token table. On device the table costs
int32 x block_len per row spread over all devices (13.35M x 288 blocks is 15 GB, 30 MB per
chip on a 512-chip pod).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

NEG_INF = -1e30


def _local_topk(q, emb, exclude, *, k, num_valid, axes):
    """q [B, D] (all queries), emb [n, D] (this device's rows), exclude [B]."""
    n_local = emb.shape[0]
    offset = jax.lax.axis_index(axes) * n_local
    ids = offset + jnp.arange(n_local, dtype=jnp.int32)  # [n]
    scores = jnp.einsum("bd,nd->bn", q.astype(jnp.float32), emb.astype(jnp.float32))
    bad = (ids[None, :] >= num_valid) | (ids[None, :] == exclude[:, None])
    scores = jnp.where(bad, NEG_INF, scores)
    vals, idx = jax.lax.top_k(scores, k)  # [B, k]
    return vals, idx + offset


def _gather_rows(table, ids, axes):
    """table [n, ...] local rows, ids [B, k] global -> [B, k, ...] (psum of owned rows)."""
    n_local = table.shape[0]
    offset = jax.lax.axis_index(axes) * n_local
    local = ids - offset
    own = (local >= 0) & (local < n_local)
    rows = table[jnp.clip(local, 0, n_local - 1)]
    rows = jnp.where(own.reshape(own.shape + (1,) * (rows.ndim - own.ndim)), rows, 0)
    return jax.lax.psum(rows, axes)


def search_and_fetch(mesh: Mesh, query, emb, tokens, exclude, *, k: int, num_valid: int):
    """Top-k blocks for each query, excluding `exclude` ids, plus their tokens.

    query [B, D]; emb [N, D] and tokens [N, L] row-sharded over all mesh axes; exclude [B]
    (-1 for none). Returns (scores [B, k], ids [B, k], block_tokens [B, k, L]), replicated.
    """
    axes = tuple(mesh.axis_names)
    n_local = emb.shape[0] // mesh.devices.size
    if k > num_valid:
        raise ValueError(f"top-{k} retrieval from an index of {num_valid} blocks")
    # Each of the global top k is within its own device's top min(k, rows per device).
    k_local = min(k, n_local)

    def body(q, e, t, ex):
        vals, ids = _local_topk(q, e, ex, k=k_local, num_valid=num_valid, axes=axes)
        all_vals = jax.lax.all_gather(vals, axes, axis=1, tiled=True)  # [B, ndev * k_local]
        all_ids = jax.lax.all_gather(ids, axes, axis=1, tiled=True)
        top_vals, pos = jax.lax.top_k(all_vals, k)
        top_ids = jnp.take_along_axis(all_ids, pos, axis=1)
        return top_vals, top_ids, _gather_rows(t, top_ids, axes)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(axes), P(axes), P()),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )
    return fn(query, emb, tokens, exclude)


def fetch_rows(mesh: Mesh, table, ids):
    """Rows `ids` [B, k] of a row-sharded table [N, ...] -> [B, k, ...], replicated: each
    device contributes the rows it owns (the token table, or the frozen embeddings when the
    ids come from elsewhere: a BM25 retriever, the retriever's own top-k)."""
    axes = tuple(mesh.axis_names)
    fn = jax.shard_map(
        lambda t, i: _gather_rows(t, i, axes),
        mesh=mesh,
        in_specs=(P(axes), P()),
        out_specs=P(),
        check_vma=False,
    )
    return fn(table, ids)


@functools.partial(jax.jit, static_argnames=("k",))
def brute_force(query, emb, exclude, k: int):
    """Reference top-k on one device (tests, small corpora)."""
    scores = query @ emb.T
    scores = jnp.where(jnp.arange(emb.shape[0])[None] == exclude[:, None], NEG_INF, scores)
    return jax.lax.top_k(scores, k)
