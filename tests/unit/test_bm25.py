"""BM25 baseline: scores against an independent formula, exclusion, bad k, recall@k."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import pytest
from bm25s.stopwords import STOPWORDS_EN

from realm_jax.index.bm25 import BM25Retriever, recall_at_k

TEXTS = [
    "Paris\nParis is the capital of France",
    "Berlin\nBerlin is the capital of Germany",
    "France\nFrance borders Germany Spain Italy Belgium",
    "River Seine\nThe Seine flows through Paris",
    "Rhine\nThe Rhine flows through Germany France Switzerland Netherlands",
    "Cooking\nBaguette bread croissant butter",
]
QUERIES = [
    "capital of France",
    "Seine Paris river",
    "Germany France flows",
    "quantum physics",  # no indexed term
    "the of",  # only stopwords
]
# The only stopwords in TEXTS / QUERIES; every other word is checked not to be one below.
STOP = {"the", "of", "is"}


def _tok(text: str) -> list[str]:
    return [w for w in re.findall(r"\w\w+", text.lower()) if w not in STOP]


def _reference_scores(query: str, k1: float, b: float) -> np.ndarray:
    """Lucene BM25 (Lucene >= 8, as bm25s's "lucene": no (k1 + 1) factor), in plain Python."""
    docs = [Counter(_tok(t)) for t in TEXTS]
    lens = [sum(d.values()) for d in docs]
    n, avgdl = len(docs), sum(lens) / len(docs)
    out = np.zeros(n)
    for term in _tok(query):
        df = sum(term in d for d in docs)
        if df == 0:
            continue
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        for i, d in enumerate(docs):
            tf = d[term]
            out[i] += idf * tf / (tf + k1 * (1 - b + b * lens[i] / avgdl))
    return out


def test_tokenisation_assumptions():
    words = {w for t in TEXTS + QUERIES for w in re.findall(r"\w\w+", t.lower())}
    assert STOP <= set(STOPWORDS_EN)
    assert not (words - STOP) & set(STOPWORDS_EN)


@pytest.mark.parametrize("k1,b", [(0.9, 0.4), (1.5, 0.75)])
def test_scores_match_reference(k1, b):
    r = BM25Retriever(TEXTS, k1=k1, b=b)
    n = len(TEXTS)
    ids, scores = r.search(QUERIES, k=n)
    assert ids.shape == scores.shape == (len(QUERIES), n)
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    for qi, query in enumerate(QUERIES):
        ref = _reference_scores(query, k1, b)
        # Best first; ties (the zero-score blocks) by block id.
        expected = np.lexsort((np.arange(n), -ref))
        np.testing.assert_array_equal(ids[qi], expected, err_msg=query)
        np.testing.assert_allclose(scores[qi], ref[expected], rtol=1e-5, err_msg=query)
    # A smaller k gives a prefix (the matching blocks; zero-score fillers may be any blocks).
    ids3, scores3 = r.search(QUERIES, k=3)
    np.testing.assert_allclose(scores3, scores[:, :3], rtol=1e-6)
    pos = scores3 > 0
    np.testing.assert_array_equal(ids3[pos], ids[:, :3][pos])


def test_default_parameters_and_no_term_queries():
    r = BM25Retriever(TEXTS)
    assert (r.k1, r.b, len(r)) == (0.9, 0.4, len(TEXTS))
    ids, scores = r.search(["quantum physics", "the of", ""], k=4)
    assert ids.shape == (3, 4)
    assert (scores == 0).all()
    for row in ids:
        assert len(set(row.tolist())) == 4 and ((row >= 0) & (row < len(TEXTS))).all()
    ids0, scores0 = r.search([], k=2)
    assert ids0.shape == scores0.shape == (0, 2)


def test_exclude():
    r = BM25Retriever(TEXTS)
    n = len(TEXTS)
    queries = ["Paris", "Paris", "Germany", "quantum", "Rhine"]
    exclude = [0, -1, 2, 5, 1]
    plain, plain_scores = r.search(queries, k=3)
    assert plain[0, 0] == 0 and plain[2, 0] in (1, 2, 4)
    for k in (1, 3, n - 1):
        ids, scores = r.search(queries, k=k, exclude=exclude)
        assert ids.shape == scores.shape == (len(queries), k)
        for qi, e in enumerate(exclude):
            assert e not in ids[qi].tolist()
            assert len(set(ids[qi].tolist())) == k
            assert (np.diff(scores[qi]) <= 0).all()
        # -1 means no exclusion, and excluding a block with score 0 (block 1 for "Rhine") leaves
        # the matching blocks' ranking unchanged (zero-score fillers may be any blocks).
        full, full_scores = r.search(queries, k=k)
        for qi in (1, 4):
            pos = full_scores[qi] > 0
            np.testing.assert_array_equal(ids[qi][pos], full[qi][pos])
            np.testing.assert_allclose(scores[qi], full_scores[qi])
    # k = n - 1 with exclusion returns every other block.
    ids, _ = r.search(queries, k=n - 1, exclude=exclude)
    for qi, e in enumerate(exclude):
        if e >= 0:
            assert sorted(ids[qi].tolist()) == [i for i in range(n) if i != e]
    # After dropping block 0, query "Paris" ranks block 3 first (its only other match).
    ids, scores = r.search(["Paris"], k=2, exclude=[0])
    assert ids[0, 0] == 3 and scores[0, 0] > 0 and scores[0, 1] == 0


def test_bad_k_and_exclude():
    r = BM25Retriever(TEXTS)
    n = len(TEXTS)
    for k, exclude in [(0, None), (-1, None), (n + 1, None), (n, [0]), (0, [0])]:
        with pytest.raises(ValueError, match=rf"k={k}\b.*{n} blocks"):
            r.search(["Paris"], k=k, exclude=exclude)
    r.search(["Paris"], k=n)  # the largest valid k
    with pytest.raises(ValueError, match="exclude"):
        r.search(["Paris", "Berlin"], k=2, exclude=[0])
    with pytest.raises(ValueError, match="exclude"):
        r.search(["Paris"], k=2, exclude=[n])
    with pytest.raises(ValueError):
        BM25Retriever([])


def test_recall_at_k():
    retrieved = np.array(
        [
            [3, 1, 2, 0, 4, 5],  # gold 3 at rank 0
            [0, 1, 2, 3, 4, 7],  # gold 7 at rank 5
            [5, 6, 7, 8, 9, 2],  # gold 9 at rank 4
            [1, 2, 3, 4, 5, 6],  # gold 0 absent
        ]
    )
    gold = np.array([3, 7, 9, 0])
    out = recall_at_k(retrieved, gold, ks=(1, 5, 6, 10))
    assert out == {"recall@1": 0.25, "recall@5": 0.5, "recall@6": 0.75}
    assert recall_at_k(retrieved, gold) == {"recall@1": 0.25, "recall@5": 0.5}
    with pytest.raises(ValueError):
        recall_at_k(retrieved, gold[:2])


def test_scores_of_any_blocks_match_reference():
    """scores(queries, ids): BM25's score of any block (the hybrid's rescoring), not a top-k."""
    r = BM25Retriever(TEXTS)
    ids = np.array([[5, 0, 3], [1, 1, 4], [2, 0, 5], [0, 1, 2], [3, 4, 5]])
    got = r.scores(QUERIES, ids)
    for qi, query in enumerate(QUERIES):
        ref = _reference_scores(query, 0.9, 0.4)
        np.testing.assert_allclose(got[qi], ref[ids[qi]], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 6\)"):
        r.scores(QUERIES[:1], np.array([[6]]))
