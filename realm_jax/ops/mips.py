"""Exact maximum inner product search over a row-sharded document index, on device.

Each device scores the queries against its own rows, keeps a local top-k, and the candidates
of all devices are gathered and merged (shard_map). A device scores its rows in chunks (a
running top-k, config mesh.mips_chunk), so it never holds [B, N / devices] scores at once.
The same pass can fetch the retrieved blocks' token ids from the row-sharded token table: each
device contributes the rows it owns and a psum assembles them. We keep tokens on device rather
than fetching them on the host between two jitted calls. Measured (benchmarks/token_fetch.py,
docs/benchmarks.md): on 8 fake CPU devices with a SQuAD-sized table (19,706 x 288) both paths
cost the same (12.9 vs 12.1 ms per batch of 64), as expected where host and device share
memory; so the choice rests on what the host path adds on an accelerator pod: a
device->host->device round trip inside every step, the step split into two programs, and every
host holding the whole token table. The table holds uint16 ids when the vocabulary fits
(index/embedding.py token_dtype): 13.35M x 288 blocks is 7.7 GB, 15 MB per chip on a 512-chip
pod; a fetch moves 2 bytes an id and returns int32 (the embedding lookup's ids). A caller that
needs only a per-block test of the tokens (an answer in the block?) runs it where the rows live
(owner_test): [B, k] flags cross the mesh instead of [B, k, Lb] ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

NEG_INF = -1e30  # the score of an invalid or excluded row (a real score is always above it)
# Rows each device scores at once (config mesh.mips_chunk): a device holds [B, chunk] float32
# scores, never [B, N / devices] (13.35M blocks, batch 512, 4 chips: 6.8 GB). 0 = the whole
# shard in one matmul. set_default_chunk() changes it for calls that pass no `chunk`.
DEFAULT_CHUNK = 65536
_default_chunk = DEFAULT_CHUNK


def set_default_chunk(chunk: int) -> None:
    """The chunk every later search without its own `chunk` uses (read when it is traced)."""
    global _default_chunk
    if chunk < 0:
        raise ValueError(f"mips chunk must be 0 (whole shard) or positive, got {chunk}")
    _default_chunk = int(chunk)


def _chunking(n: int, chunk: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks) for n local rows: chunks of at most `chunk` rows,
    as even as possible, so the shifted-back last one repeats fewer than `count` rows."""
    if chunk <= 0 or chunk >= n:
        return n, 1
    count = -(-n // chunk)
    return -(-n // count), count


def _select(scores, k: int, recall_target: float | None):
    """Top k of scores [B, n] along n: exact (lax.top_k, ties to the lower index) or
    lax.approx_max_k (TPU's fast path) when recall_target is set."""
    if recall_target is None:
        return jax.lax.top_k(scores, k)
    return jax.lax.approx_max_k(scores, k, recall_target=recall_target)


def _score(q, rows, ids, exclude, num_valid):
    """Scores [B, c] of q [B, D] against rows [c, D] with global ids [c]; invalid rows (id >=
    num_valid, e.g. the padding of the last shard) and each query's excluded id get NEG_INF."""
    # float32 rows: float32 scores as ever; bfloat16 rows (mesh.index_dtype): the query in
    # bfloat16 too (the MXU's native product), summed in float32 (no float32 copy of the rows)
    dtype = jnp.bfloat16 if rows.dtype == jnp.bfloat16 else jnp.float32
    scores = jnp.einsum(
        "bd,nd->bn", q.astype(dtype), rows.astype(dtype), preferred_element_type=jnp.float32
    )
    bad = (ids[None, :] >= num_valid) | (ids[None, :] == exclude[:, None])
    return jnp.where(bad, NEG_INF, scores)


def _local_topk(q, emb, exclude, *, k, num_valid, axes, chunk, recall_target=None):
    """Top k (scores [B, k], global ids [B, k]) of this device's rows emb [n, D] for all
    queries q [B, D] (exclude [B]), best first, ties to the lower id.

    A running top-k over chunks of c rows (a lax.scan): each step scores one chunk and merges
    its top k into the running k, so at most [B, c] scores exist at once (and, on XLA:CPU, a
    copy of the chunk's rows [c, D]). The last chunk is shifted back to end at row n (no padded
    copy of the shard); the rows it repeats score -inf, below NEG_INF, so they never displace a
    row. The ids equal one top-k over the whole shard: the running entries come from earlier
    chunks (lower ids) and win ties. (A score may differ from the whole-shard matmul's in its
    last bit, the matmul's shape changing its summation order: rows within that can swap.)"""
    n = emb.shape[0]
    offset = jax.lax.axis_index(axes) * n
    c, count = _chunking(n, chunk)
    if count == 1:  # the whole shard in one matmul: [B, n] scores
        ids = offset + jnp.arange(n, dtype=jnp.int32)  # [n]
        vals, idx = _select(_score(q, emb, ids, exclude, num_valid), k, recall_target)
        return vals, idx + offset
    kc = min(k, c)

    def step(carry, i):
        run_vals, run_ids = carry  # [B, k] each
        start = jnp.minimum(i * c, n - c)
        rows = jax.lax.dynamic_slice_in_dim(emb, start, c)  # [c, D]
        local = start + jnp.arange(c, dtype=jnp.int32)  # [c]
        scores = _score(q, rows, offset + local, exclude, num_valid)  # [B, c]
        scores = jnp.where(local[None, :] >= i * c, scores, -jnp.inf)  # seen rows out
        vals, idx = _select(scores, kc, recall_target)  # [B, kc]
        both = jnp.concatenate([run_vals, vals], axis=1)  # [B, k + kc], running first
        both_ids = jnp.concatenate([run_ids, offset + start + idx], axis=1)
        top, pos = jax.lax.top_k(both, k)
        return (top, jnp.take_along_axis(both_ids, pos, axis=1)), None

    b = q.shape[0]
    init = (jnp.full((b, k), -jnp.inf, jnp.float32), jnp.zeros((b, k), jnp.int32))
    (vals, ids), _ = jax.lax.scan(step, init, jnp.arange(count, dtype=jnp.int32))
    return vals, ids


def _owned(table, ids, axes):
    """The rows of ids [B, k] (global) that this device holds, from its rows table [n, ...]:
    (rows [B, k, ...], zero where another device owns the id; own [B, k] bool)."""
    n_local = table.shape[0]
    local = ids - jax.lax.axis_index(axes) * n_local
    own = (local >= 0) & (local < n_local)
    rows = table[jnp.clip(local, 0, n_local - 1)]
    rows = jnp.where(own.reshape(own.shape + (1,) * (rows.ndim - own.ndim)), rows, 0)
    return rows, own


def _psum_u16(rows, axes):
    """psum of uint16 rows [..., L] moving 2 bytes an id: pairs of ids travel as one uint32
    (exact: one device owns each row, the others add zeros), since a backend may widen a
    16-bit integer all-reduce to 32 bits (XLA:GPU's all-reduce promotion) -> [..., L]."""
    L = rows.shape[-1]
    if L % 2:
        rows = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, 1)])
    packed = jax.lax.bitcast_convert_type(rows.reshape(rows.shape[:-1] + (-1, 2)), jnp.uint32)
    summed = jax.lax.psum(packed, axes)  # [..., ceil(L / 2)] uint32
    out = jax.lax.bitcast_convert_type(summed, jnp.uint16)  # [..., ceil(L / 2), 2]
    return out.reshape(out.shape[:-2] + (-1,))[..., :L]


def _gather_rows(table, ids, axes):
    """table [n, ...] local rows, ids [B, k] global -> [B, k, ...] (psum of owned rows). A
    uint16 token table moves 2 bytes an id and comes back as int32 (the model's ids)."""
    rows, _ = _owned(table, ids, axes)
    if table.dtype == jnp.uint16 and rows.ndim > 2:
        return _psum_u16(rows, axes).astype(jnp.int32)
    return jax.lax.psum(rows, axes)


def _merge(vals, ids, k, axes):
    """The global top k [B, k] (scores, ids) of every device's local (vals, ids) [B, k_local]."""
    all_vals = jax.lax.all_gather(vals, axes, axis=1, tiled=True)  # [B, ndev * k_local]
    all_ids = jax.lax.all_gather(ids, axes, axis=1, tiled=True)
    top_vals, pos = jax.lax.top_k(all_vals, k)
    return top_vals, jnp.take_along_axis(all_ids, pos, axis=1)


def _local_search(mesh, emb, k, num_valid, chunk, recall_target):
    """The per-device top-k function of a search (q, e, ex) -> (vals, ids), its arguments
    checked."""
    axes = tuple(mesh.axis_names)
    n_local = emb.shape[0] // mesh.devices.size
    if k > num_valid:
        raise ValueError(f"top-{k} retrieval from an index of {num_valid} blocks")
    chunk = _default_chunk if chunk is None else chunk
    if chunk < 0:
        raise ValueError(f"mips chunk must be 0 (whole shard) or positive, got {chunk}")
    # Each of the global top k is within its own device's top min(k, rows per device).
    return functools.partial(
        _local_topk,
        k=min(k, n_local),
        num_valid=num_valid,
        axes=axes,
        chunk=chunk,
        recall_target=recall_target,
    )


def search_and_fetch(
    mesh: Mesh,
    query,
    emb,
    tokens,
    exclude,
    *,
    k: int,
    num_valid: int,
    chunk: int | None = None,
    recall_target: float | None = None,
):
    """Top-k blocks for each query, excluding `exclude` ids, plus their tokens.

    query [B, D]; emb [N, D] and tokens [N, L] row-sharded over all mesh axes; exclude [B]
    (-1 for none). Returns (scores [B, k], ids [B, k], block_tokens [B, k, L] int32),
    replicated; best first, equal scores in ascending id order. chunk: rows a device scores at
    once (None: DEFAULT_CHUNK or set_default_chunk's; 0: its whole shard). recall_target: each
    device's top-k by lax.approx_max_k at that recall instead of exactly (the merge of the
    devices' candidates stays exact).
    """
    axes = tuple(mesh.axis_names)
    local = _local_search(mesh, emb, k, num_valid, chunk, recall_target)

    def body(q, e, t, ex):
        top_vals, top_ids = _merge(*local(q, e, ex), k, axes)
        return top_vals, top_ids, _gather_rows(t, top_ids, axes)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(axes), P(axes), P()),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )
    return fn(query, emb, tokens, exclude)


def search(
    mesh: Mesh,
    query,
    emb,
    exclude,
    *,
    k: int,
    num_valid: int,
    chunk: int | None = None,
    recall_target: float | None = None,
):
    """search_and_fetch without the tokens: (scores [B, k], ids [B, k]), replicated. For a
    caller that reads only some of the k blocks (QA reads its top reader_beam_size of a
    retriever beam of thousands: fetch_rows on those ids)."""
    axes = tuple(mesh.axis_names)
    local = _local_search(mesh, emb, k, num_valid, chunk, recall_target)
    fn = jax.shard_map(
        lambda q, e, ex: _merge(*local(q, e, ex), k, axes),
        mesh=mesh,
        in_specs=(P(), P(axes), P()),
        out_specs=(P(), P()),
        check_vma=False,
    )
    return fn(query, emb, exclude)


OWNER_TEST_CHUNK = 256  # ids of a [B, k] beam owner_test tests at once


def owner_test(mesh: Mesh, table, ids, test, *args):
    """test(rows [B, k, ...], *args) -> [B, k] bool, evaluated for each id [B, k] on the
    device that owns its row of the row-sharded table [N, ...]; args (e.g. answers [B, ...])
    replicated. Returns [B, k] bool, replicated: a [B, k] uint8 psum crosses the mesh instead
    of the [B, k, ...] rows (QA's answer test over a 5000-block beam: B x 5000 bytes, not
    B x 5000 x Lb ids). Each device still tests a [B, k, ...] array (zeros where it owns no
    row), as every device did with the rows fetched."""
    axes = tuple(mesh.axis_names)
    B, k = ids.shape
    c = min(k, OWNER_TEST_CHUNK)
    pad = -k % c

    def part(t, i, *a):  # i [B, c]: one slice of the beam at a time
        rows, own = _owned(t, i, axes)
        return own & test(rows.astype(jnp.int32) if t.dtype == jnp.uint16 else rows, *a)

    def body(t, i, *a):
        # The beam in slices of c ids: each device's rows and the test's intermediates are
        # [B, c, ...], not [B, k, ...] (QA's answer test at base, B 64 x k 5000: [B, k, A, Lb]
        # booleans, 737 MB a device, raised the QA step's temporaries from 2.6 to 8.8 GiB
        # on v3-64 until it was sliced).
        i = jnp.pad(i, ((0, 0), (0, pad)), constant_values=-1)
        slices = jnp.moveaxis(i.reshape(B, -1, c), 1, 0)  # [k / c, B, c]
        hit = jax.lax.map(lambda ic: part(t, ic, *a), slices)  # [k / c, B, c]
        hit = jnp.moveaxis(hit, 0, 1).reshape(B, -1)[:, :k]
        return jax.lax.psum(hit.astype(jnp.uint8), axes) > 0

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axes), P()) + (P(),) * len(args),
        out_specs=P(),
        check_vma=False,
    )
    return fn(table, ids, *args)


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
