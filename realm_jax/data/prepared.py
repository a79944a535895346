"""The read side of prepared data: a complete prepare's summary, random-access TFDS sources
of the blocks and the (held-out) examples, the block token table, the held-out split rule.

Layout of a prepared data_dir: see data/prepare.py (the write side). A data_dir may be a gs://
URL: summary.json is read from there and the dataset files it lists are checked, then copied
once into a local cache folder (array_record reads local files only) and opened there."""

from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np
import tensorflow_datasets as tfds

from realm_jax import fs

FORMAT_VERSION = 2


SUMMARY = "summary.json"
DATASETS = ("blocks", "examples", "eval_examples")
_checked: set[tuple[str, float]] = set()  # (data_dir, created) whose files were checked


class PrepareError(RuntimeError):
    """A data_dir that cannot be (re)used as asked."""


def is_eval(key: str, fraction: float, seed: int) -> bool:
    """Whether a title (or doc id) is held out: a hash of (seed, key) below `fraction`, so the
    split is the same on every run and needs no list of held-out keys."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def read_summary(data_dir: str) -> dict | None:
    try:
        return json.loads(fs.read_bytes(fs.join(data_dir, SUMMARY)))
    except FileNotFoundError:
        return None


def _check_files(data_dir: str, s: dict) -> None:
    """Every dataset file summary.json lists must exist with its size (once per prepare).
    Summaries written before the list was kept (a local rename-published prepare) have none
    and are trusted as before."""
    key = (fs.abspath(data_dir), s.get("created"))
    if key in _checked or "files" not in s:
        return
    for rel, size in sorted(s["files"].items()):
        path = fs.join(data_dir, *rel.split("/"))
        try:
            got = fs.size(path)
        except (FileNotFoundError, OSError):
            got = None
        if got != size:
            what = "is missing" if got is None else f"has {got} bytes, {SUMMARY} says {size}"
            raise PrepareError(
                f"{data_dir} is damaged: {rel} {what}. Re-run `realm-jax prepare --overwrite`"
            )
    _checked.add(key)


def load_summary(data_dir: str) -> dict:
    """The summary of a complete prepare; a clear error for a missing or partial one."""
    s = read_summary(data_dir)
    if s is None or not s.get("complete"):
        names = fs.listdir(data_dir)
        partial = any(n.startswith(".prepare-tmp-") or n in ("blocks", "examples") for n in names)
        what = "an incomplete (interrupted?) prepare" if partial else "no prepared data"
        raise PrepareError(
            f"{data_dir} holds {what}: no {SUMMARY}. Run `realm-jax prepare` "
            "(with --overwrite if needed) first."
        )
    if s.get("format_version") != FORMAT_VERSION:
        raise PrepareError(
            f"{data_dir} was prepared in format v{s.get('format_version')} by an older "
            f"realm-jax; this one reads v{FORMAT_VERSION}: re-run `realm-jax prepare "
            "--overwrite`"
        )
    _check_files(data_dir, s)
    return s


def cache_root() -> str:
    """Where gs:// prepared data is copied to be read (fs.cache_root: $REALM_JAX_CACHE, else
    ~/.cache/realm-jax)."""
    return fs.cache_root()


def local_copy(data_dir: str, s: dict) -> str:
    """A local folder holding data_dir's datasets: data_dir itself when local; for a gs://
    data_dir a verified copy under cache_root(), one per prepare (keyed by its fingerprint and
    creation time), downloaded once per host and renamed into place whole (fs.cached_copy)."""
    if not fs.is_remote(data_dir):
        return os.path.abspath(data_dir)
    if "files" not in s:
        raise PrepareError(f"{data_dir}: {SUMMARY} lists no files (prepared by an older realm-jax)")
    tag = hashlib.sha256(f"{fs.abspath(data_dir)}:{s['fingerprint']}:{s['created']}".encode())
    local = os.path.join(cache_root(), "prepared", tag.hexdigest()[:16])
    try:
        return fs.cached_copy(data_dir, dict(s["files"]), local)
    except fs.StorageError as e:
        raise PrepareError(str(e)) from None


@functools.lru_cache(maxsize=8)
def _open(path: str, fingerprint: str):
    del fingerprint  # only part of the cache key: a re-prepared folder is opened afresh
    return tfds.builder_from_directory(path).as_data_source(split="train")


def _source(data_dir: str, name: str, builder: str):
    s = load_summary(data_dir)
    key = f"{s['fingerprint']}:{s.get('created')}"
    return _open(os.path.join(local_copy(data_dir, s), name, builder, "1.0.0"), key)


def blocks_source(data_dir: str):
    """Random-access TFDS data source of the blocks (record i = block i)."""
    return _source(data_dir, "blocks", "realm_blocks")


def examples_source(data_dir: str, split: str = "train"):
    """Random-access TFDS data source of the pre-training examples (split "train") or of the
    held-out ones ("eval")."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    if split == "eval" and not load_summary(data_dir)["counts"].get("eval_examples"):
        raise PrepareError(
            f"{data_dir} has no held-out examples: prepare with --config.data.eval_fraction > 0 "
            "(the default holds out 5% of titles), or set train.eval_every=0"
        )
    return _source(data_dir, "examples" if split == "train" else "eval_examples", "realm_examples")


def load_blocks(data_dir: str, chunk: int = 4096) -> tuple[np.ndarray, list[str], list[str]]:
    """All blocks: (token_ids int32 [N, block_len] zero-padded, doc_ids, titles)."""
    src, block_len = blocks_source(data_dir), load_summary(data_dir)["block_len"]
    ids = np.zeros((len(src), block_len), np.int32)  # [N, block_len]
    doc_ids, titles = [], []
    for start in range(0, len(src), chunk):
        for i, rec in enumerate(src.__getitems__(range(start, min(start + chunk, len(src))))):
            t = rec["token_ids"][:block_len]
            ids[start + i, : len(t)] = t
            doc_ids.append(rec["doc_id"].decode())
            titles.append(rec["title"].decode())
    return ids, doc_ids, titles


def block_text(data_dir: str, block_id: int) -> tuple[str, str]:
    """(title, body text) of one block."""
    rec = blocks_source(data_dir)[int(block_id)]
    return rec["title"].decode(), rec["text"].decode()


def check_prepared(config, ddir: str) -> None:
    """The prepared data must have the lengths the config trains with."""
    built = load_summary(ddir)["config"]
    bad = [
        f"data.{k} is {config.data[k]} but {ddir} was prepared with {built[k]}"
        for k in ("block_len", "query_len", "max_predictions")
        if built.get(k) != config.data[k]
    ]
    if bad:
        raise ValueError("; ".join(bad) + ": re-run `realm-jax prepare --overwrite`")
