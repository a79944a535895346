"""ops/mips.py's chunked local search (issue 58): the running top-k over row chunks returns the
exact top-k of a numpy brute force, the whole-shard ids bit for bit, and its compiled program
holds [B, chunk] scores instead of [B, N / devices]; approx_max_k is an option."""

import functools

import jax
import ml_collections
import numpy as np
import pytest

from realm_jax import sharding
from realm_jax.ops import mips


@pytest.fixture(scope="module")
def mesh():
    cfg = ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (-1, 1)})
    return sharding.make_mesh(cfg)  # the 4 fake devices of tests/conftest.py


def _index(mesh, n, d=16, lb=3, seed=0):
    """Random emb [N', D] and tokens [N', lb] (row i holds i), padded to the mesh and put."""
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(n, d)).astype(np.float32)
    tokens = np.repeat(np.arange(n, dtype=np.int32)[:, None], lb, axis=1)
    put = lambda a: sharding.put_rows(sharding.pad_rows(a, mesh), mesh)  # noqa: E731
    return emb, put(emb), put(tokens)


def _numpy_topk(q, emb, exclude, k):
    """Brute force: scores [B, N], the excluded id out, best first and ties to the lower id."""
    scores = q.astype(np.float64) @ emb.T.astype(np.float64)
    scores[np.arange(len(q)), np.maximum(exclude, 0)] = np.where(
        exclude >= 0, -np.inf, scores[np.arange(len(q)), np.maximum(exclude, 0)]
    )
    ids = np.lexsort((np.broadcast_to(np.arange(emb.shape[0]), scores.shape), -scores))[:, :k]
    return np.take_along_axis(scores, ids, 1), ids


def _search(mesh, q, e, t, ex, **kw):
    fn = jax.jit(functools.partial(mips.search_and_fetch, mesh, **kw))
    return [np.asarray(x) for x in fn(q, e, t, ex)]


@pytest.mark.parametrize("chunk", [7, 64, 0])
def test_chunked_search_equals_numpy_brute_force(mesh, chunk):
    """N = 997 (not a multiple of 4 devices: the last shard's padding is invalid), 250 rows a
    device, chunks of 7 (36 chunks, the last shifted back) or 64 (4 chunks of 63)."""
    n, k, b = 997, 9, 12
    emb, e, t = _index(mesh, n)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(b, emb.shape[1])).astype(np.float32)
    exclude = rng.integers(-1, n, b).astype(np.int32)
    want_s, want_i = _numpy_topk(q, emb, exclude, k)
    scores, ids, toks = _search(mesh, q, e, t, exclude, k=k, num_valid=n, chunk=chunk)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(toks[..., 0], ids)  # each row's tokens came with it


def test_invalid_rows_and_ties_match_the_whole_shard_search(mesh):
    """Rows past num_valid are never returned; duplicated rows (equal scores) come in ascending
    id order, as lax.top_k over the whole shard gives them; k above the rows per device."""
    n, num_valid, k = 40, 33, 12  # 10 rows a device, the last device's 3 valid only
    emb, _, _ = _index(mesh, n, d=4)
    emb[20:30] = emb[3]  # ties across chunks and devices
    emb[num_valid:] = 100.0  # would win if invalid rows counted
    e = sharding.put_rows(emb, mesh)
    t = sharding.put_rows(np.arange(n, dtype=np.int32)[:, None], mesh)
    q = np.tile(emb[3], (3, 1))
    ex = np.array([-1, 3, 25], np.int32)
    base = _search(mesh, q, e, t, ex, k=k, num_valid=num_valid, chunk=0)
    for chunk in (1, 3, 4):
        got = _search(mesh, q, e, t, ex, k=k, num_valid=num_valid, chunk=chunk)
        np.testing.assert_array_equal(got[1], base[1])
        # the matmul's shape may change its summation order: scores agree to an ulp or so
        np.testing.assert_allclose(got[0], base[0], rtol=1e-6)
    _, want = _numpy_topk(q, emb[:num_valid], ex, k)
    np.testing.assert_array_equal(base[1], want)
    assert (base[1] < num_valid).all()


def test_default_chunk_is_settable_and_validated(mesh):
    emb, e, t = _index(mesh, 64)
    q, ex = emb[:2], np.full((2,), -1, np.int32)
    want = _search(mesh, q, e, t, ex, k=3, num_valid=64, chunk=0)[1]
    try:
        mips.set_default_chunk(5)
        np.testing.assert_array_equal(_search(mesh, q, e, t, ex, k=3, num_valid=64)[1], want)
    finally:
        mips.set_default_chunk(mips.DEFAULT_CHUNK)
    with pytest.raises(ValueError, match="chunk"):
        mips.set_default_chunk(-1)
    with pytest.raises(ValueError, match="chunk"):
        mips.search_and_fetch(mesh, q, e, t, ex, k=3, num_valid=64, chunk=-2)


def test_approx_max_k_option_finds_the_top_k(mesh):
    """recall_target swaps each device's top-k for lax.approx_max_k (exact on CPU; its recall
    where it approximates is benchmarks/mips_topk.py's)."""
    n, k = 500, 5
    emb, e, t = _index(mesh, n)
    q, ex = emb[:8] + 0.1, np.full((8,), -1, np.int32)
    _, want = _numpy_topk(q, emb, ex, k)
    for chunk in (0, 32):
        kw = dict(k=k, num_valid=n, chunk=chunk, recall_target=0.95)
        ids = _search(mesh, q, e, t, ex, **kw)[1]
        recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, want)])
        assert recall >= 0.95


def _temp_bytes(mesh, b, n, d, chunk):
    """The compiled search's temporary buffer bytes (per device) for B x N scores."""
    rows = jax.ShapeDtypeStruct((n, d), np.float32, sharding=sharding.rows_sharding(mesh))
    toks = jax.ShapeDtypeStruct((n, 1), np.int32, sharding=sharding.rows_sharding(mesh))
    rep = sharding.replicated(mesh)
    q = jax.ShapeDtypeStruct((b, d), np.float32, sharding=rep)
    ex = jax.ShapeDtypeStruct((b,), np.int32, sharding=rep)
    fn = functools.partial(mips.search_and_fetch, mesh, k=8, num_valid=n, chunk=chunk)
    return jax.jit(fn).lower(q, rows, toks, ex).compile().memory_analysis().temp_size_in_bytes


def test_chunked_search_never_holds_the_shard_scores(mesh):
    """The issue's guard: B = 64, N = 4 x 8192, D = 128, chunk 1024; a device's [B, N / 4]
    float32 scores are 2 MiB. The whole-shard program holds them; the chunked one holds one
    chunk's scores [B, c] and rows [c, D] (XLA:CPU copies the slice), 0.75 MiB."""
    b, n, d, c = 64, 4 * 8192, 128, 1024
    shard_scores = b * n // mesh.devices.size * 4
    chunked = _temp_bytes(mesh, b, n, d, c)
    whole = _temp_bytes(mesh, b, n, d, 0)
    assert whole > shard_scores, (whole, shard_scores)
    assert chunked < shard_scores / 2, (chunked, shard_scores)
    assert chunked < 1.1 * (b + d) * c * 4, chunked  # follows the chunk, not N
