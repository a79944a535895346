"""Versioned, crash-safe storage of the document-embedding index.

The refresh job publishes ``<index_dir>/step_<08d>/`` (embeddings.npy, manifest.json and an
optional serialised ScaNN searcher under scann/) by writing everything into a ``.tmp-*``
directory, fsyncing it and renaming it into place, so a reader never sees a partial version.
Trainers pick the newest version that verifies and hold a lease (``in_use/<owner>.json``) so
retention never deletes what they still use; leases and retention live in
index/retention.py, which imports this module (never the reverse).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.npy"
SCANN_DIR = "scann"
WRITER = ".writer"  # {"host", "pid"} of the writer, first file in a temp dir (kept after)
_VERSION_RE = re.compile(r"^step_(\d+)$")
_CORE_KEYS = ("format", "step", "num_blocks", "dim", "sha256", "created", "scann")
_CHUNK = 1 << 22

_warned: set[tuple[str, str]] = set()  # (path, reason) already logged by latest_valid
_verified: dict[str, tuple] = {}  # path -> stat signature of a version that verified


class CorruptIndexError(ValueError):
    """A published index version is missing, malformed or fails its checksum."""


def version_name(step: int) -> str:
    """The final directory name of the version published at `step`."""
    return f"step_{int(step):08d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file and directory under `root` (children before parents)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(dirpath)


def _write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to `path` via a fsynced temp file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


class _HashingWriter:
    """File wrapper that hashes what np.lib.format.write_array writes (one pass, chunked)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)


def _check_embeddings(embeddings: Any) -> np.ndarray:
    """Validate [N, D] finite floats; return float32 C-contiguous."""
    arr = np.ascontiguousarray(embeddings, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"embeddings must be [num_blocks, dim], got shape {arr.shape}")
    for start in range(0, arr.shape[0], 1 << 16):
        if not np.isfinite(arr[start : start + (1 << 16)]).all():
            raise ValueError(f"embeddings contain NaN/inf (rows from {start})")
    return arr


def _read_npy_header(f, path: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Parse an .npy header; returns (shape, fortran_order, dtype, data offset)."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except Exception as e:  # numpy raises ValueError/EOFError/SyntaxError on bad headers
        raise CorruptIndexError(f"{path}: unreadable .npy header ({e})") from e
    return shape, fortran, dtype, f.tell()


def _load_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CorruptIndexError(f"{path}: version directory does not exist")
    if not os.path.isfile(mpath):
        raise CorruptIndexError(f"{path}: missing {MANIFEST}")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptIndexError(f"{path}: bad JSON in {MANIFEST} ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptIndexError(f"{path}: {MANIFEST} is not format {FORMAT}")
    missing = [k for k in _CORE_KEYS if k not in manifest]
    if missing:
        raise CorruptIndexError(f"{path}: {MANIFEST} lacks keys {missing}")
    return manifest


def _check_shape(path: str, manifest: dict, exp_n: int | None, exp_d: int | None) -> None:
    """Compare the .npy header and size with the manifest and the expected shape."""
    epath = os.path.join(path, EMBEDDINGS)
    if not os.path.isfile(epath):
        raise CorruptIndexError(f"{path}: missing {EMBEDDINGS}")
    with open(epath, "rb") as f:
        shape, fortran, dtype, offset = _read_npy_header(f, epath)
    n, d = manifest["num_blocks"], manifest["dim"]
    if dtype != np.float32 or fortran or len(shape) != 2:
        raise CorruptIndexError(f"{epath}: expected 2-D C-order float32, got {dtype} {shape}")
    if tuple(shape) != (n, d):
        raise CorruptIndexError(f"{epath}: wrong shape {tuple(shape)}, manifest says {(n, d)}")
    size, want = os.path.getsize(epath), offset + n * d * 4
    if size != want:
        what = "truncated" if size < want else "has trailing bytes"
        raise CorruptIndexError(f"{epath}: {what} ({size} bytes, expected {want})")
    if exp_n is not None and n != exp_n:
        raise CorruptIndexError(f"{path}: wrong num_blocks {n}, expected {exp_n}")
    if exp_d is not None and d != exp_d:
        raise CorruptIndexError(f"{path}: wrong dim {d}, expected {exp_d}")


def _check_scann(path: str, manifest: dict) -> None:
    """The scann/ files named in the manifest must exist with their recorded sizes."""
    if not manifest["scann"]:
        return
    for rel, size in manifest.get("scann_files", {}).items():
        fpath = os.path.join(path, SCANN_DIR, rel)
        if not os.path.isfile(fpath) or os.path.getsize(fpath) != size:
            raise CorruptIndexError(f"{path}: ScaNN file {SCANN_DIR}/{rel} missing or resized")


def _file_sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def verify_version(
    path: str,
    *,
    expected_num_blocks: int | None = None,
    expected_dim: int | None = None,
    checksum: bool = True,
) -> dict:
    """Check a version directory and return its manifest; raise CorruptIndexError if bad.

    `checksum=False` skips hashing the embeddings (header, sizes and manifest still checked);
    retention uses that cheap form.
    """
    manifest = _load_manifest(path)
    m = _VERSION_RE.match(os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != manifest["step"]:
        raise CorruptIndexError(f"{path}: manifest step {manifest['step']} != directory name")
    _check_shape(path, manifest, expected_num_blocks, expected_dim)
    _check_scann(path, manifest)
    if checksum:
        digest = _file_sha256(os.path.join(path, EMBEDDINGS))
        if digest != manifest["sha256"]:
            raise CorruptIndexError(
                f"{path}: checksum mismatch in {EMBEDDINGS} "
                f"(sha256 {digest[:12]}..., manifest {manifest['sha256'][:12]}...)"
            )
    return manifest


def _stat_signature(path: str) -> tuple | None:
    try:
        sts = [os.stat(os.path.join(path, n)) for n in (MANIFEST, EMBEDDINGS)]
    except OSError:
        return None  # verify_version will name what is missing
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in sts)


def _verify_cached(path: str, exp_n: int | None, exp_d: int | None) -> dict:
    """verify_version, hashing only when the files changed since the last success."""
    sig = _stat_signature(path)
    fresh = sig is None or _verified.get(path) != sig
    manifest = verify_version(path, expected_num_blocks=exp_n, expected_dim=exp_d, checksum=fresh)
    _verified[path] = sig
    return manifest


def list_versions(index_dir: str) -> list[int]:
    """Steps of the final-named version directories, ascending (temp dirs excluded)."""
    try:
        names = os.listdir(index_dir)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for n in names if (m := _VERSION_RE.match(n))]
    return sorted(s for s in steps if os.path.isdir(os.path.join(index_dir, version_name(s))))


def latest_valid(
    index_dir: str,
    *,
    newer_than: int = -1,
    expected_num_blocks: int | None = None,
    expected_dim: int | None = None,
) -> tuple[int, str] | None:
    """(step, path) of the newest version with step > newer_than that verifies, else None.

    Corrupt versions are skipped with one warning per (path, reason), not one per poll.
    """
    for step in reversed(list_versions(index_dir)):
        if step <= newer_than:
            break
        path = os.path.join(index_dir, version_name(step))
        try:
            _verify_cached(path, expected_num_blocks, expected_dim)
        except (CorruptIndexError, OSError) as e:
            key = (path, str(e))
            if key not in _warned:
                _warned.add(key)
                log.warning("skipping index version %s: %s", path, e)
            continue
        return step, path
    return None


def load_embeddings(path: str, *, verify: bool = True) -> np.ndarray:
    """Read a version's embeddings into memory in one pass, checking the manifest's sha256.

    The file is read once into a buffer that is hashed and then viewed as the array, so a
    verified load costs one read and one copy of the matrix (no pickle, no memmap left open).
    """
    manifest = _load_manifest(path)
    _check_shape(path, manifest, None, None)
    epath = os.path.join(path, EMBEDDINGS)
    with open(epath, "rb") as f:
        _, _, _, offset = _read_npy_header(f, epath)
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size and (n := f.readinto(view[got : got + (1 << 26)])):
            got += n
    if got != size:
        raise CorruptIndexError(f"{epath}: truncated while reading ({got} of {size} bytes)")
    if verify and hashlib.sha256(buf).hexdigest() != manifest["sha256"]:
        raise CorruptIndexError(f"{path}: checksum mismatch in {EMBEDDINGS}")
    n, d = manifest["num_blocks"], manifest["dim"]
    return np.frombuffer(buf, dtype=np.float32, count=n * d, offset=offset).reshape(n, d)


def staleness(train_step: int, index_step: int) -> int:
    """Trainer step minus the step of the checkpoint the index was embedded from.

    Not clamped: a negative value means the trainer rolled back behind the index and is
    worth seeing in the metrics.
    """
    return int(train_step) - int(index_step)


def _write_version(tmp: str, step: int, arr: np.ndarray, searcher: Any, extra: dict) -> None:
    """Fill the temp dir: embeddings, optional ScaNN searcher, then the manifest last."""
    with open(os.path.join(tmp, EMBEDDINGS), "wb") as f:
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    scann_files: dict[str, int] = {}
    if searcher is not None:
        from realm_jax.index import (
            scann as scann_index,  # lazy: scann is only needed when a searcher is given
        )

        sdir = os.path.join(tmp, SCANN_DIR)
        scann_index.save_searcher(searcher, sdir)
        for dirpath, _, names in os.walk(sdir):
            for name in names:
                full = os.path.join(dirpath, name)
                scann_files[os.path.relpath(full, sdir)] = os.path.getsize(full)
    core = (FORMAT, int(step), *map(int, arr.shape), writer.sha.hexdigest(), time.time())
    manifest = {"source_checkpoint": None, "embed_seconds": None, **extra}
    manifest.update(zip(_CORE_KEYS, (*core, searcher is not None), strict=True))
    manifest.update({"scann_files": scann_files} if scann_files else {})
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    _fsync_tree(tmp)


def _is_valid(path: str, checksum: bool = True) -> bool:
    try:
        verify_version(path, checksum=checksum)
        return True
    except (CorruptIndexError, OSError):
        return False


def _discard(path: str) -> None:
    """Remove a directory: first rename it to a temp name so it never looks half-deleted."""
    base = os.path.dirname(path)
    m = _VERSION_RE.match(os.path.basename(path))
    step = int(m.group(1)) if m else 0
    trash = os.path.join(base, f".tmp-step_{step}-{os.getpid()}-{secrets.token_hex(4)}-del")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def publish_index(
    index_dir: str,
    step: int,
    embeddings: Any,
    *,
    searcher: Any = None,
    extra: dict | None = None,
) -> str:
    """Atomically publish the embeddings (and optional ScaNN searcher) as version `step`.

    Idempotent: if a valid version `step` already exists it is kept and its path returned.
    `extra` adds manifest fields (e.g. source_checkpoint, embed_seconds). Retention (keeping
    the last few versions) is index/retention.py's `cleanup`, which builds on this module.
    Returns the final version path.
    """
    extra = dict(extra or {})
    if clash := set(extra) & set(_CORE_KEYS):
        raise ValueError(f"extra may not override manifest keys {sorted(clash)}")
    arr = _check_embeddings(embeddings)
    os.makedirs(index_dir, exist_ok=True)
    final = os.path.join(index_dir, version_name(step))
    if not (os.path.isdir(final) and _is_valid(final)):
        tmp = os.path.join(index_dir, f".tmp-step_{int(step)}-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        try:
            with open(os.path.join(tmp, WRITER), "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
            _write_version(tmp, step, arr, searcher, extra)
            _install(tmp, final)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        _fsync_dir(index_dir)
    return final


def _install(tmp: str, final: str) -> None:
    """Rename tmp to final; a valid concurrent publish wins, a corrupt old one is replaced."""
    for _ in range(3):
        try:
            os.rename(tmp, final)
            return
        except OSError:  # final exists and is not empty (EEXIST / ENOTEMPTY)
            if not os.path.isdir(final):
                continue
            if _is_valid(final):
                log.info("index version %s already published; keeping it", final)
                return
            log.warning("replacing corrupt index version %s", final)
            _discard(final)
    raise OSError(f"could not install {tmp} as {final}")
