"""A second retriever's candidates for each masked sentence, kept beside the prepared data.

REALM's gradient on the retriever is the posterior minus the prior over the candidates it
sees, so it can only pull towards a block that is among them. `train.bm25_candidates` adds
another retriever's top-m blocks (BM25's, index/bm25_candidates.py computes them) to the dense
top-k of every training query; this module is their file format and their lookup.

One row per (example, salient span): the masked sentence differs with the span masked, and so
do its candidates. The query is the sentence's wordpieces without the span's (span_query),
so the second retriever never sees the answer. Files (one pair per split, "train" or "eval"):

  <data_dir>/candidates/<split>.npz    example_ids [E] int64 (sorted), offsets [E + 1] int64
                                       (example e's spans are rows offsets[e]..offsets[e+1]-1,
                                       in span order), ids [R, m] int32 (block ids, best
                                       first, -1 padded; the example's own block excluded),
                                       article [R] int32 (a block of the example's article,
                                       not its own, that holds the span; -1 none: the copying
                                       curriculum of train.article_block_steps)
  <data_dir>/candidates/<split>.json   what they were made from: the prepare's fingerprint and
                                       creation time, the retriever, m; written LAST

An .npz of plain numeric arrays, read with allow_pickle=False.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile

import numpy as np

from realm_jax import fs
from realm_jax import tokenization as tk
from realm_jax.data.datasets import PrepareError

FOLDER = "candidates"
FORMAT = 2  # 2: the article column


@dataclasses.dataclass(frozen=True)
class SpanCandidates:
    """Every (example, span)'s candidate block ids; `lookup` for one."""

    example_ids: np.ndarray  # [E] int64, sorted
    offsets: np.ndarray  # [E + 1] int64
    ids: np.ndarray  # [R, m] int32, -1 padded
    meta: dict
    article: np.ndarray | None = None  # [R] int32, -1 none

    def row(self, example_id: int, span: int) -> int:
        """The row of example `example_id` masked at its span `span`."""
        e = int(np.searchsorted(self.example_ids, example_id))
        if e >= len(self.example_ids) or self.example_ids[e] != example_id:
            raise KeyError(f"example {example_id} has no candidates ({self.meta.get('split')})")
        row = int(self.offsets[e]) + span
        if row >= int(self.offsets[e + 1]):
            raise KeyError(f"example {example_id} has no span {span}")
        return row

    @property
    def depth(self) -> int:
        return int(self.ids.shape[1])

    def lookup(self, example_id: int, span: int) -> np.ndarray:
        """[depth] int32 block ids of example `example_id` masked at its span `span`."""
        return self.ids[self.row(example_id, span)]

    def truncated(self, depth: int) -> SpanCandidates:
        """The first `depth` candidates of each row (a file made deeper serves a shallower ask)."""
        return dataclasses.replace(self, ids=self.ids[:, :depth], meta=dict(self.meta, m=depth))


def span_query(token_ids, start: int, end: int, tok=None) -> str:
    """The masked sentence as the second retriever's query: the sentence's wordpieces without
    [CLS]/[SEP] and without the span's positions start..end (inclusive), joined into words."""
    tok = tok or tk.load_tokenizer()
    ids = [int(t) for t in token_ids]

    def words(part):  # the two sides apart: no word glued across the span
        return tok.decode([t for t in part if t not in (tk.PAD_ID, tk.CLS_ID, tk.SEP_ID)])

    return " ".join(w for w in (words(ids[:start]), words(ids[end + 1 :])) if w)


def paths(data_dir: str, split: str) -> tuple[str, str]:
    base = fs.join(data_dir, FOLDER, split)
    return base + ".npz", base + ".json"


def save(data_dir: str, split: str, cands: SpanCandidates) -> None:
    """Arrays first, then the metadata (the completion marker), each written whole."""
    arrays, meta = paths(data_dir, split)
    fs.makedirs(fs.join(data_dir, FOLDER))
    buf = io.BytesIO()
    article = cands.article if cands.article is not None else np.full(len(cands.ids), -1)
    np.savez(
        buf,
        example_ids=cands.example_ids,
        offsets=cands.offsets,
        ids=cands.ids,
        article=article.astype(np.int32),
    )
    fs.remove(meta)  # a reader never pairs the new arrays with the old metadata
    fs.write_bytes(arrays, buf.getvalue())
    fs.write_text(meta, json.dumps(dict(cands.meta, format=FORMAT), indent=2, sort_keys=True))


def load(data_dir: str, split: str, summary: dict, retriever: str, depth: int):
    """The split's candidates if they were made from this prepare (fingerprint and creation
    time) by `retriever` at least `depth` deep, cut to `depth`; None when they must be
    (re)made. A damaged file is an error that says how to remake it."""
    arrays, meta_path = paths(data_dir, split)
    if not fs.exists(meta_path):
        return None
    meta = json.loads(fs.read_text(meta_path))
    same = (
        meta.get("format") == FORMAT
        and meta.get("fingerprint") == summary.get("fingerprint")
        and meta.get("created") == summary.get("created")
        and meta.get("retriever") == retriever
        and int(meta.get("m", 0)) >= depth
    )
    if not same:
        return None
    try:
        with fs.open(arrays, "rb") as f:
            z = np.load(io.BytesIO(f.read()), allow_pickle=False)
            out = SpanCandidates(z["example_ids"], z["offsets"], z["ids"], meta, z["article"])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise PrepareError(
            f"{arrays} is damaged ({e}); delete {fs.join(data_dir, FOLDER)} and run again: "
            "the candidates are recomputed"
        ) from e
    if len(out.offsets) != len(out.example_ids) + 1 or out.ids.shape[0] != out.offsets[-1]:
        raise PrepareError(f"{arrays}: inconsistent shapes; delete it and run again")
    return out.truncated(depth)
