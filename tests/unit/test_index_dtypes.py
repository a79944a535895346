"""The index's device dtypes (issue 58): the token table in uint16 when the vocabulary fits
(half the bytes, every fetch identical to an int32 table's and returned as int32, 2 bytes an
id on the wire), the block embeddings in bfloat16 as an option (half the bytes, scores summed
in float32, recall close to float32's on clustered data)."""

import functools

import jax
import ml_collections
import numpy as np
import pytest

from realm_jax import plan, sharding
from realm_jax.config import load_config
from realm_jax.index import embedding
from realm_jax.ops import mips
from realm_jax.qa.step import contains_answer


@pytest.fixture(scope="module")
def mesh():
    cfg = ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (2, 2)})
    return sharding.make_mesh(cfg)  # the 4 fake devices of tests/conftest.py


def _tables(mesh, n=101, lb=7, top=65535, seed=0):
    """Random tokens [n, lb] below `top` + 1, and their device tables as pad_index makes them
    and in int32."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, top + 1, size=(n, lb))
    tokens[0, 0] = top
    _, small = embedding.pad_index(None, tokens, mesh)
    wide = sharding.pad_rows(tokens.astype(np.int32), mesh)
    return tokens, sharding.put_rows(small, mesh), sharding.put_rows(wide, mesh)


@pytest.mark.parametrize("lb", [7, 8])  # an odd block length travels padded to a pair
def test_uint16_table_halves_and_fetches_identically(mesh, lb):
    tokens, small, wide = _tables(mesh, lb=lb)
    assert small.dtype == np.uint16 and wide.dtype == np.int32
    assert small.nbytes * 2 == wide.nbytes
    assert all(
        s.data.nbytes * 2 == w.data.nbytes
        for s, w in zip(small.addressable_shards, wide.addressable_shards)
    )
    ids = np.random.default_rng(1).integers(0, len(tokens), size=(5, 9)).astype(np.int32)
    fetch = jax.jit(functools.partial(mips.fetch_rows, mesh))
    got, ref = fetch(small, ids), fetch(wide, ids)
    assert got.dtype == np.int32  # the model's ids
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(got), tokens[ids])  # ids above 32767 intact


def test_search_and_fetch_with_a_uint16_table_equals_int32(mesh):
    tokens, small, wide = _tables(mesh, n=203)
    rng = np.random.default_rng(2)
    emb = rng.normal(size=(len(tokens), 8)).astype(np.float32)
    e = sharding.put_rows(sharding.pad_rows(emb, mesh), mesh)
    q = rng.normal(size=(6, 8)).astype(np.float32)
    none = np.full((6,), -1, np.int32)
    fn = jax.jit(functools.partial(mips.search_and_fetch, mesh, k=5, num_valid=len(tokens)))
    (s1, i1, t1), (s2, i2, t2) = fn(q, e, small, none), fn(q, e, wide, none)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i2))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    assert t1.dtype == np.int32
    scores, ids = jax.jit(functools.partial(mips.search, mesh, k=5, num_valid=len(tokens)))(
        q, e, none
    )
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(i1))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(s1))


def test_owner_test_equals_the_test_of_fetched_rows(mesh):
    """The answer test run where the rows live equals the test of the rows fetched."""
    tokens, small, wide = _tables(mesh, n=60, lb=6, top=20)  # small ids: answers do occur
    rng = np.random.default_rng(3)
    ids = rng.integers(0, len(tokens), size=(4, 12)).astype(np.int32)
    answers = np.zeros((4, 3, 2), np.int32)
    answers[:, 0, 0] = rng.integers(1, 21, 4)  # one-wordpiece answers
    answers[:, 1] = rng.integers(1, 21, (4, 2))  # two-wordpiece ones
    want = np.asarray(contains_answer(tokens[ids].astype(np.int32), answers))
    for table in (small, wide):
        got = jax.jit(
            lambda t, i, a: mips.owner_test(mesh, t, i, contains_answer, a)  # noqa: B023
        )(table, ids, answers)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert want.any() and not want.all()


def test_int32_when_the_vocabulary_does_not_fit(mesh):
    assert embedding.token_dtype(30522) == np.uint16
    assert embedding.token_dtype(65536) == np.uint16
    assert embedding.token_dtype(65537) == np.int32
    tokens, big, _ = _tables(mesh, top=70000)
    assert big.dtype == np.int32
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    np.testing.assert_array_equal(np.asarray(mips.fetch_rows(mesh, big, ids)), tokens[ids])


def test_plan_counts_the_token_table_in_16_bits(mesh):
    """plan.py's "token table shard" figure halves (vocab 30,522), int32 past 65,536."""
    sizes = {}
    for vocab in (30522, 70000):
        config = load_config("configs/realm.py:smoke", [f"model.vocab_size={vocab}"])
        _, tokens = plan._index_args(config, mesh, 1000)
        sizes[vocab] = plan._bytes_per_device(tokens)
    assert sizes[30522] * 2 == sizes[70000]


def _clustered(n=2000, d=32, clusters=40, b=64, seed=0):
    """Embeddings in tight clusters (near-ties a rounding can swap) and queries near them."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    emb = centres[rng.integers(0, clusters, n)] + 0.1 * rng.normal(size=(n, d))
    q = centres[rng.integers(0, clusters, b)] + 0.3 * rng.normal(size=(b, d))
    return emb.astype(np.float32), q.astype(np.float32)


def test_bfloat16_index_halves_with_float32_recall(mesh):
    emb, q = _clustered()
    k, n = 10, len(emb)
    none = np.full((len(q),), -1, np.int32)
    found, nbytes = {}, {}
    for name in ("float32", "bfloat16"):
        config = ml_collections.ConfigDict({"mesh": {"index_dtype": name}})
        e, _ = embedding.pad_index(
            emb, np.zeros((n, 2), np.int32), mesh, embedding.index_dtype(config)
        )
        e = sharding.put_rows(e, mesh)
        nbytes[name] = e.nbytes
        fn = jax.jit(functools.partial(mips.search, mesh, k=k, num_valid=n, chunk=128))
        scores, ids = fn(q, e, none)
        assert scores.dtype == np.float32
        found[name] = np.asarray(ids)
    assert nbytes["bfloat16"] * 2 == nbytes["float32"]
    exact = np.argsort(-(q.astype(np.float64) @ emb.T.astype(np.float64)), axis=1)[:, :k]
    recall = {
        name: np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, exact)])
        for name, ids in found.items()
    }
    assert recall["float32"] == 1.0
    assert recall["bfloat16"] >= 0.9, recall  # measured 0.989
    with pytest.raises(ValueError, match="index_dtype"):
        embedding.index_dtype(ml_collections.ConfigDict({"mesh": {"index_dtype": "fp8"}}))
