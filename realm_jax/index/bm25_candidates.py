"""BM25's top-m blocks for every (masked sentence, span) of a prepared dataset, computed once
and kept with it (data/span_candidates.py holds the format and the lookup).

The query is the sentence without the masked span (span_candidates.span_query); the
example's own block is excluded, as dense retrieval excludes it (the trivial match); a query
none of whose words is indexed gets no candidates (-1), not m arbitrary blocks.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from realm_jax import tokenization as tk
from realm_jax.data import datasets
from realm_jax.data import span_candidates as sc
from realm_jax.index.bm25 import BM25Retriever

log = logging.getLogger("realm_jax.index")

RETRIEVER = "bm25"
CHUNK = 20_000  # queries per BM25 call (progress is logged after each)


def block_texts(data_dir: str) -> list[str]:
    """Every block as BM25 indexes it: "title\\ntext" (as qa/evaluation.py's BM25 does)."""
    src = datasets.blocks_source(data_dir)
    recs = src.__getitems__(range(len(src)))
    return [f"{r['title'].decode()}\n{r['text'].decode()}" for r in recs]


def span_queries(data_dir: str, split: str):
    """(example_ids [E], offsets [E + 1], queries [R], own block [R], spans) of a split,
    examples in example-id order, each example's spans in their stored order; spans[r] is
    (the example's title, the span's wordpieces)."""
    src = datasets.examples_source(data_dir, split)
    recs = list(src.__getitems__(range(len(src))))
    recs.sort(key=lambda r: int(r["example_id"]))
    tok = tk.load_tokenizer()
    ids, offsets, queries, own, spans = [], [0], [], [], []
    for r in recs:
        ids.append(int(r["example_id"]))
        title = r["title"].decode() if "title" in r else ""
        for a, b in zip(r["span_starts"], r["span_ends"], strict=True):
            queries.append(sc.span_query(r["token_ids"], int(a), int(b), tok))
            own.append(int(r["block_id"]))
            spans.append((title, np.asarray(r["token_ids"][int(a) : int(b) + 1], np.int32)))
        offsets.append(len(queries))
    return np.asarray(ids, np.int64), np.asarray(offsets, np.int64), queries, np.asarray(own), spans


def article_blocks(data_dir: str, spans, own: np.ndarray, found: np.ndarray) -> np.ndarray:
    """[R] for each (example, span): a block of the example's article (its title), not its own
    block, whose wordpieces hold the span's as one run (-1: none): BM25's best such block
    among `found` [R, m], else the first in the corpus. The copying curriculum's blocks for
    sentences cut from the corpus (train.article_block_steps)."""
    tokens, _, titles = datasets.load_blocks(data_dir)
    by_title: dict[str, list[int]] = {}
    for i, t in enumerate(titles):
        by_title.setdefault(t, []).append(i)
    rows = [tokens[i].tobytes() for i in range(len(tokens))]

    def holds(block: int, run: bytes) -> bool:
        at = rows[block].find(run)
        while at >= 0 and at % 4:  # an int32 boundary, not a match across two wordpieces
            at = rows[block].find(run, at + 1)
        return at >= 0

    out = np.full(len(spans), -1, np.int32)
    for r, (title, piece) in enumerate(spans):
        same = by_title.get(title, ())
        if not len(piece) or len(same) < 2:
            continue
        run = piece.tobytes()
        ranked = [int(b) for b in found[r] if b >= 0 and titles[b] == title]
        for b in [*ranked, *same]:
            if b != own[r] and holds(b, run):
                out[r] = b
                break
    return out


def build(data_dir: str, split: str, depth: int) -> sc.SpanCandidates:
    """BM25's top-`depth` blocks for every (example, span) of the split."""
    t0 = time.perf_counter()
    summary = datasets.load_summary(data_dir)
    texts = block_texts(data_dir)
    depth = min(depth, len(texts) - 1)
    bm25 = BM25Retriever(texts)
    example_ids, offsets, queries, own, spans = span_queries(data_dir, split)
    out = np.full((len(queries), depth), -1, np.int32)
    log.info(
        "BM25 candidates: %d spans of %d %s examples over %d blocks, top %d each",
        len(queries),
        len(example_ids),
        split,
        len(texts),
        depth,
    )
    for a in range(0, len(queries), CHUNK):
        b = min(a + CHUNK, len(queries))
        found, scores = bm25.search(queries[a:b], depth, exclude=own[a:b])
        out[a:b] = np.where(scores > 0, found, -1)
        done, spent = b / max(len(queries), 1), time.perf_counter() - t0
        log.info(
            "BM25 candidates: %d/%d spans (%.0f%%), %.0f s, about %.0f s left",
            b,
            len(queries),
            100 * done,
            spent,
            spent / done - spent,
        )
    article = article_blocks(data_dir, spans, own, out)
    meta = {
        "split": split,
        "retriever": RETRIEVER,
        "m": depth,
        "fingerprint": summary["fingerprint"],
        "created": summary["created"],
        "spans": len(queries),
        "examples": len(example_ids),
        "no_candidates": int((out[:, 0] < 0).sum()) if depth else len(queries),
        "article_blocks": int((article >= 0).sum()),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return sc.SpanCandidates(example_ids, offsets, out, meta, article)


def ensure(data_dir: str, depth: int, split: str = "train") -> sc.SpanCandidates:
    """The split's BM25 candidates, read from the data dir when made from this very prepare
    at least `depth` deep, else computed (and saved by process 0; every process of a pod
    computes the same rows, so none waits for another)."""
    summary = datasets.load_summary(data_dir)
    blocks = int(summary["counts"].get("blocks", 0))
    want = min(depth, max(blocks - 1, 1))
    got = sc.load(data_dir, split, summary, RETRIEVER, want)
    if got is not None:
        return got
    cands = build(data_dir, split, want)
    if jax.process_index() == 0:
        sc.save(data_dir, split, cands)
    log.info(
        "BM25 candidates for %s: %d spans in %.1f s (%d with no candidate)%s",
        split,
        cands.meta["spans"],
        cands.meta["seconds"],
        cands.meta["no_candidates"],
        f", kept in {sc.paths(data_dir, split)[0]}" if jax.process_index() == 0 else "",
    )
    return cands
