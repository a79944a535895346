"""BM25 retriever over the prepared retrieval blocks (a lexical baseline, via ``bm25s``).

Two uses: a lexical baseline for ICT's held-out recall@k of a sentence's own block (query = the
sentence, gold = its block id), and later the BM25 retriever for open-domain QA evaluation.

Tokenisation (identical for blocks and queries): ``bm25s.tokenize`` with lower-casing, its default
token pattern (runs of two or more word characters, as scikit-learn's ``CountVectorizer``) and
bm25s's English stopword list; no stemmer, so no extra dependency. Scoring is bm25s's default
"lucene" variant, summed over query terms:

    ln(1 + (N - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * dl / avgdl))

which is Lucene >= 8's form: it drops the constant (k1 + 1) factor of the textbook formula, so
scores are the textbook ones divided by (k1 + 1) and the ranking is the same.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import bm25s
import numpy as np

# bm25s sets its logger to DEBUG when imported ("Building index from IDs objects" on every
# index built), after runtime.setup quieted it: its warnings and errors only
logging.getLogger("bm25s").setLevel(logging.WARNING)

# Show tqdm progress bars (tokenising, indexing, retrieving) only above this many items, and
# only on a terminal (in a log file a bar is carriage returns and escape codes).
PROGRESS_MIN_ITEMS = 1000


def _show(n: int) -> bool:
    return n > PROGRESS_MIN_ITEMS and sys.stderr.isatty()


_TOKENIZE_KW = dict(lower=True, stopwords="en", stemmer=None)


def _tokenize(texts: Sequence[str], return_ids: bool):
    return bm25s.tokenize(
        list(texts),
        return_ids=return_ids,
        show_progress=_show(len(texts)),
        **_TOKENIZE_KW,
    )


class BM25Retriever:
    """In-memory BM25 index over blocks; block id = position in ``texts``.

    ``texts`` holds one string per block (callers pass ``"title\\ntext"``). The defaults
    k1=0.9, b=0.4 are Anserini's, as used by the BM25 baselines in the open-domain QA literature
    (e.g. ORQA, DPR). The method is bm25s's default ("lucene").
    """

    def __init__(self, texts: Sequence[str], k1: float = 0.9, b: float = 0.4):
        if len(texts) == 0:
            raise ValueError("BM25Retriever needs at least one block")
        self.num_blocks = len(texts)
        self.k1 = k1
        self.b = b
        show = _show(self.num_blocks)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index(_tokenize(texts, return_ids=True), show_progress=show)

    def __len__(self) -> int:
        return self.num_blocks

    def search(
        self, queries: Sequence[str], k: int, exclude: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k block ids and BM25 scores per query, best first: (ids [Q, k] int64, scores [Q, k]
        float32). Ties are ordered by block id. ``exclude[i]`` (a block id, or -1 for none) is never
        returned for query i. A query with no indexed term gets k arbitrary blocks with score 0.
        """
        n = self.num_blocks
        limit = n - 1 if exclude is not None else n
        if not 1 <= k <= limit:
            extra = " minus the excluded one" if exclude is not None else ""
            raise ValueError(f"k={k} must be in [1, {limit}]: {n} blocks{extra}")
        q = len(queries)
        excl = None
        if exclude is not None:
            excl = np.asarray(exclude, dtype=np.int64).reshape(-1)
            if excl.shape != (q,):
                raise ValueError(f"exclude has {excl.shape[0]} entries for {q} queries")
            if ((excl < -1) | (excl >= n)).any():
                raise ValueError(f"exclude ids must be -1 or in [0, {n})")
        if q == 0:
            return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)

        kk = k + (excl is not None)
        ids, scores = self._bm25.retrieve(
            _tokenize(queries, return_ids=False),
            k=kk,
            sorted=True,
            show_progress=_show(q),
            n_threads=0,
            # Plain numpy top-k: the "auto" choice would dispatch every query to a JAX device.
            backend_selection="numpy",
        )
        ids = np.asarray(ids, dtype=np.int64).reshape(q, kk)
        scores = np.asarray(scores, dtype=np.float32).reshape(q, kk)
        # Deterministic order: score descending, then block id ascending.
        order = np.lexsort((ids, -scores), axis=-1)
        ids = np.take_along_axis(ids, order, axis=-1)
        scores = np.take_along_axis(scores, order, axis=-1)

        if excl is not None:
            # Drop the excluded id where it was retrieved, else the lowest-ranked one.
            hit = ids == excl[:, None]
            drop = np.where(hit.any(axis=1), hit.argmax(axis=1), kk - 1)
            keep = np.ones(ids.shape, dtype=bool)
            keep[np.arange(q), drop] = False
            ids = ids[keep].reshape(q, k)
            scores = scores[keep].reshape(q, k)
        return ids, scores

    def scores(self, queries: Sequence[str], ids: np.ndarray) -> np.ndarray:
        """BM25's scores of the given blocks ids [Q, n] for each query -> [Q, n] float32 (any
        block, not only a top-k: the hybrid retriever rescores the union of two top-k lists)."""
        ids = np.asarray(ids, np.int64)
        if ids.ndim != 2 or ids.shape[0] != len(queries):
            raise ValueError(f"ids must be [{len(queries)}, n], got {ids.shape}")
        if ((ids < 0) | (ids >= self.num_blocks)).any():
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        out = np.zeros(ids.shape, np.float32)
        tokens = _tokenize(queries, return_ids=False)
        for i, words in enumerate(tokens):
            known = [w for w in words if w in self._bm25.vocab_dict]
            if known:  # a query none of whose words is indexed scores 0 everywhere
                out[i] = self._bm25.get_scores(known)[ids[i]]
        return out


def recall_at_k(
    retrieved_ids: np.ndarray, gold: np.ndarray, ks: Sequence[int] = (1, 5, 10, 20)
) -> dict[str, float]:
    """Fraction of queries whose gold id is among the first k retrieved, for each k <= K.

    ``retrieved_ids`` is [Q, K] (best first), ``gold`` is [Q]. Returns {"recall@1": ..., ...}.
    """
    retrieved_ids = np.asarray(retrieved_ids)
    gold = np.asarray(gold)
    if retrieved_ids.ndim != 2 or gold.shape != (retrieved_ids.shape[0],):
        raise ValueError(
            "expected retrieved_ids [Q, K] and gold [Q], "
            f"got {retrieved_ids.shape} and {gold.shape}"
        )
    q, big_k = retrieved_ids.shape
    if q == 0:
        raise ValueError("recall_at_k needs at least one query")
    hit = retrieved_ids == gold[:, None]
    rank = np.where(hit.any(axis=1), hit.argmax(axis=1), big_k)  # 0-based rank of gold, K if absent
    return {f"recall@{k}": float(np.mean(rank < k)) for k in ks if k <= big_k}
