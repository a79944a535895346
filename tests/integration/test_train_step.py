"""The REALM train step on the test process's fake CPU devices (4: tests/conftest.py), against
independent references."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import sharding, tokenization
from realm_jax.index import embedding
from realm_jax.model import inputs
from realm_jax.ops import fused_softmax
from realm_jax.pretrain import losses, measures, retrieval, terms
from realm_jax.pretrain import step as pretrain_step
from realm_jax.pretrain.step_config import StepConfig
from tests.conftest import REPO
from tests.support.realm_fixtures import synthetic_batch, synthetic_index, tiny_config


@pytest.fixture(scope="module")
def setup():
    config = tiny_config()
    mesh = sharding.make_mesh(config.mesh)
    model, optimizer, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
    emb, tokens = synthetic_index(config)
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
    batch = synthetic_batch(config)
    return config, mesh, model, optimizer, state, shardings, emb, tokens, index, batch


def step_cfg(config, num_valid, **changes):
    """The step's settings from the config and an index of num_valid blocks, with changes."""
    return dataclasses.replace(StepConfig.from_config(config, num_valid), **changes)


def test_mesh_errors_are_clear():
    n = jax.device_count()
    cfg = tiny_config("mesh.shape=(3, -1)")
    with pytest.raises(sharding.MeshError, match=f"does not divide {n} devices"):
        sharding.make_mesh(cfg.mesh)
    mesh = sharding.make_mesh(tiny_config(f"mesh.shape=({n}, 1)").mesh)
    with pytest.raises(sharding.MeshError, match="not divisible by the mesh's data axis"):
        sharding.check_batch(3 * n // 2, mesh)


def test_retrieval_matches_numpy_and_excludes_own_block(setup):
    config, mesh, model, _, state, _, emb, tokens, index, batch = setup
    fn = jax.jit(
        functools.partial(
            retrieval.retrieve, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
        )
    )
    q_emb, relevance, cands, ids = fn(state.params, sharding.global_batch(batch, mesh), *index)
    q = np.asarray(q_emb, np.float64)
    scores = q @ emb.T.astype(np.float64)
    for b, own in enumerate(batch["block_id"]):
        if own >= 0:
            scores[b, own] = -np.inf
    want = np.argsort(-scores, axis=1)[:, :3]
    np.testing.assert_array_equal(np.asarray(ids), want)
    assert not (np.asarray(ids) == batch["block_id"][:, None]).any()  # no trivial retrieval
    # Candidate 0 is the null document: the empty block [CLS] [SEP] [SEP], scored like any.
    null_row = np.zeros(config.data.block_len, np.int32)
    null_row[:3] = [101, 102, 102]
    np.testing.assert_array_equal(np.asarray(cands)[:, 0], np.broadcast_to(null_row, (8, 16)))
    np.testing.assert_array_equal(np.asarray(cands)[:, 1:], tokens[want])
    assert np.all(np.asarray(relevance)[:, 0] != 0)


def test_shard_map_search_scores_match_numpy():
    from realm_jax.ops import mips as retrieval

    mesh = sharding.make_mesh(tiny_config().mesh)
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(1001, 16)).astype(np.float32)
    tok = rng.integers(1, 50, size=(1001, 4)).astype(np.int32)
    e, t = embedding.pad_index(emb, tok, mesh)
    q = rng.normal(size=(8, 16)).astype(np.float32)
    ex = np.array([-1, 0, 5, 1000, 17, -1, 3, 2], np.int32)
    vals, ids, got_tok = jax.jit(
        functools.partial(retrieval.search_and_fetch, mesh, k=5, num_valid=1001)
    )(q, sharding.put_rows(e, mesh), sharding.put_rows(t, mesh), ex)
    s = q.astype(np.float64) @ emb.T
    s[ex >= 0, ex[ex >= 0]] = -np.inf
    want = np.argsort(-s, axis=1)[:, :5]
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_allclose(np.asarray(vals), np.take_along_axis(s, want, 1), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got_tok), tok[want])


def test_joint_input_matches_python_format():
    q_raw, title, body = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    q = tokenization.pad_to(tokenization.query_ids(q_raw, 8), 8)[None]
    blk, _ = tokenization.block_ids(title, body, 10)
    blocks = np.stack([np.zeros(10, np.int32), tokenization.pad_to(blk, 10)])[None]
    ids, segs, mask = inputs.build_joint(jnp.asarray(q), jnp.asarray(blocks), 16)
    want, want_seg = tokenization.joint_ids(q_raw, title, body, 16)
    np.testing.assert_array_equal(np.asarray(ids)[0, 1], tokenization.pad_to(want, 16))
    np.testing.assert_array_equal(np.asarray(segs)[0, 1], tokenization.pad_to(want_seg, 16))
    np.testing.assert_array_equal(np.asarray(ids)[0, 0], q[0].tolist() + [0] * 8)  # no block
    assert np.asarray(mask)[0, 0].sum() == 5


def test_null_document_input_and_score_match_the_release(setup):
    """The null document is the release's empty Document: the block `[CLS] [SEP] [SEP]` with
    segments (0, 0, 1) for the document embedder, `[CLS] x [SEP] [SEP]` with segment 1 on the
    last [SEP] for the reader, and its score is q . Embed_d(empty block) computed here with the
    block padded to the full block length (the step embeds it at length 3)."""
    from realm_jax.model.realm import RealmModel

    config, mesh, model, _, state, _, emb, _, index, batch = setup
    seg = np.asarray(inputs.block_segments(inputs.null_block_tokens(1, 5)))
    np.testing.assert_array_equal(seg[0], [0, 0, 1, 0, 0])
    q = jnp.asarray([[101, 7, 8, 102, 0, 0]])
    ids, segs, mask = (np.asarray(x)[0] for x in inputs.null_reader_input(q))
    np.testing.assert_array_equal(ids, [101, 7, 8, 102, 102, 0, 0])
    np.testing.assert_array_equal(segs, [0, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 1, 0, 0])

    fn = functools.partial(
        retrieval.retrieve, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
    )
    q_emb, relevance, _, _ = jax.jit(fn)(state.params, sharding.global_batch(batch, mesh), *index)
    lb = config.data.block_len
    padded = np.zeros((1, lb), np.int32)
    padded[0, :3] = [101, 102, 102]
    seg = np.zeros((1, lb), np.int32)
    seg[0, 2] = 1
    null = model.apply(
        {"params": state.params},
        jnp.asarray(padded),
        jnp.asarray(seg),
        jnp.asarray((padded != 0).astype(np.int32)),
        method=RealmModel.embed_doc,
    )  # [1, D]
    want = np.asarray(q_emb, np.float64) @ np.asarray(null, np.float64)[0]
    np.testing.assert_allclose(np.asarray(relevance)[:, 0], want, rtol=1e-5, atol=1e-5)


def test_null_document_score_gradient_hand_computed():
    """d loss / d relevance = p(z|x) - p(z|x, y) summed over targets / num_targets, for the
    null document (candidate 0) as for every candidate: hand-computed on a 1 x 3 case."""
    relevance = jnp.array([[0.5, -1.0, 2.0]])
    log_py = np.log(np.array([[[0.2, 0.05]], [[0.1, 0.3]], [[0.6, 0.02]]]))[None, :, 0]
    # log p(y_j | x, z) as [B=1, K=3, P=2]: logits whose log-softmax puts those on the target.
    vocab = 4
    logits = np.full((1, 3, 2, vocab), -30.0)
    for k in range(3):
        for j in range(2):
            p = np.exp(log_py[0, k, j])
            logits[0, k, j, 0] = np.log(p)
            logits[0, k, j, 1:] = np.log((1 - p) / (vocab - 1))
    targets = jnp.zeros((1, 2), jnp.int32)
    weights = jnp.ones((1, 2))

    def loss(r):
        return losses.marginal_loss(r, jnp.asarray(logits), targets, weights)[0]

    got = np.asarray(jax.grad(loss)(relevance))[0]
    pz = np.exp(np.asarray(relevance[0])) / np.exp(np.asarray(relevance[0])).sum()
    py = np.exp(log_py[0])  # [K, P]
    post = pz[:, None] * py / (pz[:, None] * py).sum(0, keepdims=True)  # p(z | x, y_j)
    want = (pz[:, None] - post).sum(1) / 2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert abs(got[0]) > 1e-3  # the null document's score gets a gradient


@pytest.mark.system  # trains ~50 s: CI keeps the null document's score and gradient
def test_retriever_learns_when_every_retrieved_score_is_negative(setup):
    """The failure the null document's constant score caused: with every retrieved block
    scored far below 0 (here about -100: the embedders' projection LayerNorm biases pushed to
    opposite constants), a null document fixed at 0 took all the probability and the retriever's
    gradient was exactly 0. Scored by the live document embedder, it is one candidate among
    equals and both embedders get a gradient."""
    config, mesh, model, optimizer, _, shardings, emb, _, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    params = jax.device_get(state.params)
    d = config.model.proj_size
    c = np.full((d,), 10.0 / np.sqrt(d), np.float32)  # |c|^2 = 100
    for name, sign, scale in (("query_embedder", -1.0, 1e-2), ("doc_embedder", 1.0, 1.0)):
        ln = params[name]["projection_LayerNorm"]
        ln["scale"] = np.full_like(ln["scale"], scale)
        ln["bias"] = sign * c
    gb = sharding.global_batch(batch, mesh)
    fn = functools.partial(
        retrieval.retrieve, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
    )
    _, relevance, _, _ = jax.jit(fn)(params, gb, *index)
    relevance = np.asarray(relevance)
    assert (relevance < -50).all(), relevance
    state = state.replace(params=jax.device_put(params, shardings.params))
    step = pretrain_step.compile_train_step(config, mesh, model, optimizer, shardings, len(emb))
    _, metrics = step(state, gb, *index, jnp.int32(0))
    metrics = jax.device_get(metrics)
    assert metrics["null_doc_prob"] < 0.9
    for name in ("query_embedder", "doc_embedder"):
        assert metrics[f"grad_norm/{name}"] > 1e-6, (name, metrics[f"grad_norm/{name}"])
    # the constant score the null document used to get: all the probability, no gradient
    retrieved_prob = np.exp(relevance[:, 1:].astype(np.float64)).sum(1)  # vs exp(0) = 1
    assert (retrieved_prob < 1e-20).all()


def test_marginal_loss_hand_computed():
    # One query, two candidates, vocabulary of 3, two targets (the second is padding).
    rel = np.array([[0.0, np.log(3.0)]])  # p(z) = [1/4, 3/4]
    logits = np.zeros((1, 2, 2, 3))
    logits[0, 0, 0] = [np.log(2.0), 0, 0]  # p(y=0 | z0) = 2/4
    logits[0, 1, 0] = [0, np.log(6.0), np.log(2.0)]  # p(y=0 | z1) = 1/9
    targets = np.array([[0, 1]])
    w = np.array([[1.0, 0.0]])
    loss, m = losses.marginal_loss(
        jnp.asarray(rel), jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(w)
    )
    p = 0.25 * 0.5 + 0.75 / 9
    assert abs(float(loss) + np.log(p)) < 1e-6
    assert abs(float(m["retrieval_utility"]) - (np.log(p) - np.log(0.5))) < 1e-6
    ent = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    assert abs(float(m["retrieval_entropy"]) - ent) < 1e-6
    # marginal over vocab at target 0: y=0 -> p, y=1 -> .25*.25+.75*(6/9), y=2 -> ...
    assert float(m["accuracy"]) == 0.0  # y=1 has the largest marginal probability


@pytest.mark.parametrize(
    "chunk, mesh_shape",
    [
        (0, None),
        (7, None),
        (7, (2, 2)),
        (16, (1, 4)),
        # the same paths at other chunk sizes and mesh shapes: the system tier
        pytest.param(16, None, marks=pytest.mark.system),
        pytest.param(64, None, marks=pytest.mark.system),
        pytest.param(0, (4, 1), marks=pytest.mark.system),
    ],
)
def test_fused_marginal_loss_matches_materialised_logits(chunk, mesh_shape):
    """The chunked MLM softmax (never holding [B, K, P, V]) against marginal_loss on dense
    logits: loss, every metric and the gradients of relevance, features, table and bias.
    V = 50 is not a multiple of the chunks, so the padded last chunk is exercised. On a mesh
    (data x model) the loss is data- and vocabulary-parallel under shard_map: a 2-way model
    axis splits the 50 rows 25/25; a 4-way one, which does not divide them, leaves the
    vocabulary whole on each shard."""
    rng = np.random.default_rng(0)
    B, K, P, H, V = 4, 4, 5, 8, 50
    mesh = None
    if mesh_shape is not None:
        mesh = jax.make_mesh(
            mesh_shape,
            ("data", "model"),
            axis_types=(jax.sharding.AxisType.Auto,) * 2,
            devices=jax.devices()[:4],
        )
    rel = jnp.asarray(rng.normal(size=(B, K)), jnp.float32)
    feats = jnp.asarray(rng.normal(size=(B, K, P, H)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(V, H)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(V,)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, V, (B, P)), jnp.int32).at[0, 0].set(V - 1)
    w = jnp.asarray(rng.random((B, P)) < 0.7, jnp.float32).at[0, 0].set(1.0)
    # Make some predictions right so that accuracy is neither 0 nor 1.
    feats = feats.at[:, :, :2].set(3 * table[tgt[:, :2]][:, None])

    def dense(rel, feats, table, bias):
        logits = jnp.einsum("bkph,vh->bkpv", feats, table) + bias
        return losses.marginal_loss(rel, logits, tgt, w)

    def fused(rel, feats, table, bias):
        return fused_softmax.fused_marginal_loss(rel, feats, table, bias, tgt, w, chunk, mesh)

    args = (rel, feats, table, bias)
    (l1, m1), g1 = jax.value_and_grad(dense, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    (l2, m2), g2 = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    assert 0 < float(m1["accuracy"]) < 1
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
    for k in m1:
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # The forward alone (evaluation: no gradient pass) gives the same metrics...
    _, m3 = jax.jit(fused)(*args)
    for k in m1:
        np.testing.assert_allclose(float(m3[k]), float(m1[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    # ...and the gradient, formed in the forward pass, scales with the incoming cotangent.
    g3 = jax.grad(lambda *a: -2.5 * fused(*a)[0], argnums=(0, 1, 2, 3))(*args)
    for a, b in zip(g3, g1):
        np.testing.assert_allclose(np.asarray(a), -2.5 * np.asarray(b), rtol=1e-4, atol=3e-5)


def test_layer_norm_and_its_gradient_match_flax():
    from flax import linen as nn

    from realm_jax.model.layers import LayerNorm

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 16)) * 3 + 1, jnp.float32)
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)  # a non-uniform cotangent
    scale = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
    params = {"params": {"scale": scale, "bias": bias}}

    def loss(module):
        return lambda p, x: (module.apply(p, x) * w).sum()

    ours, ref = LayerNorm(epsilon=1e-12), nn.LayerNorm(epsilon=1e-12)
    np.testing.assert_allclose(ours.apply(params, x), ref.apply(params, x), atol=2e-6)
    g_ours = jax.grad(loss(ours), argnums=(0, 1))(params, x)
    g_ref = jax.grad(loss(ref), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dropout_keeps_the_rate_and_is_unbiased():
    from realm_jax.model.layers import Dropout, dropout_keep

    x = jnp.ones((4, 16, 1001), jnp.float32)
    n = x.size
    for rate in (0.1, 0.5):
        y = np.asarray(Dropout(rate).apply({}, x, False, rngs={"dropout": jax.random.key(3)}))
        dropped = (y == 0).mean()
        # 64,064 Bernoulli draws: 5 standard deviations of the dropped fraction.
        assert abs(dropped - rate) < 5 * np.sqrt(rate * (1 - rate) / n), (rate, dropped)
        np.testing.assert_allclose(y[y != 0], 1 / (1 - rate), rtol=1e-6)
    np.testing.assert_array_equal(Dropout(0.1).apply({}, x, True), x)  # eval: identity
    # No structure along either index: neighbours in a row, in a column, and across keys are
    # uncorrelated (|r| < 5 / sqrt(n) for independent draws).
    m = np.asarray(dropout_keep(jax.random.key(0), (64, 64, 257), 0.5), np.float64)
    m2 = np.asarray(dropout_keep(jax.random.key(1), (64, 64, 257), 0.5), np.float64)
    bound = 5 / np.sqrt(m.size)
    for a, b in [
        (m[..., 1:], m[..., :-1]),
        (m[:, 1:], m[:, :-1]),
        (m[1:], m[:-1]),
        (m, m2),
    ]:
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < bound


@pytest.fixture(scope="module")
def sharded_step(setup):
    """One compiled train step on the test process's mesh (compiled once for the module)."""
    config, mesh, model, optimizer, state, shardings, emb, _, index, batch = setup
    fn = pretrain_step.compile_train_step(config, mesh, model, optimizer, shardings, len(emb))
    _, metrics = fn(state, sharding.global_batch(batch, mesh), *index, jnp.int32(0))
    return jax.device_get(metrics)


def test_gradients_reach_all_networks(sharded_step):
    for name in ("query_embedder", "doc_embedder", "reader"):
        assert sharded_step[f"grad_norm/{name}"] > 0, name
    assert np.isfinite(sharded_step["loss"]) and sharded_step["loss"] > 0


def test_materialised_logits_path_matches_the_fused_step(setup, sharded_step):
    """train.mlm_vocab_chunk=-1 (dense [B, K, P, V] logits) gives the step's loss and metrics."""
    config, mesh, model, _, _, _, emb, _, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(
        config, mesh, jax.random.key(0)
    )  # (setup's was donated)
    dense = tiny_config("train.mlm_vocab_chunk=-1")
    metrics = jax.device_get(
        pretrain_step.compile_loss(dense, mesh, model, len(emb))(
            state.params, sharding.global_batch(batch, mesh), *index
        )
    )
    for k in ("loss", "accuracy", "retrieval_utility", "retrieval_entropy"):
        np.testing.assert_allclose(metrics[k], sharded_step[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_null_document_read_at_query_length_matches_full_length(setup):
    """The reader reads the null document as `[CLS] x [SEP] [SEP]` at the query's length + 1;
    reading every candidate as a full-length joint input built by build_joint (the null one
    from an empty `[CLS] body [SEP]` block, padded) gives the same metrics."""
    from realm_jax.model.realm import RealmModel, tied_decoder_logits

    config, mesh, model, _, _, _, emb, _, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(
        config, mesh, jax.random.key(0)
    )  # (setup's was donated)
    gb = sharding.global_batch(batch, mesh)
    K, length = config.train.num_candidates, inputs.joint_len(config)

    def reference(params, batch, *index):
        _, relevance, cands, _ = retrieval.retrieve(
            params, batch, *index, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
        )
        B = cands.shape[0]
        # [CLS] [SEP] 0 ...: build_joint drops the [CLS] and appends the one [SEP].
        empty = jnp.zeros_like(cands[:, :1]).at[:, :, :2].set(jnp.array([101, 102]))
        cands = jnp.concatenate([empty, cands[:, 1:]], axis=1)
        ids, segs, mask = (
            x.reshape(B * K, length) for x in inputs.build_joint(batch["query_ids"], cands, length)
        )
        feats, table, bias = model.apply(
            {"params": params},
            ids,
            segs,
            mask,
            jnp.repeat(batch["mlm_positions"], K, axis=0),
            method=RealmModel.mlm_features,
        )
        logits = tied_decoder_logits(feats.reshape(B, K, *feats.shape[1:]), table, bias)
        tgt, w = batch["mlm_targets"], batch["mlm_weights"]
        return losses.marginal_loss(relevance, logits, tgt, w)[1]  # the metrics

    want = jax.device_get(jax.jit(reference)(state.params, gb, *index))
    got = jax.device_get(
        pretrain_step.compile_loss(config, mesh, model, len(emb))(state.params, gb, *index)
    )
    for k in ("loss", "accuracy", "retrieval_utility", "retrieval_entropy"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_same_loss_on_one_device_and_the_mesh(setup, sharded_step):
    config, _, model, _, _, _, emb, tokens, _, batch = setup
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    e, t = embedding.pad_index(emb, tokens, mesh)
    loss_fn = pretrain_step.compile_loss(config, mesh, model, len(emb))
    metrics = jax.device_get(
        loss_fn(
            state.params,
            sharding.global_batch(batch, mesh),
            sharding.put_rows(e, mesh),
            sharding.put_rows(t, mesh),
        )
    )
    np.testing.assert_allclose(metrics["loss"], sharded_step["loss"], rtol=1e-5)


def index_and_loss(config, mesh, model, **kw):
    """(blocks' embeddings, tokens, the index on the mesh, realm_loss with the config's
    candidates, lengths and vocab chunk; kw: more of its arguments)."""
    emb, tokens = synthetic_index(config)
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
    loss_fn = functools.partial(
        pretrain_step.realm_loss, model=model, mesh=mesh, cfg=step_cfg(config, len(emb), **kw)
    )
    return emb, tokens, index, loss_fn


@pytest.mark.system  # two step compiles; CI: the weighting test (below)
def test_gradient_accumulation_gives_the_whole_batch_gradient():
    """train.grad_accum=2 (pretrain/step.py accumulated_grads) against one pass over the same
    16 sentences on the sharded mesh: the same gradient, metrics and update. The two
    micro-batches hold different numbers of targets, so a plain mean of micro-batch
    gradients would differ from the whole batch's."""
    off = ["model.embedder.dropout=0", "model.reader.dropout=0", "train.batch_size=16"]
    one, two = tiny_config(*off), tiny_config(*off, "train.grad_accum=2")
    mesh = sharding.make_mesh(one.mesh)
    model, _, state, _ = pretrain_step.create_state(one, mesh, jax.random.key(0))
    emb, _, index, loss_fn = index_and_loss(one, mesh, model)
    batch = synthetic_batch(one, seed=4)
    w = batch["mlm_weights"].sum(1)
    assert w[0::2].sum() != w[1::2].sum()  # micro-batch j holds rows j, j + 2, ...
    gb = sharding.global_batch(batch, mesh)
    want = jax.jit(jax.grad(lambda p: loss_fn(p, gb, *index)[0]))(state.params)
    got, _ = jax.jit(
        lambda p: pretrain_step.accumulated_grads(loss_fn, p, gb, *index, 2, mesh, None)
    )(state.params)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        ref = functools.reduce(lambda t, k: t[k.key], path, want)
        # The random-init reader reads every candidate alike, so the embedders' gradient
        # (posterior minus prior) is at float32 rounding level (~1e-6): it is checked
        # against the whole gradient's scale; the weighting itself exactly in the next test.
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4 * scale, err_msg=str(path))
    metrics = {}
    for name, config in (("one", one), ("two", two)):
        model, opt, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
        fn = pretrain_step.compile_train_step(config, mesh, model, opt, shardings, len(emb))
        new, m = fn(state, gb, *index, jnp.int32(0))
        metrics[name] = jax.device_get((m, new.params))
    (m1, p1), (m2, p2) = metrics["one"], metrics["two"]
    assert m2["num_targets"] == m1["num_targets"] == w.sum()
    for k in ("loss", "accuracy", "retrieval_utility", "retrieval_entropy", "grad_norm"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)):  # AdamW's first step
        np.testing.assert_allclose(a, b, atol=2 * two.train.lr)


def test_gradient_accumulation_weights_micro_batches_by_their_targets():
    """accumulated_grads on a loss with REALM's normalisation (a sum over real targets over
    their number) and a 1-D mesh: the whole batch's gradient and metrics to float32
    precision, where the mean of the micro-batch gradients is measurably not."""
    mesh = sharding.make_mesh(tiny_config("mesh.shape=(2, -1)").mesh)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3, 5)).astype(np.float32)
    y = rng.normal(size=(8, 3)).astype(np.float32)
    w = np.zeros((8, 3), np.float32)
    w[0, :3] = w[1, :1] = w[3, :2] = w[4, :3] = w[6, :1] = 1  # rows 0 2 4 6: 7; 1 3 5 7: 3
    batch = dict(x=x, y=y, mlm_weights=w)

    def loss_fn(params, batch, emb, tokens, rng=None):
        wt = batch["mlm_weights"]
        err = jnp.einsum("bpd,d->bp", batch["x"], params["a"]) + emb.sum() - batch["y"]
        loss = (wt * err**2).sum() / jnp.maximum(wt.sum(), 1.0)
        m = {"loss": loss, "num_targets": wt.sum(), "retrieval_entropy": err[:, 0].mean()}
        return loss, m | {"retrieved_ids": jnp.zeros((len(wt), 1), jnp.int32)}

    params = {"a": jnp.asarray(rng.normal(size=5), jnp.float32)}
    emb = jnp.float32(0.5)
    gb = sharding.global_batch(batch, mesh)
    want = jax.grad(lambda p: loss_fn(p, batch, emb, None)[0])(params)["a"]
    grads, m = jax.jit(
        lambda p, b: pretrain_step.accumulated_grads(loss_fn, p, b, emb, None, 2, mesh, None)
    )(params, gb)
    np.testing.assert_allclose(grads["a"], want, rtol=1e-5)
    _, whole = loss_fn(params, batch, emb, None)
    for k in ("loss", "num_targets", "retrieval_entropy"):
        np.testing.assert_allclose(m[k], whole[k], rtol=1e-5, err_msg=k)
    halves = [{k: v[j::2] for k, v in batch.items()} for j in (0, 1)]
    mean = sum(jax.grad(lambda p, h=h: loss_fn(p, h, emb, None)[0])(params)["a"] for h in halves)
    assert np.abs(mean / 2 - want).max() > 1e-2 * np.abs(want).max()


def test_two_process_distributed_matches_single_process(sharded_step):
    m = sharded_step
    worker = os.path.join(REPO, "tests", "support", "distributed_worker.py")
    import portpicker

    port = portpicker.pick_unused_port()
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(port), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    losses_ = [
        float(line.split()[1])
        for out in outs
        for line in out.splitlines()
        if line.startswith("LOSS ")
    ]
    assert len(losses_) == 2
    for loss in losses_:
        np.testing.assert_allclose(loss, m["loss"], rtol=1e-5)


def test_dropout_is_off_in_eval_and_keyed_in_training():
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import RealmModel

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        dropout=0.3,
    )
    model = RealmModel(cfg)
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 60, (2, 8)), jnp.int32)
    segs, mask, pos = jnp.zeros_like(ids), jnp.ones_like(ids), jnp.ones((2, 1), jnp.int32)
    t = (ids, segs, mask)
    params = model.init(jax.random.key(0), t, t, t, pos, mask)["params"]

    def run(**kw):
        return model.apply({"params": params}, *t, pos, method=RealmModel.mlm_logits, **kw)

    np.testing.assert_array_equal(run(), run())  # eval: deterministic, no rng needed
    a = run(train=True, rngs={"dropout": jax.random.key(1)})
    b = run(train=True, rngs={"dropout": jax.random.key(1)})
    c = run(train=True, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, run())


def test_bfloat16_compute_tracks_float32():
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import RealmModel

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 60, (2, 8)), jnp.int32)
    t = (ids, jnp.zeros_like(ids), jnp.ones_like(ids))
    pos = jnp.ones((2, 2), jnp.int32)
    f32 = RealmModel(ModelConfig(**kw))
    params = f32.init(jax.random.key(0), t, t, t, pos, t[2])["params"]
    bf16 = RealmModel(ModelConfig(**kw, dtype="bfloat16"))
    a = f32.apply({"params": params}, *t, pos, method=RealmModel.mlm_logits)
    b = bf16.apply({"params": params}, *t, pos, method=RealmModel.mlm_logits)
    assert b.dtype == jnp.float32  # logits are returned in float32
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.1)
    assert not np.array_equal(np.asarray(b), np.asarray(a))  # really computed in bfloat16
    qa = f32.apply({"params": params}, *t, method=RealmModel.embed_query)
    qb = bf16.apply({"params": params}, *t, method=RealmModel.embed_query)
    np.testing.assert_allclose(np.asarray(qb), np.asarray(qa), atol=0.15)


def test_held_out_evaluation_against_numpy(setup):
    """RealmEvaluator: the null-only accuracy from the reader's own logits on the null input,
    and the same-title fractions from a numpy brute-force top-k over the index."""
    from realm_jax.model.realm import tied_decoder_logits
    from realm_jax.pretrain.evaluation import RealmEvaluator

    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    titles = [f"t{i % 5}" for i in range(len(emb))]

    class Feed:  # the trainer's index, as IndexFeed holds it
        num_blocks, step = len(emb), 0

    Feed.emb, Feed.tokens = index
    params = jax.device_get(state.params)
    retrieve = functools.partial(
        retrieval.retrieve_and_read, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
    )
    # The targets do not change what is retrieved: give the even queries their first retrieved
    # block's wordpieces as targets, so that some blocks hold the masks (copy metrics below).
    first = np.asarray(retrieve(params, batch, *index).ids)[:, 0]
    batch = dict(batch, mlm_targets=batch["mlm_targets"].copy())
    for b in range(0, len(first), 2):
        n = int(batch["mlm_weights"][b].sum())
        batch["mlm_targets"][b, :n] = tokens[first[b], 1 : n + 1]
    got = RealmEvaluator(config, mesh, model, Feed, [batch], titles)(state, 0)

    q = batch["query_ids"]
    ids, segs, mask = (np.asarray(x) for x in inputs.null_reader_input(jnp.asarray(q)))
    feats, table, bias = model.apply(
        {"params": params}, ids, segs, mask, batch["mlm_positions"], method="mlm_features"
    )
    pred = np.asarray(tied_decoder_logits(feats, table, bias)).argmax(-1)
    w = batch["mlm_weights"]
    want_null = ((pred == batch["mlm_targets"]) * w).sum() / w.sum()
    np.testing.assert_allclose(got["null_only_accuracy"], want_null, rtol=1e-6)

    q_emb = np.asarray(
        model.apply({"params": params}, q, np.zeros_like(q), (q != 0) * 1, method="embed_query")
    )
    scores = q_emb.astype(np.float64) @ emb.T.astype(np.float64)
    own = batch["block_id"]
    for b, o in enumerate(own):
        if o >= 0:
            scores[b, o] = -np.inf
    top = np.argsort(-scores, axis=1)[:, : config.train.num_candidates - 1]
    t = np.asarray(titles)
    ok = own >= 0
    want_same = (t[top[ok]] == t[own[ok]][:, None]).mean(1).mean()
    np.testing.assert_allclose(got["same_title_fraction"], want_same, rtol=1e-6)
    counts = np.array([titles.count(t[o]) for o in own[ok]])
    np.testing.assert_allclose(got["same_title_random"], ((counts - 1) / (len(t) - 1)).mean())
    assert got["examples"] == len(q) and 0 <= got["null_doc_prob"] <= 1

    # Prior and posterior mass on the article's blocks: numpy over the step's own relevance
    # and reader features (log p(y|x,z) by a full softmax over the vocabulary).
    c = retrieve(params, batch, *index)
    rel, feats, table, bias, rids = (
        np.asarray(x, np.float64) for x in (c.relevance, c.features, c.table, c.bias, c.ids)
    )
    logits = np.einsum("bkph,vh->bkpv", feats, table) + bias
    logits -= logits.max(-1, keepdims=True)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tg = batch["mlm_targets"]
    hit = np.take_along_axis(lp, np.broadcast_to(tg[:, None, :, None], lp.shape[:3] + (1,)), -1)
    loglik = (hit[..., 0] * w[:, None, :]).sum(-1)  # [B, K]
    prior = np.exp(rel - rel.max(1, keepdims=True))
    prior /= prior.sum(1, keepdims=True)
    post = prior * np.exp(loglik - loglik.max(1, keepdims=True))
    post /= post.sum(1, keepdims=True)
    same = t[rids.astype(int)[ok]] == t[own[ok]][:, None]
    np.testing.assert_allclose(
        got["same_title_prior"], (prior[ok][:, 1:] * same).sum(1).mean(), rtol=1e-4
    )
    np.testing.assert_allclose(
        got["same_title_posterior"], (post[ok][:, 1:] * same).sum(1).mean(), rtol=1e-3, atol=1e-6
    )

    # The copy metrics, from the same numpy log-likelihoods: does a block hold every target
    # (a python set per block), and the argmax given each block alone.
    rids = rids.astype(int)
    n_t = w.sum(1)
    holds = np.array(
        [[set(tg[b][w[b] > 0]) <= set(tokens[i]) for i in rids[b]] for b in range(len(tg))]
    )
    assert holds[0::2, 0].all() and holds.sum() < holds.size  # both kinds are present
    right = ((lp.argmax(-1) == tg[:, None, :]) * w[:, None, :]).sum(-1)[:, 1:]
    lacks = ~holds
    np.testing.assert_allclose(got["span_in_candidates"], holds.any(1).mean())
    for kind, sel in (("holds", holds), ("lacks", lacks)):
        want = right[sel].sum() / (n_t[:, None] * sel).sum()
        np.testing.assert_allclose(got[f"accuracy_block_{kind}"], want, rtol=1e-6)
    per_t = loglik[:, 1:] / n_t[:, None]
    gains = [
        per_t[b][holds[b]].mean() - per_t[b][lacks[b]].mean()
        for b in range(len(tg))
        if holds[b].any() and lacks[b].any()
    ]
    np.testing.assert_allclose(got["copy_gain"], np.mean(gains), rtol=1e-3, atol=1e-5)


@pytest.mark.system  # CI: the own block's exclusion (test_retrieval_matches_numpy...) and its
# injection by the copying curriculum (test_copying_curriculum_puts...)
def test_own_block_steps_let_the_own_block_be_retrieved_then_exclude_it(setup):
    """train.own_block_steps (the reader warm-up's copying curriculum): before that step the
    step equals one on a batch whose own block ids are all -1 (nothing excluded) and differs
    from the excluding step (each own block is made its query's best match); from that step
    on, it excludes the own block again, as the release does."""
    config, mesh, model, optimizer, _, _, emb, tokens, _, batch = setup
    # setup's state is donated
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    gb = sharding.global_batch(batch, mesh)
    fn = functools.partial(
        retrieval.retrieve, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
    )
    e0, t0 = embedding.pad_index(emb, tokens, mesh)
    q_emb = np.asarray(
        jax.jit(fn)(state.params, gb, *map(lambda a: sharding.put_rows(a, mesh), (e0, t0)))[0]
    )
    emb = emb.copy()
    owns = {}
    for b, own in enumerate(batch["block_id"]):
        if own >= 0 and own not in owns:
            owns[own] = b
            emb[own] = 100 * q_emb[b]  # the own block scores far above every other
    assert owns
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))

    run = jax.jit(
        functools.partial(
            pretrain_step.train_step,
            model=model,
            optimizer=optimizer,
            mesh=mesh,
            cfg=step_cfg(config, len(emb), own_block_steps=2),
        )
    )

    def metrics(step, block_id=None):
        """Every scalar metric of the step at `step` (the loss, the retrieval's entropy, each
        network's gradient norm...): what it retrieved shows in all of them."""
        b = dict(batch) if block_id is None else dict(batch, block_id=block_id)
        _, m = run(state.replace(step=jnp.int32(step)), sharding.global_batch(b, mesh), *index, 0)
        m = jax.device_get(m)
        return np.array([float(m[k]) for k in sorted(m) if k != "staleness"])

    nothing_excluded = metrics(2, np.full_like(batch["block_id"], -1))  # -1: no own block
    excluded = metrics(2)
    # the tiny random reader barely tells blocks apart: the two differ by ~1e-4 of the loss,
    # the same inputs through the same compiled step give the same bits
    rel = np.abs(nothing_excluded - excluded) / np.maximum(np.abs(excluded), 1e-6)
    assert rel.max() > 1e-5, rel
    np.testing.assert_array_equal(metrics(0), nothing_excluded)
    np.testing.assert_array_equal(metrics(1), nothing_excluded)
    np.testing.assert_array_equal(excluded, metrics(3))


def test_copying_curriculum_puts_the_documents_block_among_the_candidates(setup):
    """retrieve(inject=...): a block the search did not find takes the last retrieved place
    (its tokens fetched from the index), one it found stays where it is, -1 changes nothing;
    against the numpy top-k."""
    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(
        config, mesh, jax.random.key(0)
    )  # (setup's was donated)
    fn = jax.jit(
        functools.partial(
            retrieval.retrieve, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
        )
    )
    batch = dict(batch, block_id=np.full_like(batch["block_id"], -1))
    g = sharding.global_batch(batch, mesh)
    _, _, _, plain = fn(state.params, g, *index)
    plain = np.asarray(plain)
    # query 0: a block far down its ranking; query 1: its own first hit; the rest: none
    q = np.asarray(
        retrieval.retrieve(
            state.params, g, *index, model=model, mesh=mesh, cfg=step_cfg(config, len(emb))
        )[0],
        np.float64,
    )
    order = np.argsort(-(q @ emb.T.astype(np.float64)), axis=1)
    inject = np.full(len(plain), -1, np.int32)
    inject[0], inject[1] = order[0, -1], plain[1, 0]
    _, _, cands, ids = fn(state.params, g, *index, inject=jnp.asarray(inject))
    ids, cands = np.asarray(ids), np.asarray(cands)
    np.testing.assert_array_equal(ids[0], [*plain[0, :2], order[0, -1]])
    np.testing.assert_array_equal(cands[0, 3], tokens[order[0, -1]])
    np.testing.assert_array_equal(ids[1:], plain[1:])  # found already, or nothing to inject


def test_evaluator_scores_a_separate_texts_sentences_by_title(setup):
    """Sentences of a separate text (block_id -1) carry their document's title: the title
    metrics count retrieved blocks of that title (none excluded), title_recall@k and the
    collapse metrics, against a numpy brute force; a title no block has leaves the query out."""
    from realm_jax.pretrain.evaluation import RealmEvaluator

    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    titles = [f"t{i % 7}" for i in range(len(emb))]

    class Feed:
        num_blocks, step = len(emb), 0

    Feed.emb, Feed.tokens = index
    B = len(batch["block_id"])
    names = np.asarray([titles[(3 * b) % len(emb)] for b in range(B)], dtype=object)
    names[-1] = "a title no block has"
    sep = dict(batch, block_id=np.full(B, -1, batch["block_id"].dtype), title=names)
    got = RealmEvaluator(config, mesh, model, Feed, [sep], titles)(state, 0)

    params = jax.device_get(state.params)
    q = batch["query_ids"]
    q_emb = np.asarray(
        model.apply({"params": params}, q, np.zeros_like(q), (q != 0) * 1, method="embed_query")
    )
    top = np.argsort(-(q_emb.astype(np.float64) @ emb.T.astype(np.float64)), axis=1)
    top = top[:, : config.train.num_candidates - 1]
    t = np.asarray(titles)
    ok = np.arange(B) < B - 1
    hits = t[top[ok]] == names[ok][:, None]
    assert got["title_queries"] == ok.sum()
    np.testing.assert_allclose(got["same_title_fraction"], hits.mean(1).mean(), rtol=1e-6)
    for k in {1, config.train.num_candidates - 1}:
        np.testing.assert_allclose(got[f"title_recall@{k}"], hits[:, :k].any(1).mean())
    counts = np.array([titles.count(n) for n in names[ok]])
    np.testing.assert_allclose(got["same_title_random"], (counts / len(t)).mean())
    _, c = np.unique(top[:, 0], return_counts=True)
    assert got["top1_share"] == pytest.approx(c.max() / B)
    assert got["distinct_top1"] == len(c)


def test_gold_block_of_an_example():
    """The copying curriculum's block: the own block, else the first block of the document's
    title (bytes or str, as TFDS gives it), else -1."""
    from realm_jax.data import pipeline

    gold_of = {"Ada": 4, "Bo": 9}
    assert pipeline.gold_block({"block_id": 2, "title": b"Bo"}, gold_of) == 2
    assert pipeline.gold_block({"block_id": -1, "title": b"Bo"}, gold_of) == 9
    assert pipeline.gold_block({"block_id": -1, "title": "Ada"}, gold_of) == 4
    assert pipeline.gold_block({"block_id": -1, "title": b"Cy"}, gold_of) == -1
    assert pipeline.gold_block({"block_id": -1}, gold_of) == -1


def test_curriculum_loss_reads_the_documents_block_alone_and_the_others_apart():
    """curriculum_loss: for a query with its block injected, the mean of a marginal over that
    block alone (its prior 1) and one over every other candidate (it left out, the null in);
    a query without one (inject -1) gets the plain marginal in both terms. Against numpy with
    a stand-in marginal (the expected value of a fixed table under the prior)."""
    rng = np.random.default_rng(0)
    rel = rng.normal(size=(3, 4)).astype(np.float32)  # [B, K]: candidate 0 the null document
    ids = np.array([[7, 9, 4], [1, 2, 3], [5, 6, 8]], np.int32)  # retrieved [B, K-1]
    inject = np.array([9, -1, 8], np.int32)  # found at candidate 2; none; found at candidate 3
    table = rng.normal(size=(3, 4)).astype(np.float32)

    def marginal(r):
        p = jax.nn.softmax(r, -1)
        return jnp.sum(p * table), {"accuracy": p[:, 0].sum(), "x": jnp.zeros(())}

    loss, m = terms.curriculum_loss(
        marginal, jnp.asarray(rel), jnp.asarray(ids), jnp.asarray(inject)
    )

    def soft(r):
        e = np.exp(r - r.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    alone, others = rel.astype(np.float64).copy(), rel.astype(np.float64).copy()
    for b, k in ((0, 2), (2, 3)):
        alone[b] = np.where(np.arange(4) == k, rel[b], -1e9)
        others[b, k] = -1e9
    want = ((soft(alone) * table).sum() + (soft(others) * table).sum()) / 2
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(
        float(m["curriculum_copy_accuracy"]), soft(alone)[:, 0].sum(), atol=1e-6
    )


def test_bm25_candidates_join_the_dense_ones_deduplicated_and_scored(setup):
    """retrieve(extra=...) (train.bm25_candidates): a second retriever's blocks join the dense
    top-k; one the search found, one repeated, and -1 become empty slots (id -1, score
    ABSENT, so prior 0); a new one is scored q . Embed_d(its tokens), computed here apart.
    A batch whose extra blocks all repeat dense ones has the plain batch's loss; the coverage
    metrics equal numpy's."""
    from realm_jax.model.realm import RealmModel

    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    kw = dict(model=model, mesh=mesh, cfg=step_cfg(config, len(emb)))
    fn = jax.jit(functools.partial(retrieval.retrieve, **kw))
    g = sharding.global_batch(batch, mesh)
    q_emb, _, _, plain = fn(state.params, g, *index)
    plain, q = np.asarray(plain), np.asarray(q_emb, np.float64)
    B = len(plain)
    own = batch["block_id"]
    new = np.asarray(
        [next(i for i in range(len(emb)) if i not in plain[b] and i != own[b]) for b in range(B)]
    )
    extra = np.stack([plain[:, 1], new, np.full(B, -1), new], 1).astype(np.int32)  # [B, 4]
    _, rel, cands, ids = fn(state.params, g, *index, extra=jnp.asarray(extra))
    rel, cands, ids = np.asarray(rel, np.float64), np.asarray(cands), np.asarray(ids)
    np.testing.assert_array_equal(ids[:, :3], plain)
    np.testing.assert_array_equal(
        ids[:, 3:], np.stack([-np.ones(B), new, -np.ones(B), -np.ones(B)], 1)
    )
    np.testing.assert_array_equal(cands[:, 5], tokens[new])
    assert (rel[:, [4, 6, 7]] == retrieval.ABSENT).all()
    blocks = jnp.asarray(tokens[new])
    segs = inputs.block_segments(blocks)
    d = model.apply(
        {"params": state.params},
        blocks,
        segs,
        (blocks != 0).astype(jnp.int32),
        method=RealmModel.embed_doc,
    )
    want = (q * np.asarray(d, np.float64)).sum(1)
    np.testing.assert_allclose(rel[:, 5], want, rtol=1e-4, atol=1e-4)

    loss = jax.jit(functools.partial(pretrain_step.realm_loss, **kw))
    _, base = loss(state.params, g, *index)
    dup = sharding.global_batch(dict(batch, extra_ids=plain[:, ::-1].astype(np.int32)), mesh)
    _, same = loss(state.params, dup, *index)
    for key in ("loss", "accuracy", "retrieval_utility", "span_in_candidates"):
        np.testing.assert_allclose(
            float(same[key]), float(base[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )
    _, joined = loss(
        state.params, sharding.global_batch(dict(batch, extra_ids=extra), mesh), *index
    )
    tgt, w = batch["mlm_targets"], batch["mlm_weights"]

    def holds(rows):  # [B, n] block ids -> any of them holds every masked wordpiece
        out = np.zeros(B, bool)
        for b in range(B):
            need = set(tgt[b][w[b] > 0].tolist())
            out[b] = bool(need) and any(i >= 0 and need <= set(tokens[i].tolist()) for i in rows[b])
        return out

    masked = w.sum(1) > 0
    # the own document (a separate text's doc_block): half the rows' is the joined new block
    doc = np.where(np.arange(B) % 2 == 0, new, -1).astype(np.int32)
    doc[1] = plain[1, 0]  # ... one a dense hit
    _, docs = loss(
        state.params,
        sharding.global_batch(dict(batch, extra_ids=extra, doc_block=doc), mesh),
        *index,
    )
    has = doc >= 0
    np.testing.assert_allclose(float(docs["doc_in_candidates"]), 1.0)
    want = np.mean([doc[b] in plain[b] for b in np.flatnonzero(has)])
    np.testing.assert_allclose(float(docs["doc_in_candidates_dense"]), want)
    all_ids = np.asarray(joined["retrieved_ids"])
    np.testing.assert_allclose(
        float(joined["span_in_candidates_dense"]), holds(plain)[masked].mean()
    )
    np.testing.assert_allclose(float(joined["span_in_candidates"]), holds(all_ids)[masked].mean())


def with_extras(setup):
    """(a fresh state, retrieve's keywords, the batch's own blocks, extra_ids [B, 2]): row b's
    second retriever's blocks are row b+1's own block and a block no query retrieves, each
    such block joining two rows (the trivial-retrieval exclusion and the deduplication)."""
    config, mesh, model, _, _, _, emb, _, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    kw = dict(model=model, mesh=mesh, cfg=step_cfg(config, len(emb)))
    own = batch["block_id"]
    _, _, _, plain = jax.jit(functools.partial(retrieval.retrieve, **kw))(
        state.params, sharding.global_batch(batch, mesh), *index
    )
    pool = [i for i in range(len(emb)) if i not in np.asarray(plain) and i not in own]
    pairs = np.asarray([pool[b // 2] for b in range(len(own))])
    return state, kw, own, np.stack([np.roll(own, -1), pairs], 1).astype(np.int32)


def embedded_apart(model, params, tokens, batch, index, kw):
    """(every block's embedding [N, D], the batch's query embeddings [B, D]) in float64,
    computed apart from the step: embed_doc of each block, `retrieve`'s query embedding."""
    from realm_jax.model.realm import RealmModel

    all_tok = jnp.asarray(tokens)
    d = model.apply(
        {"params": params},
        all_tok,
        inputs.block_segments(all_tok),
        (all_tok != 0).astype(jnp.int32),
        method=RealmModel.embed_doc,
    )
    q = jax.jit(functools.partial(retrieval.retrieve, **kw))(params, batch, *index)[0]
    return np.asarray(d, np.float64), np.asarray(q, np.float64)


def test_inbatch_negatives_loss_is_the_prior_over_the_batch_computed_by_hand(setup):
    """train.inbatch_negatives: REALM's loss with each query's prior normalised over its own K
    candidates and the batch's other retrieved blocks (deduplicated, none of its own
    candidates, not its own block), the reader's likelihood of those taken as the null
    document's, against numpy from materialised logits and embeddings computed apart
    (embed_doc of every block).
    The batch's extra blocks put another row's own block and a block repeated across rows among
    the candidates, so the trivial-retrieval exclusion and the deduplication both matter."""
    from realm_jax.model.realm import tied_decoder_logits

    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    state, kw, own, extra = with_extras(setup)
    B = len(own)
    g = sharding.global_batch(dict(batch, extra_ids=extra), mesh)
    _, _, rel, feats, table, bias, ids, cands = jax.jit(
        functools.partial(retrieval.retrieve_and_read, **kw)
    )(state.params, g, *index)
    ids, r = np.asarray(ids), np.asarray(rel, np.float64)
    logits = np.asarray(tied_decoder_logits(feats, table, bias), np.float64)  # [B, K, P, V]
    logits -= logits.max(-1, keepdims=True)
    log_py = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tgt, w = batch["mlm_targets"], batch["mlm_weights"]
    log_py = np.take_along_axis(log_py, tgt[:, None, :, None], -1)[..., 0]  # [B, K, P]
    d, q = embedded_apart(model, state.params, tokens, g, index, kw)
    total, n, excluded_own, mass = 0.0, 0.0, 0, []
    for b in range(B):
        mine = {int(i) for i in ids[b] if i >= 0}
        others = {int(i) for c in range(B) if c != b for i in ids[c] if i >= 0} - mine
        excluded_own += int(own[b] in others)
        others.discard(int(own[b]))
        s_out = np.array([q[b] @ d[i] for i in sorted(others)])
        scores = np.concatenate([r[b], s_out])
        log_z = np.log(np.exp(scores - scores.max()).sum()) + scores.max()
        mass.append(np.exp(s_out - log_z).sum() if len(s_out) else 0.0)
        for p in np.flatnonzero(w[b]):
            lik = np.exp(r[b] - log_z + log_py[b, :, p]).sum()
            lik += np.exp(s_out - log_z).sum() * np.exp(log_py[b, 0, p])  # read as the null
            total -= np.log(lik)
            n += 1
    assert excluded_own > 0  # another row's candidates held a query's own block
    kw["cfg"] = dataclasses.replace(kw["cfg"], inbatch_negatives=True)
    loss = jax.jit(functools.partial(pretrain_step.realm_loss, **kw))
    got, m = loss(state.params, g, *index)
    np.testing.assert_allclose(float(got), total / n, rtol=1e-4)
    np.testing.assert_allclose(float(m["inbatch_outside_mass"]), np.mean(mass), rtol=1e-4)
    assert np.mean(mass) > 0.01  # the other blocks hold a real share of the prior


@pytest.mark.system  # three step compiles (off by default); CI: the loss by hand (above)
def test_inbatch_negatives_in_the_compiled_step_one_pass_and_accumulated():
    """train.inbatch_negatives through compile_train_step on the sharded mesh: one pass gives
    realm_loss(inbatch=True)'s loss (checked against numpy above); with grad_accum=2 each
    micro-batch's queries (rows j, j + 2, ...) are each other's negatives: the loss is the
    target-weighted mean of the two micro-batches' own, the outside mass their mean."""
    off = ["model.embedder.dropout=0", "model.reader.dropout=0", "train.batch_size=16"]
    on = [*off, "train.inbatch_negatives=True"]
    one = tiny_config(*on)
    mesh = sharding.make_mesh(one.mesh)
    model, _, state, _ = pretrain_step.create_state(one, mesh, jax.random.key(0))
    emb, _, index, loss = index_and_loss(one, mesh, model)
    loss = jax.jit(loss)
    batch = synthetic_batch(one, seed=4)
    # the random-init retriever finds the same blocks for every query: each row gets a block
    # of its own (a second retriever's), so each query has in-batch negatives
    batch["extra_ids"] = np.arange(16)[:, None].astype(np.int32)
    want, m = loss(state.params, sharding.global_batch(batch, mesh), *index)
    parts = [
        loss(
            state.params,
            sharding.global_batch({k: v[j::2] for k, v in batch.items()}, mesh),
            *index,
        )[1]
        for j in (0, 1)
    ]
    n = [float(p["num_targets"]) for p in parts]
    loss2 = sum(w * float(p["loss"]) for w, p in zip(n, parts)) / sum(n)
    mass2 = np.mean([float(p["inbatch_outside_mass"]) for p in parts])
    assert float(m["inbatch_outside_mass"]) > mass2 > 0.01  # fewer negatives in a half batch
    got = {}  # each step donates its state: created afresh (the same seed) for each
    for name, config in (("one", one), ("two", tiny_config(*on, "train.grad_accum=2"))):
        model, opt, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
        fn = pretrain_step.compile_train_step(config, mesh, model, opt, shardings, len(emb))
        got[name] = jax.device_get(fn(state, sharding.global_batch(batch, mesh), *index, 0)[1])
    np.testing.assert_allclose(got["one"]["loss"], float(want), rtol=1e-5)
    np.testing.assert_allclose(
        got["one"]["inbatch_outside_mass"], float(m["inbatch_outside_mass"]), rtol=1e-5
    )
    np.testing.assert_allclose(got["two"]["loss"], loss2, rtol=1e-5)
    np.testing.assert_allclose(got["two"]["inbatch_outside_mass"], mass2, rtol=1e-5)


def test_imitation_term_is_the_softmax_over_the_batch_candidates_computed_by_hand(setup):
    """train.imitation_weight's term (imitation_term): each query's BM25 top block (extra_ids
    [:, 0]) as the positive of a softmax over the batch's candidate blocks, deduplicated, the
    query's own block excluded, against numpy from embeddings computed apart (embed_doc of
    every block). Row b's positive is row b+1's own block, so it is excluded there; a pool
    block joins two rows, so the deduplication matters."""

    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    state, kw, own, extra = with_extras(setup)
    B = len(own)
    extra[0, 0] = -1  # a sentence BM25 found nothing for: no term
    g = sharding.global_batch(dict(batch, extra_ids=extra), mesh)
    c = jax.jit(functools.partial(retrieval.retrieve_and_read, **kw))(state.params, g, *index)
    imitation = jax.jit(
        functools.partial(terms.imitation_term, c.q_emb, c.hits, c.ids),
        static_argnames="positives_only",
    )
    positive, own_ids = (jnp.asarray(x, c.ids.dtype) for x in (extra[:, 0], own))
    ids, (got_loss, got_acc) = np.asarray(c.ids), imitation(positive, own_ids)
    pos_loss, pos_acc = imitation(positive, own_ids, positives_only=True)
    d, q = embedded_apart(model, state.params, tokens, g, index, kw)

    def term(columns):
        ce, right = [], []
        for b in range(1, B):
            cols = [i for i in sorted(columns) if i != own[b]]
            s = np.array([q[b] @ d[i] for i in cols])
            pos = cols.index(int(extra[b, 0]))
            ce.append(np.log(np.exp(s - s.max()).sum()) + s.max() - s[pos])
            right.append(np.argmax(s) == pos)
        return np.mean(ce), np.mean(right)

    assert any(own[b] in ids[b - 1] for b in range(1, B))  # the own-block exclusion matters
    want = term({int(i) for i in ids.ravel() if i >= 0})
    np.testing.assert_allclose([float(got_loss), float(got_acc)], want, rtol=1e-4, atol=1e-6)
    # "positives": the batch's BM25 top blocks alone are the columns (the control's loss)
    want = term({int(i) for i in extra[:, 0] if i >= 0})
    np.testing.assert_allclose([float(pos_loss), float(pos_acc)], want, rtol=1e-4, atol=1e-6)
    assert float(pos_loss) < float(got_loss)  # fewer columns


@pytest.mark.system  # three gradients and a compile (off by default); CI: the term by hand
def test_imitation_weight_adds_its_gradient_and_its_control_stops_realms(setup):
    """realm_loss with imitation_weight w: REALM's loss plus w times the term, so the
    embedders' gradient is REALM's plus w times the term's; with retriever_grad=False (the
    in-step imitation control) it is the term's alone, and the reader's gradient is REALM's
    in all three. Then the compiled step with the config's options gives the same losses."""
    config, mesh, model, _, _, _, emb, _, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    batch = dict(batch, extra_ids=np.arange(len(batch["block_id"]))[:, None].astype(np.int32))
    g = sharding.global_batch(batch, mesh)
    kw = dict(model=model, mesh=mesh, cfg=step_cfg(config, len(emb), vocab_chunk=0))

    def grads(**opts):
        cfg = dataclasses.replace(kw["cfg"], **opts)
        fn = functools.partial(pretrain_step.realm_loss, **dict(kw, cfg=cfg))
        return jax.jit(jax.grad(lambda p: fn(p, g, *index), has_aux=True))(state.params)

    plain, m0 = grads()
    both, m1 = grads(imitation_weight=2.0)
    alone, m2 = grads(imitation_weight=2.0, retriever_grad=False)
    assert float(m1["imitation_loss"]) > 0 and float(m0["loss"]) == float(m1["loss"])
    for net in ("query_embedder", "doc_embedder"):
        for a, b, c in zip(*(jax.tree.leaves(x[net]) for x in (both, plain, alone)), strict=True):
            # float32 sums in another order in each compiled program: one element of 128
            # differed by 2.2e-5 once the MLM loss's rows became batch-major
            np.testing.assert_allclose(np.asarray(a) - np.asarray(b), c, atol=4e-5)
        assert optax_norm(alone[net]) > 0
    for a, b, c in zip(*(jax.tree.leaves(x["reader"]) for x in (plain, both, alone)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-6)
    on = tiny_config("train.bm25_candidates=1", "train.imitation_weight=2.0")
    model, opt, state, shardings = pretrain_step.create_state(on, mesh, jax.random.key(0))
    fn = pretrain_step.compile_train_step(on, mesh, model, opt, shardings, len(emb))
    got = jax.device_get(fn(state, g, *index, 0)[1])
    np.testing.assert_allclose(got["imitation_loss"], float(m1["imitation_loss"]), rtol=1e-5)
    np.testing.assert_allclose(got["loss"], float(m1["loss"]), rtol=1e-5)


def optax_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree))))


def test_realm_signal_is_the_posterior_minus_prior_computed_by_hand(setup):
    """realm_signal from dLoss/dRelevance (a zero offset on the scores, differentiated with the
    parameters in train_step) against posterior - prior from materialised logits in numpy:
    per query and candidate, the mean over its masked wordpieces of p(z|x,y_p) - p(z|x)."""
    from realm_jax.model.realm import tied_decoder_logits

    config, mesh, model, _, _, _, emb, tokens, index, batch = setup
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    kw = dict(model=model, mesh=mesh, cfg=step_cfg(config, len(emb)))
    g = sharding.global_batch(batch, mesh)
    _, _, rel, feats, table, bias, ids, cands = jax.jit(
        functools.partial(retrieval.retrieve_and_read, **kw)
    )(state.params, g, *index)
    logits = np.asarray(tied_decoder_logits(feats, table, bias), np.float64)  # [B, K, P, V]
    logits -= logits.max(-1, keepdims=True)
    log_py = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tgt, w = batch["mlm_targets"], batch["mlm_weights"]
    log_py = np.take_along_axis(log_py, tgt[:, None, :, None], -1)[..., 0]  # [B, K, P]
    r = np.asarray(rel, np.float64)
    prior = np.exp(r - r.max(1, keepdims=True))
    prior /= prior.sum(1, keepdims=True)  # [B, K]
    joint = prior[:, :, None] * np.exp(log_py)
    post = joint / joint.sum(1, keepdims=True)  # [B, K, P]
    want = ((post - prior[:, :, None]) * w[:, None, :]).sum(-1) / np.maximum(w.sum(-1), 1)[:, None]

    def loss(offset):
        b = dict(g, relevance_offset=offset)
        return pretrain_step.realm_loss(state.params, b, *index, **kw)

    (_, metrics), d_rel = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.zeros(r.shape))
    got = -np.asarray(d_rel, np.float64) * max(w.sum(), 1) / np.maximum(w.sum(-1), 1)[:, None]
    np.testing.assert_allclose(got, want, atol=2e-5)
    holds = np.asarray(metrics["candidate_holds"])
    doc = np.asarray(ids)[:, 0].astype(np.int32)  # each query's first hit as "its document"
    sig = measures.realm_signal(d_rel, dict(metrics), jnp.asarray(w), jnp.asarray(doc))
    has = holds.any(1) & (w.sum(-1) > 0)
    if has.any():
        span = (want[:, 1:] * holds).sum(1)[has].mean()
        np.testing.assert_allclose(float(sig["signal_span"]), span, atol=2e-5)
    np.testing.assert_allclose(float(sig["signal_doc"]), want[w.sum(-1) > 0, 1].mean(), atol=2e-5)
