"""ICT examples from the prepared blocks, as ORQA's ict_dataset.py builds them.

Each training block gives one example per epoch: a sentence drawn at random is the query
(`[CLS] sentence [SEP]`), and the block with that sentence removed (mask_rate of the time)
is its positive. Blocks of held-out titles (prepare's eval split) are never trained on.
Where we differ on purpose: ORQA drops a masked example of a one-sentence block (nothing
would be left); we keep such blocks unmasked, so every batch is full and fixed-shape.
"""

from __future__ import annotations

import dataclasses
import hashlib

import grain
import numpy as np

from realm_jax import tokenization as tk
from realm_jax.data import datasets, pipeline


class BlockSubset:
    """A random-access source over some of the blocks (the training titles' blocks)."""

    def __init__(self, source, ids: np.ndarray):
        self.source, self.ids = source, np.asarray(ids, np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.source[int(self.ids[i])]

    def __repr__(self) -> str:
        # grain checks a restored iterator state against repr(data source): the default repr
        # (an object address) made every ICT resume fail
        digest = hashlib.sha256(self.ids.tobytes()).hexdigest()[:16]
        return f"BlockSubset({self.source!r}, {len(self.ids)} ids, sha256 {digest})"


def train_block_ids(data, titles: list[str], doc_ids: list[str]) -> np.ndarray:
    """Blocks whose title (or doc id) is not held out: the same split prepare made."""
    keep = [
        i
        for i, (t, d) in enumerate(zip(titles, doc_ids, strict=True))
        if not datasets.is_eval(
            t if data.eval_split_key == "title" and t else d, data.eval_fraction, data.seed
        )
    ]
    return np.asarray(keep, np.int64)


def ict_pair(
    rec: dict, rng: np.random.Generator, query_len: int, block_len: int, mask_rate: float
) -> dict[str, np.ndarray]:
    """One block record -> {query_ids [query_len], block_ids [block_len]} (zero-padded)."""
    tok = np.asarray(rec["token_ids"], np.int32)  # [CLS] title [SEP] body [SEP]
    starts = np.asarray(rec["sentence_starts"], np.int64)
    if len(starts) == 0:  # no sentence boundary recorded: the whole body is the query
        starts = np.asarray([int(np.flatnonzero(tok == tk.SEP_ID)[0]) + 1])
    ends = np.append(starts[1:], len(tok) - 1)  # the last sentence stops before the [SEP]
    i = int(rng.integers(len(starts)))
    a, b = int(starts[i]), int(ends[i])
    query = tk.pad_to(tk.query_ids(tok[a:b].tolist(), query_len), query_len)
    block = tok
    if len(starts) > 1 and rng.random() < mask_rate:
        block = np.concatenate([tok[:a], tok[b:]])
    return {
        "query_ids": np.asarray(query, np.int32),
        "block_ids": np.asarray(tk.pad_to(block[:block_len], block_len), np.int32),
    }


@dataclasses.dataclass(frozen=True)
class IctPair(grain.transforms.RandomMap):
    """grain seeds `rng` by (seed, position in the global order): a new sentence per epoch,
    deterministic and exactly resumable."""

    query_len: int
    block_len: int
    mask_rate: float

    def random_map(self, rec: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return ict_pair(rec, rng, self.query_len, self.block_len, self.mask_rate)


def train_loader(config, data_dir: str, train_ids: np.ndarray) -> grain.DataLoader:
    """This process's batches of ICT pairs: query_ids [b, query_len], block_ids [b, block_len]."""
    d = config.data
    return pipeline.shuffled_batches(
        BlockSubset(datasets.blocks_source(data_dir), train_ids),
        IctPair(d.query_len, d.block_len, config.ict.mask_rate),
        what=f"training blocks in {data_dir}",
        global_batch_size=config.train.batch_size,
        seed=d.seed,
        worker_count=d.worker_count,
    )


@dataclasses.dataclass(frozen=True)
class ImitationPair(grain.transforms.RandomMap):
    """The BM25-imitation control's pair (ict.positives=bm25): REALM's masked sentence (the
    same span draw as pipeline.MaskSpan) as the query, and BM25's top block for that span
    (data/span_candidates.py; the own block excluded) as the positive."""

    query_len: int
    max_predictions: int
    extra: object  # SpanCandidates
    blocks: np.ndarray  # [N, block_len] int32: every block's token ids, zero-padded

    def random_map(self, rec: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
        span = int(rng.integers(len(rec["span_starts"])))
        out = pipeline.mask_example(rec, span, self.query_len, self.max_predictions)
        top = int(self.extra.lookup(int(rec["example_id"]), span)[0])
        return {"query_ids": out["query_ids"], "block_ids": self.blocks[top]}


def imitation_loader(config, data_dir: str, extra, blocks: np.ndarray) -> grain.DataLoader:
    """This process's batches of the BM25-imitation control: query_ids [b, query_len] (the
    masked pre-training sentences), block_ids [b, block_len] (BM25's top block for each).
    Examples with a span that BM25 found nothing for are left out."""
    d = config.data
    src = datasets.examples_source(data_dir)
    if not np.array_equal(extra.example_ids, np.arange(len(src))):
        raise datasets.PrepareError(
            f"{data_dir}: its examples are not numbered by record; re-run `realm-jax prepare "
            "--overwrite`"
        )
    found = extra.ids[:, 0] >= 0  # [spans]
    whole = np.logical_and.reduceat(found, extra.offsets[:-1]) if len(found) else found
    keep = np.flatnonzero(whole & (np.diff(extra.offsets) > 0))
    return pipeline.shuffled_batches(
        BlockSubset(src, keep),
        ImitationPair(d.query_len, d.max_predictions, extra, blocks),
        what=f"examples with BM25 candidates in {data_dir}",
        global_batch_size=config.train.batch_size,
        seed=d.seed,
        worker_count=d.worker_count,
    )


def eval_queries(data_dir: str, query_len: int, max_examples: int):
    """Held-out sentences (unmasked), their own block ids (-1: a separate text's) and their
    documents' titles: (query_ids [Q, Lq], block_id [Q], texts, titles)."""
    source = datasets.examples_source(data_dir, "eval")
    n = len(source) if max_examples <= 0 else min(len(source), max_examples)
    recs = [source[i] for i in range(n)]
    q = np.stack([tk.pad_to(r["token_ids"], query_len) for r in recs]).astype(np.int32)
    own = np.asarray([int(r["block_id"]) for r in recs], np.int64)
    titles = [r["title"].decode() if "title" in r else "" for r in recs]
    return q, own, [r["text"].decode() for r in recs], titles


def _find(hay: np.ndarray, needle: np.ndarray) -> int:
    """First index of `needle` as a contiguous run in `hay`, or -1."""
    n = len(needle)
    if n == 0 or n > len(hay):
        return -1
    hits = np.flatnonzero(hay[: len(hay) - n + 1] == needle[0])
    for h in hits:
        if np.array_equal(hay[h : h + n], needle):
            return int(h)
    return -1


def cut_out(
    tokens: np.ndarray, texts: list[str], own: np.ndarray, queries: np.ndarray, sentences: list[str]
):
    """The evaluation corpus: each held-out sentence cut out of its own block, in the token
    table (for the dense retriever) and in the block text (for BM25), so that neither finds
    its block by the sentence itself (as ICT's masked examples train for). Returns (tokens
    [N, Lb], texts, number of queries whose sentence was found and cut)."""
    tokens, texts, cut = tokens.copy(), list(texts), 0
    for q, b, sent in zip(queries, own, sentences, strict=True):
        body = q[1 : int((q != 0).sum()) - 1]  # [CLS] x [SEP] -> x
        row = tokens[b]
        at = _find(row, body)
        if at < 0:
            continue
        kept = np.concatenate([row[:at], row[at + len(body) :]])
        tokens[b] = tk.pad_to(kept, len(row))
        texts[b] = texts[b].replace(sent, " ", 1)
        cut += 1
    return tokens, texts, cut
