"""Corpus versions of a workdir: the documents `update` added, replaced and deleted (issue 61).

A workdir's corpus starts as its prepared data (data.data_dir, "version 0"). Every `update`
publishes ``<workdir>/corpus/v_<08d>/``, written in a ``.tmp-*`` folder and renamed into place
(locally; on gs:// written in place with manifest.json last), holding:

  manifest.json   written LAST, the commit marker: parent, base (the prepared data's
                  fingerprint and block count), segments, counts, the embedder, every file's
                  size and sha256
  live.npy        int64 [num_live], sorted: the rows this version serves, in order. A row is a
                  block id: 0..N0-1 the prepared blocks, then each version's added rows. Rows
                  are never renumbered: checkpoints, predictions and block_records exports keep
                  meaning the same blocks; a deleted or replaced block's row is dropped from
                  live.npy (a tombstone) and its record stays, unread.
  docs.json.gz    {doc id: [sha256 of "title\\0text" or "", sha256 of its blocks, [rows]]} of
                  every live document (what the next update diffs against)
  segment/        the blocks this version added (tokens.npy int32 [n, block_len] zero-padded,
                  blocks.jsonl.gz one {row, doc_id, title, text, sentence_starts} a line), when
                  it added any; later versions read them from here (never written again)
  index/          an index store (index/store.py), `update`'s version first: the live rows'
                  embeddings IN live.npy's ORDER (position p is row live[p]) and its ScaNN
                  searcher, whose datapoint d is row scann_rows.npy[d] (ScaNN's upsert/delete
                  reorder datapoints). Pre-training's refresh job and a refreshing fine-tuning
                  publish their later versions here, in the same order (not in the manifest's
                  files: a corpus version's blocks never change, its index store grows)

Every reader opens one View (open_view) and reads everything through it: its blocks, its
index, its rows. A version never changes once committed, so a reader pinned to it is never
shown half of the next one. Retention keeps the index of the newest KEEP_INDEXES versions (the
rest of a version, small, is kept: its segment is read by the versions after it).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import time

import numpy as np

from realm_jax import fs
from realm_jax import workdir as paths
from realm_jax.corpus_errors import CorpusError
from realm_jax.lock import pid_alive

log = logging.getLogger("realm_jax.corpus")

FORMAT = 1
MANIFEST = "manifest.json"
LIVE = "live.npy"
DOCS = "docs.json.gz"
SEGMENT = "segment"
SEG_TOKENS = "tokens.npy"
SEG_BLOCKS = "blocks.jsonl.gz"
INDEX = "index"
SCANN_ROWS = "scann_rows.npy"
KEEP_INDEXES = 3
_VERSION_RE = re.compile(r"^v_(\d{8})$")


def corpus_dir(workdir: str) -> str:
    return fs.join(paths.root(workdir), "corpus")


def version_name(k: int) -> str:
    return f"v_{int(k):08d}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def list_versions(workdir: str) -> list[int]:
    """Committed-looking version numbers (folder names), ascending; verify with _manifest."""
    root = corpus_dir(workdir)
    if not fs.isdir(root):
        return []
    found = [_VERSION_RE.match(n.rstrip("/")) for n in fs.listdir(root)]
    return sorted(int(m.group(1)) for m in found if m)


def _manifest(folder: str, checksum: bool = False) -> dict | None:
    """The version's manifest when it is committed and its files are whole, else None."""
    mpath = fs.join(folder, MANIFEST)
    if not fs.exists(mpath):
        return None
    try:
        m = json.loads(fs.read_bytes(mpath))
    except (OSError, ValueError):
        return None
    if m.get("format") != FORMAT:
        return None
    for rel, info in m.get("files", {}).items():
        p = fs.join(folder, *rel.split("/"))
        try:
            if fs.size(p) != info["size"]:
                return None
        except (OSError, FileNotFoundError):
            return None
        if checksum and sha256_file(p) != info["sha256"]:
            return None
    return m


def latest(workdir: str) -> tuple[int, dict] | None:
    """(version, manifest) of the newest committed version whose files are whole."""
    for k in reversed(list_versions(workdir)):
        m = _manifest(fs.join(corpus_dir(workdir), version_name(k)))
        if m is not None:
            return k, m
        log.warning("corpus version %d is not whole (an update was interrupted): skipped", k)
    return None


def base_fingerprint(data_dir: str) -> dict:
    from realm_jax.data import datasets

    s = datasets.load_summary(data_dir)
    return {
        "fingerprint": s.get("fingerprint", ""),
        "blocks": int(s["counts"]["blocks"]),
        "block_len": int(s["block_len"]),
    }


class View:
    """One corpus version as every reader sees it: positions 0..len-1 are its live blocks in
    row order (position p is block id rows[p]); records read like the prepared blocks' (title,
    text, doc_id as bytes; token_ids unpadded)."""

    def __init__(self, workdir: str, data_dir: str, version: int, manifest: dict | None):
        from realm_jax.data import datasets

        self.workdir, self.data_dir, self.version, self.manifest = (
            workdir,
            data_dir,
            version,
            manifest,
        )
        self._base = datasets.blocks_source(data_dir)
        self.num_base = len(self._base)
        self.block_len = int(datasets.load_summary(data_dir)["block_len"])
        self._segments: list[tuple[int, int, int]] = []  # (first_row, rows, version)
        self._seg_cache: dict[int, tuple[np.ndarray, list[dict]]] = {}
        if manifest is None:
            self.rows = np.arange(self.num_base, dtype=np.int64)
            self.num_rows = self.num_base
            self.index_dir = paths.index_dir(workdir)
            self.scann_rows = None
            return
        base = manifest["base"]
        here = base_fingerprint(data_dir)
        if here["fingerprint"] != base["fingerprint"] or here["blocks"] != base["blocks"]:
            raise CorpusError(
                f"{workdir}: its corpus version {version} was built on prepared data that "
                f"{data_dir} no longer holds (fingerprint {base['fingerprint'][:12]}, "
                f"{base['blocks']} blocks; now {here['fingerprint'][:12]}, {here['blocks']}): "
                "`prepare --overwrite` replaced it; restore that data, or start the workdir again"
            )
        folder = self.folder
        self.rows = np.load(io.BytesIO(fs.read_bytes(fs.join(folder, LIVE))))
        self.num_rows = int(manifest["num_rows"])
        self._segments = [(s["first_row"], s["rows"], s["version"]) for s in manifest["segments"]]
        self.index_dir = fs.join(folder, INDEX)
        sr = fs.join(folder, SCANN_ROWS)
        self.scann_rows = np.load(io.BytesIO(fs.read_bytes(sr))) if fs.exists(sr) else None

    @property
    def folder(self) -> str:
        return fs.join(corpus_dir(self.workdir), version_name(self.version))

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"corpus version {self.version} of {self.workdir} ({len(self)} live blocks)"

    def row(self, position: int) -> int:
        return int(self.rows[int(position)])

    # ------------------------------------------------------------------------- records
    def _segment(self, version: int) -> tuple[np.ndarray, list[dict]]:
        if version not in self._seg_cache:
            folder = fs.join(corpus_dir(self.workdir), version_name(version), SEGMENT)
            tokens = np.load(io.BytesIO(fs.read_bytes(fs.join(folder, SEG_TOKENS))))
            recs = [
                json.loads(line)
                for line in gzip.decompress(fs.read_bytes(fs.join(folder, SEG_BLOCKS))).splitlines()
            ]
            self._seg_cache[version] = (tokens, recs)
        return self._seg_cache[version]

    def _locate(self, row: int) -> tuple[int, int]:
        for first, n, v in self._segments:
            if first <= row < first + n:
                return v, row - first
        raise IndexError(f"block {row} is in no segment of {self!r}")

    def record(self, row: int) -> dict:
        """The block with id `row` (live or not: a tombstoned block still reads)."""
        row = int(row)
        if 0 <= row < self.num_base:
            return self._base[row]
        if not 0 <= row < self.num_rows:
            raise IndexError(f"block {row}: {self!r} has blocks 0..{self.num_rows - 1}")
        v, i = self._locate(row)
        tokens, recs = self._segment(v)
        r = recs[i]
        n = int((tokens[i] != 0).sum())
        return {
            "block_id": row,
            "doc_id": r["doc_id"].encode(),
            "title": r["title"].encode(),
            "text": r["text"].encode(),
            "token_ids": tokens[i, :n].astype(np.int32),
            "sentence_starts": np.asarray(r["sentence_starts"], np.int32),
        }

    def __getitem__(self, position) -> dict:
        return self.record(self.rows[int(position)])

    def __getitems__(self, positions) -> list[dict]:
        positions = list(positions)
        rows = self.rows[np.asarray(positions, np.int64)] if positions else []
        base = [int(r) for r in rows if r < self.num_base]
        got = dict(zip(base, self._base.__getitems__(base))) if base else {}
        return [got[int(r)] if int(r) in got else self.record(int(r)) for r in rows]

    def text(self, row: int) -> tuple[str, str]:
        """(title, body) of block `row`."""
        rec = self.record(row)
        return rec["title"].decode(), rec["text"].decode()

    def blocks(self) -> tuple[np.ndarray, list[str], list[str]]:
        """Every live block, in position order: (token ids int32 [len, block_len] zero-padded,
        doc ids, titles), what datasets.load_blocks gives for the prepared data."""
        from realm_jax.data import datasets

        tokens, doc_ids, titles = datasets.load_blocks(self.data_dir)
        if self.manifest is None:
            return tokens, doc_ids, titles
        base = self.rows[self.rows < self.num_base]
        out_t = [tokens[base]]
        out_d = [doc_ids[i] for i in base]
        out_n = [titles[i] for i in base]
        live = set(int(r) for r in self.rows[self.rows >= self.num_base])
        for first, n, v in self._segments:
            seg_tokens, recs = self._segment(v)
            keep = [i for i in range(n) if first + i in live]
            out_t.append(seg_tokens[keep, : self.block_len])
            out_d += [recs[i]["doc_id"] for i in keep]
            out_n += [recs[i]["title"] for i in keep]
        return np.concatenate(out_t).astype(np.int32), out_d, out_n

    def positions(self) -> np.ndarray | None:
        """int32 [num_rows]: each block id's position in this version (-1: not served), what
        a pre-training run maps its examples' own blocks through (their ids are the prepared
        data's rows); None for the prepared data itself (position = row)."""
        if self.manifest is None:
            return None
        out = np.full(self.num_rows, -1, np.int32)
        out[self.rows] = np.arange(len(self.rows), dtype=np.int32)
        return out

    def device_tokens(self, mesh, with_titles: bool = False):
        """The live blocks' token table row-sharded over `mesh` in position order
        (datasets.RowShardedTokens), what pre-training and its refresh job embed and retrieve
        from. The prepared data: each process reads only its own devices' rows
        (datasets.sharded_block_tokens). An updated version: every process reads the whole
        table (its segments are small files; at 13.35M blocks that is 7.7 GB a host in 16
        bits, as a frozen fine-tuning index reads it)."""
        from realm_jax import sharding
        from realm_jax.data import datasets

        if self.manifest is None:
            return datasets.sharded_block_tokens(self.data_dir, mesh, with_titles=with_titles)
        tokens, _, titles = self.blocks()
        table = datasets.token_table(sharding.pad_rows(tokens, mesh))
        ids = None
        if with_titles:
            ids = datasets.TitleIds.of(titles, namer=lambda p: self[p]["title"].decode())
        return datasets.RowShardedTokens(sharding.put_rows(table, mesh), len(tokens), ids)

    def docs(self) -> dict[str, list]:
        """{doc id: [raw sha256 or "", blocks sha256, [rows]]} of every live document."""
        if self.manifest is not None:
            return json.loads(gzip.decompress(fs.read_bytes(fs.join(self.folder, DOCS))))
        return base_docs(self.data_dir)


def block_key(title: str, token_ids) -> bytes:
    """What identifies a block's content: its title and wordpieces."""
    return title.encode() + b"\0" + np.asarray(token_ids, np.int32).tobytes() + b"\1"


def base_docs(data_dir: str) -> dict[str, list]:
    """The prepared corpus's documents: {doc id: ["", sha256 of its blocks, [rows]]}, read
    once from every block record (the raw text was not kept: a document given again is split
    and compared by its blocks)."""
    from realm_jax.data import datasets

    src = datasets.blocks_source(data_dir)
    hashes: dict[str, hashlib._Hash] = {}
    rows: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, rec in enumerate(datasets._records(src, 0, len(src))):
        d = rec["doc_id"].decode()
        if d not in hashes:
            hashes[d], rows[d] = hashlib.sha256(), []
        hashes[d].update(block_key(rec["title"].decode(), rec["token_ids"]))
        rows[d].append(i)
    log.info("read %d prepared blocks' documents in %.1f s", len(src), time.perf_counter() - t0)
    return {d: ["", hashes[d].hexdigest(), rows[d]] for d in hashes}


def open_view(config, workdir: str) -> View:
    """The workdir's newest committed corpus version (version 0: its prepared data)."""
    ddir = paths.data_dir(config, workdir)
    found = latest(workdir)
    if found is None:
        return View(workdir, ddir, 0, None)
    return View(workdir, ddir, found[0], found[1])


def is_updated(workdir: str) -> bool:
    return latest(workdir) is not None


def refuse_ict(workdir: str) -> None:
    """ICT reads the prepared corpus only (its examples are the prepared blocks' sentences
    and its evaluation retrieves over every prepared block): on a workdir whose corpus was
    updated it would train and score against blocks the update deleted. REALM pre-training
    (`train`, `local`, `refresh`) reads the newest version (View.device_tokens). One line,
    before anything runs."""
    found = latest(workdir) if fs.isdir(corpus_dir(workdir)) else None
    if found is not None:
        raise CorpusError(
            f"{workdir}: its corpus was updated (corpus version {found[0]}, {corpus_dir(workdir)}"
            "); `ict` trains over the prepared corpus only and would retrieve blocks the update "
            "deleted: run ICT (the warm start) in a workdir of its own, before REALM"
        )


def cleanup(workdir: str, keep: int = KEEP_INDEXES) -> list[str]:
    """Remove the index of every version but the newest `keep` (and abandoned temp folders
    of killed updates, by a dead writer's pid on this host); returns what was removed."""
    root = corpus_dir(workdir)
    removed = []
    versions = list_versions(workdir)
    for k in versions[:-keep] if keep > 0 else versions:
        idx = fs.join(root, version_name(k), INDEX)
        if fs.isdir(idx):
            fs.rmtree(idx)
            removed.append(idx)
    if not fs.is_remote(root) and os.path.isdir(root):
        for name in os.listdir(root):
            if not name.startswith(".tmp-"):
                continue
            try:
                pid = int(name.split("-")[2])
            except (IndexError, ValueError):
                continue
            if not pid_alive(pid):
                fs.rmtree(os.path.join(root, name))
                removed.append(os.path.join(root, name))
    return removed
