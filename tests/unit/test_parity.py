"""Parity with HuggingFace transformers' BERT and REALM (../shared/reference).

Every array compared here was produced by an independent implementation (see the reference
README); tolerance 1e-4 absolute in float32 (1e-6 relative for magnitudes above 10).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.interop import hf_import as weights
from realm_jax.model.bert import ModelConfig
from realm_jax.model.realm import Embedder, Reader
from realm_jax.pretrain import losses
from realm_jax.qa import losses as qa_losses
from tests.conftest import shared_path

ATOL = 1e-4


def close(a, b, atol=ATOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = np.maximum(atol, 1e-6 * np.abs(b))
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b)
    assert (err <= tol).all(), f"max abs err {err.max():.3g}"


def _cfg(fields):
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def bert_tiny():
    path = shared_path("models", "bert-tiny-mlm")
    ref = np.load(shared_path("reference", "bert_tiny_mlm_reference.npz"))
    params, fields = weights.reader_params(path)
    return Reader(_cfg(fields)), {"params": params}, ref


def test_bert_embeddings_hidden_and_mlm(bert_tiny):
    model, variables, ref = bert_tiny
    ids, mask, seg = (
        jnp.asarray(ref[k]) for k in ("input_ids", "attention_mask", "token_type_ids")
    )
    emb = model.apply(variables, ids, seg, method=lambda m, i, s: m.bert.embeddings(i, s))
    close(emb, ref["embedding_output"])
    hidden, _ = model.apply(variables, ids, seg, mask, method=lambda m, *a: m.bert(*a))
    valid = np.asarray(mask, bool)
    close(np.asarray(hidden)[valid], ref["last_hidden_state"][valid])
    rows, cols = ref["mask_positions"][:, 0], ref["mask_positions"][:, 1]
    logits = model.apply(
        variables,
        ids[rows],
        seg[rows],
        mask[rows],
        jnp.asarray(cols)[:, None],
        method=Reader.mlm_logits,
    )
    close(logits[:, 0], ref["mlm_logits_at_mask"])


@pytest.fixture(scope="module")
def realm_ref():
    return np.load(shared_path("reference", "tiny_realm", "reference.npz"))


@pytest.fixture(scope="module")
def embedder(realm_ref):
    params, fields = weights.embedder_params(shared_path("reference", "tiny_realm", "embedder"))
    return Embedder(_cfg(fields)), {"params": params}


def _relevance(embedder, r):
    model, variables = embedder
    q = model.apply(
        variables,
        jnp.asarray(r["query_ids"]),
        jnp.zeros_like(r["query_ids"]),
        jnp.asarray(r["query_mask"]),
    )
    d = model.apply(
        variables,
        jnp.asarray(r["doc_ids"]),
        jnp.asarray(r["doc_type_ids"]),
        jnp.asarray(r["doc_mask"]),
    )
    return q, d, jnp.einsum("bd,bkd->bk", q, d.reshape(q.shape[0], -1, d.shape[-1]))


def test_realm_embedder_projections_and_relevance(embedder, realm_ref):
    q, d, rel = _relevance(embedder, realm_ref)
    close(q, realm_ref["query_projected"])
    close(d, realm_ref["doc_projected"])
    close(rel, realm_ref["relevance_score"])


def test_realm_encoder_logits_and_marginal_loss(embedder, realm_ref):
    r = realm_ref
    params, fields = weights.reader_params(shared_path("reference", "tiny_realm", "encoder"))
    model = Reader(_cfg(fields))
    labels = r["mlm_labels"]  # [B, L], -100 where no target
    B, L = labels.shape
    K = r["joint_ids"].shape[0] // B
    # Targets as (positions, targets, weights), padded to P per query.
    P = int((labels != -100).sum(1).max())
    pos = np.zeros((B, P), np.int32)
    tgt = np.zeros((B, P), np.int32)
    w = np.zeros((B, P), np.float32)
    for b in range(B):
        idx = np.nonzero(labels[b] != -100)[0]
        pos[b, : len(idx)], tgt[b, : len(idx)], w[b, : len(idx)] = idx, labels[b, idx], 1
    logits = model.apply(
        {"params": params},
        jnp.asarray(r["joint_ids"]),
        jnp.asarray(r["joint_type_ids"]),
        jnp.asarray(r["joint_mask"]),
        jnp.asarray(np.repeat(pos, K, axis=0)),
        method=Reader.mlm_logits,
    )
    logits = logits.reshape(B, K, P, -1)
    got = [logits[b, :, p] for b in range(B) for p in range(P) if w[b, p]]
    close(np.stack(got), r["encoder_logits_at_labels"])
    _, _, rel = _relevance(embedder, r)
    loss, metrics = losses.marginal_loss(rel, logits, jnp.asarray(tgt), jnp.asarray(w))
    close(loss, r["encoder_loss"])
    assert np.isfinite(float(metrics["retrieval_utility"]))


def test_realm_reader_span_logits_and_losses(realm_ref):
    r = realm_ref
    params, fields = weights.reader_params(shared_path("reference", "tiny_realm", "reader"))
    model = Reader(_cfg(fields))
    span_logits, starts, ends = model.apply(
        {"params": params},
        jnp.asarray(r["reader_ids"]),
        jnp.asarray(r["reader_type_ids"]),
        jnp.asarray(r["reader_mask"]),
        jnp.asarray(r["reader_block_mask"]),
        method=Reader.span_logits,
    )
    np.testing.assert_array_equal(starts, r["reader_span_starts"])
    np.testing.assert_array_equal(ends, r["reader_span_ends"])
    ref_logits = r["reader_span_logits"]
    valid = ref_logits > -1e30
    np.testing.assert_array_equal(np.asarray(span_logits) > -1e30, valid)
    close(np.asarray(span_logits)[valid], ref_logits[valid])
    total, retr, read = qa_losses.orqa_losses(
        jnp.asarray(r["reader_relevance"]),
        span_logits,
        starts,
        ends,
        jnp.asarray([[12], [12], [15], [15]]),
        jnp.asarray([[13], [13], [15], [15]]),
        jnp.asarray([True, False, True, False]),
    )
    close(retr, r["reader_retriever_loss"])
    close(read, r["reader_reader_loss"])
    close(total, r["reader_loss"])


def test_import_errors_name_the_tensor(tmp_path):
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    src = shared_path("reference", "tiny_realm", "embedder")
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    t = load_file(f"{src}/model.safetensors")
    del t["realm.encoder.layer.1.output.dense.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        weights.WeightImportError, match="realm.encoder.layer.1.output.dense.weight"
    ):
        weights.embedder_params(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00")  # truncated
    with pytest.raises(weights.WeightImportError, match="cannot read safetensors"):
        weights.embedder_params(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(weights.WeightImportError, match="pickles are never loaded"):
        weights.embedder_params(str(tmp_path))
    json.loads((tmp_path / "config.json").read_text())


def test_tokenizer_matches_hf_tokenizer_ids():
    from realm_jax import tokenization

    ref = np.load(shared_path("reference", "bert_tiny_mlm_reference.npz"))
    sents = [
        "The capital of France is [MASK].",
        "Denver Broncos won [MASK] 50 in February 2016 at Levi's Stadium.",
    ]
    enc = tokenization.wordpieces(sents)
    for e, row in zip(enc, ref["input_ids"]):
        want = [int(i) for i in row if i != 0]
        assert tokenization.query_ids(e.ids, 64) == want
