"""A second retriever's candidates (train.bm25_candidates, ict.positives=bm25): the span query,
BM25's top blocks against a plain-Python Lucene BM25, the own block excluded, the file kept
with its prepare, and the batches that carry them."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import pytest
from bm25s.stopwords import STOPWORDS_EN

from realm_jax import tokenization as tk
from realm_jax.data import datasets, pipeline
from realm_jax.data import ict as ict_data
from realm_jax.data import span_candidates as sc
from realm_jax.index import bm25_candidates
from tests.conftest import prepare_sample_head
from tests.support.realm_fixtures import tiny_config

DEPTH = 3


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    return prepare_sample_head(tmp_path_factory, tiny_config, 40)


@pytest.fixture(scope="module")
def cands(ddir):
    return bm25_candidates.ensure(ddir, DEPTH)


def test_span_query_drops_the_span_and_the_specials():
    tok = tk.load_tokenizer()
    words = tok.encode("the eiffel tower stands in paris", add_special_tokens=False).ids
    ids = [tk.CLS_ID, *words, tk.SEP_ID, 0, 0]
    paris = 1 + words.index(tok.token_to_id("paris"))
    assert sc.span_query(ids, paris, paris, tok) == "the eiffel tower stands in"
    eiffel = len(tok.encode("the eiffel", add_special_tokens=False).ids)  # 1 + its pieces
    assert eiffel > 2  # several wordpieces, all of the span's
    assert sc.span_query(ids, 2, eiffel, tok) == "the tower stands in paris"
    # a span that ends inside a word glues nothing across it
    assert sc.span_query(ids, 2, 2, tok).startswith("the ")


def _lucene(texts: list[str], query: str, k1: float = 0.9, b: float = 0.4) -> np.ndarray:
    """Lucene BM25 over bm25s's tokens (runs of 2+ word characters, its English stopwords)."""

    def words(t):
        return [w for w in re.findall(r"\w\w+", t.lower()) if w not in STOPWORDS_EN]

    docs = [Counter(words(t)) for t in texts]
    lens = np.asarray([sum(d.values()) for d in docs], np.float64)
    out = np.zeros(len(docs))
    for term in words(query):
        df = sum(term in d for d in docs)
        if df:
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            tf = np.asarray([d[term] for d in docs], np.float64)
            out += idf * tf / (tf + k1 * (1 - b + b * lens / lens.mean()))
    return out


def test_candidates_are_bm25s_best_for_each_span_less_the_own_block(ddir, cands):
    src = datasets.examples_source(ddir)
    texts = bm25_candidates.block_texts(ddir)
    recs = [src[i] for i in range(len(src))]
    assert cands.ids.shape == (sum(len(r["span_starts"]) for r in recs), DEPTH)
    np.testing.assert_array_equal(cands.example_ids, [int(r["example_id"]) for r in recs])
    checked = 0
    for r in recs[:25]:
        for s, (a, b) in enumerate(zip(r["span_starts"], r["span_ends"], strict=True)):
            got = cands.lookup(int(r["example_id"]), s)
            own = int(r["block_id"])
            assert own not in got.tolist()  # the trivial retrieval, excluded as dense's
            ref = _lucene(texts, sc.span_query(r["token_ids"], int(a), int(b)))
            if own >= 0:
                ref[own] = -np.inf
            best = np.sort(ref)[::-1][:DEPTH]
            found = got[got >= 0]
            np.testing.assert_allclose(ref[found], best[: len(found)], rtol=1e-4, atol=1e-5)
            assert (best[len(found) :] <= 0).all()  # only zero-score blocks left out
            checked += 1
    assert checked > 25


def test_candidates_are_kept_with_their_prepare_and_reused(ddir, cands, monkeypatch):
    summary = datasets.load_summary(ddir)
    again = sc.load(ddir, "train", summary, "bm25", DEPTH)
    np.testing.assert_array_equal(again.ids, cands.ids)
    shallow = sc.load(ddir, "train", summary, "bm25", 1)  # a deeper file serves a shallower ask
    np.testing.assert_array_equal(shallow.ids, cands.ids[:, :1])
    assert sc.load(ddir, "train", summary, "bm25", DEPTH + 1) is None  # deeper: made anew
    other = dict(summary, created=summary["created"] + 1)  # another prepare of the folder
    assert sc.load(ddir, "train", other, "bm25", DEPTH) is None

    def no_build(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(bm25_candidates, "build", no_build)
    np.testing.assert_array_equal(bm25_candidates.ensure(ddir, 2).ids, cands.ids[:, :2])


def test_a_damaged_file_names_itself_and_the_remedy(ddir, cands, tmp_path):
    import shutil

    copy = tmp_path / "prepared"
    shutil.copytree(ddir, copy)
    arrays, _ = sc.paths(str(copy), "train")
    with open(arrays, "r+b") as f:
        f.truncate(100)
    with pytest.raises(datasets.PrepareError, match=r"train\.npz is damaged.*delete"):
        sc.load(str(copy), "train", datasets.load_summary(str(copy)), "bm25", DEPTH)


def test_batches_carry_the_candidates_of_the_span_they_mask(ddir, cands):
    config = tiny_config()
    loader = pipeline.train_loader(config, ddir, global_batch_size=8, seed=0, extra=cands)
    src = datasets.examples_source(ddir)
    batch = next(iter(loader))
    assert batch["extra_ids"].shape == (8, DEPTH)
    for row in range(8):
        rec = src[int(batch["example_id"][row])]
        span = list(rec["span_starts"]).index(int(batch["mlm_positions"][row, 0]))
        want = cands.lookup(int(rec["example_id"]), span)
        np.testing.assert_array_equal(batch["extra_ids"][row], want)


def test_imitation_pairs_are_masked_sentences_with_bm25s_top_block(ddir, cands):
    config = tiny_config()
    tokens, _, _ = datasets.load_blocks(ddir)
    src = datasets.examples_source(ddir)
    pair = ict_data.ImitationPair(config.data.query_len, config.data.max_predictions, cands, tokens)
    rec = src[3]
    out = pair.random_map(rec, np.random.default_rng(0))
    masked = np.flatnonzero(out["query_ids"] == tk.MASK_ID)
    span = list(rec["span_starts"]).index(int(masked[0]))
    top = cands.lookup(int(rec["example_id"]), span)[0]
    np.testing.assert_array_equal(out["block_ids"], tokens[top])


def test_bm25_candidates_need_salient_masks():
    from realm_jax.config import ConfigError, validate

    validate(tiny_config("train.bm25_candidates=2"))
    bad = tiny_config("train.bm25_candidates=2", "data.mask_mode=uniform")
    with pytest.raises(ConfigError, match="train.bm25_candidates=2: needs data.mask_mode=salient"):
        validate(bad)
    with pytest.raises(ConfigError, match="needs data.mask_mode=salient"):  # the loader too
        pipeline.MaskSpan(8, 2, "uniform", extra=object())


def test_imitation_term_needs_bm25_candidates_and_a_gradient_for_the_embedders():
    from realm_jax.config import ConfigError, validate

    validate(tiny_config("train.bm25_candidates=1", "train.imitation_weight=0.5"))
    with pytest.raises(ConfigError, match="imitation_weight=0.5: needs train.bm25_candidates"):
        validate(tiny_config("train.imitation_weight=0.5"))
    with pytest.raises(ConfigError, match="no gradient at all"):
        validate(tiny_config("train.bm25_candidates=1", "train.realm_retriever_grad=False"))
    with pytest.raises(ConfigError, match="train.imitation_negatives='hard': must be one of"):
        validate(tiny_config("train.bm25_candidates=1", "train.imitation_negatives=hard"))
    with pytest.raises(ConfigError, match="train.imitation_weight=-1.0: must be at least 0"):
        validate(tiny_config("train.bm25_candidates=1", "train.imitation_weight=-1.0"))


def test_article_blocks_hold_the_span_in_the_sentences_article(ddir, cands):
    """The copying curriculum's block of each (sentence, span): of the sentence's title, not
    its own block, holding the span's wordpieces as one run; -1 only where no such block is."""
    src = datasets.examples_source(ddir)
    tokens, _, titles = datasets.load_blocks(ddir)

    def run_in(row, piece):
        return any(np.array_equal(row[i : i + len(piece)], piece) for i in range(len(row)))

    have = 0
    for r in (src[i] for i in range(len(src))):
        for s, (a, b) in enumerate(zip(r["span_starts"], r["span_ends"], strict=True)):
            got = int(cands.article[cands.row(int(r["example_id"]), s)])
            piece = np.asarray(r["token_ids"][int(a) : int(b) + 1])
            title, own = r["title"].decode(), int(r["block_id"])
            if got >= 0:
                have += 1
                assert titles[got] == title and got != own and run_in(tokens[got], piece)
            else:
                same = [i for i, t in enumerate(titles) if t == title and i != own]
                assert not any(run_in(tokens[i], piece) for i in same)
    assert have > 0
    assert cands.meta["article_blocks"] == int((cands.article >= 0).sum())


def test_batches_carry_the_article_block_of_the_span_they_mask(ddir, cands):
    loader = pipeline.train_loader(tiny_config(), ddir, global_batch_size=8, seed=0, extra=cands)
    src = datasets.examples_source(ddir)
    batch = next(iter(loader))
    for row in range(8):
        rec = src[int(batch["example_id"][row])]
        span = list(rec["span_starts"]).index(int(batch["mlm_positions"][row, 0]))
        want = cands.article[cands.row(int(rec["example_id"]), span)]
        assert batch["article_block"][row] == want
    none = pipeline.train_loader(
        tiny_config(), ddir, global_batch_size=8, seed=0, extra=cands.truncated(0)
    )
    assert "extra_ids" not in next(iter(none))  # article blocks alone: no BM25 candidates
