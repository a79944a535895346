"""The release's TF checkpoints imported by realm-jax compute what transformers computes from
them: embeddings, retrieval scores, MLM logits, the reader's hidden states and span logits,
ORQA's losses and best span, to 1e-4 (max abs difference).

tests/fixtures/release/reference/outputs.npz is the independent reference: transformers'
REALM (torch) with each fixture checkpoint loaded by transformers' own load_tf_weights_in_realm
through TensorFlow, on the fixed inputs stored beside the outputs
(tests/fixtures/release/reference/make_outputs.py, run in the side venv .venv-tfpeer; outputs.json
says what each array is and the versions). This side reads the same checkpoints as `realm-jax
import` does (interop.read_source: no TensorFlow, no torch) and runs realm-jax's own forward
functions: the embedder, `ask`'s query embedding and brute-force top-k, the reader's MLM and span
heads, ORQA's losses.

The reference for bert/ comes from a copy without BERT's next-sentence head: transformers'
loader cannot load that checkpoint as it stands (outputs.json, "load_failures"; the script's
docstring says why), and realm-jax drops the head too.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.config import load_config
from realm_jax.index.embedding import embed_query_tokens
from realm_jax.interop import commands as interop
from realm_jax.model.bert import ModelConfig
from realm_jax.model.realm import Embedder, Reader, realm_model
from realm_jax.ops import mips
from realm_jax.qa import losses
from tests.conftest import REPO

FIX = os.path.join(REPO, "tests", "fixtures", "release")
REF = os.path.join(FIX, "reference", "outputs.npz")
SMOKE = os.path.join(REPO, "configs", "orqa.py") + ":smoke"
ATOL = 1e-4
NEG = -1e30  # spans outside the block score float32's minimum on both sides


def _overrides() -> list[str]:
    """The fixtures' architecture (the RealmConfig of
    tests/fixtures/release/reference/make_outputs.py)."""
    out = [
        "model.vocab_size=100",
        "model.proj_size=12",
        "model.span_hidden_size=6",
        "model.max_span_width=10",
    ]
    for part in ("embedder", "reader"):
        for k, v in dict(
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            intermediate_size=36,
            max_position_embeddings=24,
            type_vocab_size=2,
            hidden_act="gelu_new",
        ).items():
            out.append(f"model.{part}.{k}={v}")
    return out


@pytest.fixture(scope="module")
def ref():
    if not os.path.exists(REF):
        pytest.skip(
            f"needs {REF}: run tests/fixtures/release/reference/make_outputs.py in .venv-tfpeer "
            "(its docstring says how to build that venv)"
        )
    with np.load(REF) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def config():
    return load_config(SMOKE, _overrides())


@pytest.fixture(scope="module")
def sources(config):
    """Each fixture folder read as `realm-jax import --source FOLDER` reads it."""
    out = {
        n: interop.read_source(os.path.join(FIX, n), config) for n in ("embedder", "bert", "orqa")
    }
    interop.check_sources(config, list(out.values()))
    return out


def _close(got, want, what: str) -> float:
    """Max abs difference of got and want (the entries want masks with float32's minimum
    must be masked in got too); fails above ATOL."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    valid = want > NEG
    np.testing.assert_array_equal(got > NEG, valid, err_msg=f"{what}: masked entries differ")
    err = float(np.abs(got - want)[valid].max())
    assert err <= ATOL, f"{what}: max abs difference {err:.3g} > {ATOL}"
    return err


def _embed(config, params, ids, mask, types):
    cfg = ModelConfig.from_config(config.model, "embedder")
    return Embedder(cfg).apply({"params": params}, ids, types, mask)


def _spans(config, params, ref):
    cfg = ModelConfig.from_config(config.model, "reader")
    return Reader(cfg).apply(
        {"params": params},
        ref["reader_ids"],
        ref["reader_type_ids"],
        ref["reader_mask"],
        ref["reader_block_mask"],
        method=Reader.span_logits,
    )


def test_the_reference_is_transformers_own_load(ref):
    """What the reference is made of, as outputs.json records it."""
    with open(os.path.splitext(REF)[0] + ".json") as f:
        meta = json.load(f)
    assert meta["versions"]["transformers"] == "4.57.6"
    assert set(meta["load_failures"]) == {"bert"}  # only bert/ needed the copy
    assert meta["bert_left_out_of_the_copy"] == [
        "cls/seq_relationship/output_bias",
        "cls/seq_relationship/output_weights",
    ]
    # every loaded model's parameters came from the checkpoint but the untied MLM decoders,
    # which no output here reads
    for names in meta["not_loaded"].values():
        assert all(n.endswith("cls.predictions.decoder.weight") for n in names), names


def test_embedder_embeddings(config, sources, ref):
    """embedder/ (cc_news_pretrained/embedder): RealmEmbedder's projected embeddings."""
    params = sources["embedder"].got.query_embedder
    got = _embed(config, params, ref["emb_ids"], ref["emb_mask"], ref["emb_type_ids"])
    _close(got, ref["emb_projected"], "embedder projection")


def test_scorer_relevance(config, sources, ref):
    """embedder/ as RealmScorer: query and candidate embeddings, relevance = their dots."""
    params = sources["embedder"].got.query_embedder
    q = _embed(
        config,
        params,
        ref["scorer_query_ids"],
        ref["scorer_query_mask"],
        ref["scorer_query_type_ids"],
    )
    b, k, n = ref["scorer_cand_ids"].shape
    d = _embed(
        config,
        params,
        *(ref[f"scorer_cand_{x}"].reshape(b * k, n) for x in ("ids", "mask", "type_ids")),
    ).reshape(b, k, -1)
    _close(q, ref["scorer_query_score"], "scorer query")
    _close(d, ref["scorer_candidate_score"], "scorer candidates")
    _close(jnp.einsum("bd,bkd->bk", q, d), ref["scorer_relevance"], "scorer relevance")


def test_mlm_logits(config, sources, ref):
    """bert/ (cc_news_pretrained/bert): RealmKnowledgeAugEncoder's MLM logits, every position."""
    assert sources["bert"].got.cls == "RealmKnowledgeAugEncoder"
    n, length = ref["mlm_ids"].shape
    positions = np.tile(np.arange(length), (n, 1))
    got = Reader(ModelConfig.from_config(config.model, "reader")).apply(
        {"params": sources["bert"].got.reader},
        ref["mlm_ids"],
        ref["mlm_type_ids"],
        ref["mlm_mask"],
        positions,
        method=Reader.mlm_logits,
    )
    _close(got, ref["mlm_logits"], "MLM logits")


def test_query_embeddings_and_retrieval(config, sources, ref):
    """orqa/'s query embedder as `ask` runs it (token type 0, mask from the ids) and its
    retrieval over the block embeddings: scores and the top blocks."""
    ids = ref["qa_query_ids"]
    assert (ref["qa_query_mask"] == (ids != 0)).all() and not ref["qa_query_type_ids"].any()
    q = embed_query_tokens(
        realm_model(config.model), {"query_embedder": sources["orqa"].got.query_embedder}, ids
    )
    _close(q, ref["qa_query_emb"], "ORQA query embeddings")
    emb, _ = interop.read_index(list(sources.values()), os.path.join(FIX, "embedder"))
    np.testing.assert_array_equal(emb, ref["qa_block_emb"])  # the same block_emb, bit for bit
    _close(np.asarray(q) @ emb.T, ref["qa_scores"], "retrieval scores")
    k = ref["qa_top_ids"].shape[1]
    scores, top = mips.brute_force(q, jnp.asarray(emb), jnp.full((len(ids),), -1), k=k)
    np.testing.assert_array_equal(top, ref["qa_top_ids"])
    _close(scores, ref["qa_top_scores"], "top-k scores")


def _hidden(config, params, ref):
    """The reader BERT's last hidden states [N, L, H] (what the span head reads)."""
    cfg = ModelConfig.from_config(config.model, "reader")
    return Reader(cfg).apply(
        {"params": params},
        ref["reader_ids"],
        ref["reader_type_ids"],
        ref["reader_mask"],
        method=lambda m, *a: m.bert(*a)[0],
    )


def test_reader_span_logits(config, sources, ref):
    """orqa/'s reader: its BERT's output, the span head's logits of every candidate span,
    and the spans."""
    _close(_hidden(config, sources["orqa"].got.reader, ref), ref["reader_hidden"], "reader BERT")
    logits, starts, ends = _spans(config, sources["orqa"].got.reader, ref)
    np.testing.assert_array_equal(starts, ref["reader_starts"])
    np.testing.assert_array_equal(ends, ref["reader_ends"])
    _close(logits, ref["reader_span_logits"], "span logits")


def test_reader_losses_and_prediction(config, sources, ref):
    """RealmReader.forward's losses and best span, from realm-jax's span logits and ORQA
    losses with the retrieval scores realm-jax computes for the first question."""
    q = embed_query_tokens(
        realm_model(config.model),
        {"query_embedder": sources["orqa"].got.query_embedder},
        ref["qa_query_ids"][:1],
    )
    emb, _ = interop.read_index([sources["orqa"]], os.path.join(FIX, "embedder"))
    rel = (np.asarray(q) @ emb[ref["qa_top_ids"][0]].T)[0]
    _close(rel, ref["reader_relevance"], "reader relevance")
    logits, starts, ends = _spans(config, sources["orqa"].got.reader, ref)
    gold = ref["reader_gold_starts"], ref["reader_gold_ends"]
    total, retriever, reader = losses.orqa_losses(
        rel, logits, starts, ends, *gold, ref["reader_has_answers"]
    )
    np.testing.assert_array_equal(losses.correct_spans(starts, ends, *gold), ref["reader_correct"])
    _close(retriever, ref["reader_retriever_loss"], "retriever loss")
    _close(reader, ref["reader_reader_loss"], "reader loss")
    _close(total, ref["reader_loss"], "loss")
    joint = np.asarray(logits) + rel[:, None]
    block, cand = np.unravel_index(np.argmax(joint), joint.shape)
    assert (block, cand) == (ref["reader_block_idx"][0], ref["reader_candidate"][0])
    assert (starts[cand], ends[cand]) == (ref["reader_start_pos"][0], ref["reader_end_pos"][0])


def test_a_wrong_mapping_would_fail(config, sources, ref):
    """The comparison has teeth. The fixtures' large random weights saturate much of the
    networks (reordering the last layer's query or key kernel moves the span logits by less
    than 1e-4), so each part is compared where a wrong mapping shows: here the last layer's
    query kernel transposed moves the reader's hidden states, and swapped token types the
    embeddings, far past the tolerance."""
    bad = _edited(sources["orqa"].got.reader)
    query = bad["bert"]["layer_1"]["attention"]["query"]
    shape = query["kernel"].shape  # [H, heads, head_dim]
    query["kernel"] = query["kernel"].reshape(shape[0], -1).T.reshape(shape)
    got = np.asarray(_hidden(config, bad, ref))
    assert np.abs(got - ref["reader_hidden"]).max() > 10 * ATOL

    bad = _edited(sources["embedder"].got.query_embedder)
    emb = bad["bert"]["embeddings"]
    emb["token_type_embeddings"] = emb["token_type_embeddings"][::-1]
    got = np.asarray(_embed(config, bad, ref["emb_ids"], ref["emb_mask"], ref["emb_type_ids"]))
    assert np.abs(got - ref["emb_projected"]).max() > 10 * ATOL


def _edited(tree):
    """A copy of a nested dict of arrays whose dicts may be edited (the arrays shared)."""
    return {k: _edited(v) if isinstance(v, dict) else v for k, v in tree.items()}
