"""Versioned, crash-safe storage of the document-embedding index.

The refresh job publishes ``<index_dir>/step_<08d>/`` (embeddings.npy, an optional serialised
ScaNN searcher under scann/, and manifest.json). manifest.json is written LAST and is the
commit marker: it lists every file of the version with its size and sha256, and a reader
trusts only a version whose manifest exists and verifies.
- On a local (or NFS) index_dir the version is also built in a ``.tmp-*`` directory, fsynced
  and renamed into place, so a reader never even sees a partial folder.
- On an object store (gs://), which has no atomic rename, the files are written in place and
  the manifest last: a killed writer leaves a folder without a manifest, which readers skip
  and retention removes after a grace period (index/retention.py).
Versions written before the manifest listed every file (format 1: the embeddings' sha256 and
the ScaNN files' sizes) still load, verified as they were then.
Format 3 adds the sha256 of every block of `row_blocks.rows` consecutive rows of the
embeddings, so a trainer host reads and verifies only the rows its devices hold (load_rows):
at 13M x 128 float32 a swap is ~7 GB for one host over the whole matrix, 1/hosts of it this way.
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
import tempfile
import time
from typing import Any

import numpy as np

from realm_jax import fs

log = logging.getLogger(__name__)

FORMAT = 3  # 2: manifest["files"] lists every file with size and sha256; 3: + row_blocks
READ_FORMATS = (1, 2, 3)
# Rows per checksummed block of the embeddings (format 3): about 1,024 blocks a version, at
# least MIN_ROW_BLOCK rows each (13.35M x 128 float32: 13,041 rows = 6.7 MB a block).
MIN_ROW_BLOCK = 256
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
    fs.fsync_dir(path)


def _fsync_tree(root: str) -> None:
    """fsync every file and directory under `root` (children before parents)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(dirpath)


def _write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to `path` whole: a fsynced temp file and a rename locally, one object
    upload on an object store (fs.write_bytes)."""
    fs.write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


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


class UncommittedVersionError(CorruptIndexError):
    """A version folder without its manifest: being written, or left by a killed writer."""


def _load_manifest(path: str) -> dict:
    mpath = fs.join(path, MANIFEST)
    try:
        manifest = json.loads(fs.read_bytes(mpath))
    except FileNotFoundError:
        if not fs.isdir(path):
            raise CorruptIndexError(f"{path}: version directory does not exist") from None
        raise UncommittedVersionError(f"{path}: missing {MANIFEST} (not committed)") from None
    except (OSError, ValueError) as e:
        raise CorruptIndexError(f"{path}: bad JSON in {MANIFEST} ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in READ_FORMATS:
        raise CorruptIndexError(f"{path}: {MANIFEST} is not one of formats {READ_FORMATS}")
    missing = [k for k in _CORE_KEYS if k not in manifest]
    if missing:
        raise CorruptIndexError(f"{path}: {MANIFEST} lacks keys {missing}")
    return manifest


def _check_shape(path: str, manifest: dict, exp_n: int | None, exp_d: int | None) -> None:
    """Compare the .npy header and size with the manifest and the expected shape."""
    epath = fs.join(path, EMBEDDINGS)
    try:
        with fs.open(epath, "rb") as f:
            shape, fortran, dtype, offset = _read_npy_header(f, epath)
    except FileNotFoundError:
        raise CorruptIndexError(f"{path}: missing {EMBEDDINGS}") from None
    n, d = manifest["num_blocks"], manifest["dim"]
    if dtype != np.float32 or fortran or len(shape) != 2:
        raise CorruptIndexError(f"{epath}: expected 2-D C-order float32, got {dtype} {shape}")
    if tuple(shape) != (n, d):
        raise CorruptIndexError(f"{epath}: wrong shape {tuple(shape)}, manifest says {(n, d)}")
    size, want = fs.size(epath), offset + n * d * 4
    if size != want:
        what = "truncated" if size < want else "has trailing bytes"
        raise CorruptIndexError(f"{epath}: {what} ({size} bytes, expected {want})")
    if exp_n is not None and n != exp_n:
        raise CorruptIndexError(f"{path}: wrong num_blocks {n}, expected {exp_n}")
    if exp_d is not None and d != exp_d:
        raise CorruptIndexError(f"{path}: wrong dim {d}, expected {exp_d}")


def _size_or_none(path: str) -> int | None:
    try:
        return fs.size(path)
    except (FileNotFoundError, OSError):
        return None


def _check_scann(path: str, manifest: dict) -> None:
    """Format 1: the scann/ files named in the manifest must exist with their recorded sizes."""
    if not manifest["scann"]:
        return
    for rel, size in manifest.get("scann_files", {}).items():
        if _size_or_none(fs.join(path, SCANN_DIR, rel)) != size:
            raise CorruptIndexError(f"{path}: ScaNN file {SCANN_DIR}/{rel} missing or resized")


def _check_files(path: str, manifest: dict, checksum: bool) -> None:
    """Format 2: every file the manifest lists exists with its size (and sha256 when
    `checksum`: one read of each file)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or EMBEDDINGS not in files:
        raise CorruptIndexError(f"{path}: {MANIFEST} lists no files")
    for rel, want in sorted(files.items()):
        fpath = fs.join(path, *rel.split("/"))
        got = _size_or_none(fpath)
        if got != want["size"]:
            what = "missing" if got is None else f"{got} bytes, manifest says {want['size']}"
            kind = "ScaNN file" if rel.startswith(f"{SCANN_DIR}/") else "file"
            raise CorruptIndexError(f"{path}: {kind} {rel} {what}")
        if checksum and rel != EMBEDDINGS:  # the embeddings are hashed by the caller
            if (digest := _file_sha256(fpath)) != want["sha256"]:
                raise CorruptIndexError(
                    f"{path}: checksum mismatch in {rel} (sha256 {digest[:12]}..., "
                    f"manifest {want['sha256'][:12]}...)"
                )


def _file_sha256(path: str) -> str:
    sha = hashlib.sha256()
    with fs.open(path, "rb") as f:
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
    m = _VERSION_RE.match(fs.basename(path))
    if m and int(m.group(1)) != manifest["step"]:
        raise CorruptIndexError(f"{path}: manifest step {manifest['step']} != directory name")
    _check_shape(path, manifest, expected_num_blocks, expected_dim)
    if manifest["format"] == 1:
        _check_scann(path, manifest)
    else:
        _check_files(path, manifest, checksum)
    if checksum:
        digest = _file_sha256(fs.join(path, EMBEDDINGS))
        if digest != manifest["sha256"]:
            raise CorruptIndexError(
                f"{path}: checksum mismatch in {EMBEDDINGS} "
                f"(sha256 {digest[:12]}..., manifest {manifest['sha256'][:12]}...)"
            )
    return manifest


def _stat_signature(path: str) -> tuple | None:
    try:
        return tuple(fs.signature(fs.join(path, n)) for n in (MANIFEST, EMBEDDINGS))
    except OSError:
        return None  # verify_version will name what is missing


def _verify_cached(path: str, exp_n: int | None, exp_d: int | None) -> dict:
    """verify_version, hashing only when the files changed since the last success."""
    sig = _stat_signature(path)
    fresh = sig is None or _verified.get(path) != sig
    manifest = verify_version(path, expected_num_blocks=exp_n, expected_dim=exp_d, checksum=fresh)
    _verified[path] = sig
    return manifest


def list_versions(index_dir: str) -> list[int]:
    """Steps of the final-named version directories, ascending (temp dirs excluded). On an
    object store this includes versions still being written (no manifest yet): readers
    verify before they trust one."""
    steps = [int(m.group(1)) for n in fs.listdir(index_dir) if (m := _VERSION_RE.match(n))]
    if fs.is_remote(index_dir):
        return sorted(steps)  # a listing names folders only (one request, not one per step)
    return sorted(s for s in steps if os.path.isdir(os.path.join(index_dir, version_name(s))))


def latest_valid(
    index_dir: str,
    *,
    newer_than: int = -1,
    expected_num_blocks: int | None = None,
    expected_dim: int | None = None,
    checksum: bool = True,
    exclude: frozenset[int] = frozenset(),
) -> tuple[int, str] | None:
    """(step, path) of the newest version with step > newer_than that verifies, else None.
    checksum=False: structure only (manifest, shape, file sizes), for a reader that checks
    the rows it loads (load_rows); `exclude`: steps the caller found corrupt already.

    Corrupt versions are skipped with one warning per (path, reason), not one per poll; an
    uncommitted one on an object store (no manifest: maybe being written) with an info line.
    """
    for step in reversed(list_versions(index_dir)):
        if step <= newer_than:
            break
        path = fs.join(index_dir, version_name(step))
        if step in exclude:
            continue
        try:
            if checksum:
                _verify_cached(path, expected_num_blocks, expected_dim)
            else:
                verify_version(
                    path,
                    expected_num_blocks=expected_num_blocks,
                    expected_dim=expected_dim,
                    checksum=False,
                )
        except (CorruptIndexError, OSError) as e:
            key = (path, str(e))
            if key not in _warned:
                _warned.add(key)
                # On an object store a folder without a manifest may still be being written.
                quiet = isinstance(e, UncommittedVersionError) and fs.is_remote(path)
                level = logging.INFO if quiet else logging.WARNING
                log.log(level, "skipping index version %s: %s", path, e)
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
    epath = fs.join(path, EMBEDDINGS)
    size = fs.size(epath)
    with fs.open(epath, "rb") as f:
        _, _, _, offset = _read_npy_header(f, epath)
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


def load_rows(
    path: str, ranges: list[tuple[int, int]], *, verify: bool = True
) -> tuple[dict[tuple[int, int], np.ndarray], int]:
    """Read only rows [a, b) of a version's embeddings for each range (rows past num_blocks,
    the devices' padding, come back as zeros): ({range: [b - a, D] float32}, bytes read).

    Format 3: each range is widened to whole row blocks, and every block read is checked
    against its sha256 (CorruptIndexError names the rows of a block that fails), so a host
    verifies what it reads and nothing else. Older formats have no per-block sums: the whole
    matrix is read and verified (load_embeddings), as before."""
    manifest = _load_manifest(path)
    _check_shape(path, manifest, None, None)
    n, d = manifest["num_blocks"], manifest["dim"]
    blocks = manifest.get("row_blocks")
    out: dict[tuple[int, int], np.ndarray] = {}
    if manifest["format"] < 3 or not blocks:
        whole = load_embeddings(path, verify=verify)
        for a, b in ranges:
            out[(a, b)] = _rows_of(whole, a, b, d)
        return out, whole.nbytes
    rows, sums = int(blocks["rows"]), blocks["sha256"]
    if rows < 1 or len(sums) != -(-n // rows):
        raise CorruptIndexError(f"{path}: {MANIFEST} row_blocks do not cover {n} rows")
    epath = fs.join(path, EMBEDDINGS)
    # the row blocks holding some asked-for row, each read (and checked) once, in runs
    wanted = sorted({k for a, b in ranges for k in range(a // rows, -(-min(b, n) // rows))})
    runs: list[list[int]] = []
    for k in wanted:
        if runs and runs[-1][1] == k:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])
    got: dict[int, np.ndarray] = {}  # block -> its rows
    read = 0
    with fs.open(epath, "rb") as f:
        _, _, _, offset = _read_npy_header(f, epath)
        for first, last in runs:
            lo, hi = first * rows, min(last * rows, n)
            f.seek(offset + lo * d * 4)
            buf = f.read((hi - lo) * d * 4)
            read += len(buf)
            if len(buf) != (hi - lo) * d * 4:
                raise CorruptIndexError(f"{epath}: truncated in rows {lo}-{hi}")
            for k in range(first, last):
                a, b = k * rows, min((k + 1) * rows, n)
                piece = buf[(a - lo) * d * 4 : (b - lo) * d * 4]
                if verify and hashlib.sha256(piece).hexdigest() != sums[k]:
                    raise CorruptIndexError(
                        f"{path}: checksum mismatch in {EMBEDDINGS} rows {a}-{b}"
                    )
                got[k] = np.frombuffer(piece, np.float32).reshape(b - a, d)
    for a, b in ranges:
        ks = range(a // rows, -(-min(b, n) // rows))
        if not ks:
            out[(a, b)] = np.zeros((b - a, d), np.float32)
            continue
        span = np.concatenate([got[k] for k in ks]) if len(ks) > 1 else got[ks[0]]
        out[(a, b)] = _rows_of(span, a - ks[0] * rows, b - ks[0] * rows, d)
    return out, read


def _rows_of(arr: np.ndarray, a: int, b: int, d: int) -> np.ndarray:
    """arr[a:b], zero rows where b runs past the end."""
    part = arr[a : min(b, arr.shape[0])]
    if part.shape[0] == b - a:
        return part
    return np.concatenate([part, np.zeros((b - a - part.shape[0], d), np.float32)])


PROGRESS = "progress.json"  # the refresh job's current work (read_progress), beside versions


def write_progress(index_dir: str, **fields: Any) -> None:
    """The refresh job's progress (checkpoint, phase, done / of, since), with `updated` = now:
    what a trainer waiting for its first index reads, and its sign that the job is alive."""
    fs.makedirs(index_dir)  # the job's first report comes before anything is published
    _write_json_atomic(fs.join(index_dir, PROGRESS), {**fields, "updated": time.time()})


def read_progress(index_dir: str) -> dict | None:
    """The refresh job's last progress record, None when there is none (or it is unreadable:
    a record being replaced)."""
    try:
        record = json.loads(fs.read_bytes(fs.join(index_dir, PROGRESS)))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "updated" in record else None


def staleness(train_step: int, index_step: int) -> int:
    """Trainer step minus the step of the checkpoint the index was embedded from.

    Not clamped: a negative value means the trainer rolled back behind the index and is
    worth seeing in the metrics.
    """
    return int(train_step) - int(index_step)


def _write_scann(folder: str, searcher: Any) -> dict[str, dict]:
    """Serialise the searcher into folder/scann/ (through a local temp dir on an object
    store: ScaNN writes local files); returns {"scann/<rel>": {"size", "sha256"}}."""
    from realm_jax.index import scann as scann_index  # lazy: only needed with a searcher

    with tempfile.TemporaryDirectory(prefix="realm-scann-") as local:
        sdir = local if fs.is_remote(folder) else fs.join(folder, SCANN_DIR)
        scann_index.save_searcher(searcher, sdir)
        files = {
            f"{SCANN_DIR}/{rel}": {
                "size": os.path.getsize(os.path.join(sdir, *rel.split("/"))),
                "sha256": _file_sha256(os.path.join(sdir, *rel.split("/"))),
            }
            for rel in fs.walk_files(sdir)
        }
        if fs.is_remote(folder):
            fs.upload_tree(sdir, fs.join(folder, SCANN_DIR))
    return files


def row_block_rows(num_rows: int) -> int:
    """Rows per checksummed block for a matrix of `num_rows` rows (format 3)."""
    return max(MIN_ROW_BLOCK, -(-num_rows // 1024))


def _row_block_hashes(arr: np.ndarray, rows: int) -> list[str]:
    return [
        hashlib.sha256(memoryview(arr[i : i + rows]).cast("B")).hexdigest()
        for i in range(0, arr.shape[0], rows)
    ]


def _write_version(
    folder: str, step: int, arr: np.ndarray, searcher: Any, extra: dict, block_rows: int
) -> None:
    """Fill a version folder: embeddings, optional ScaNN searcher, then the manifest LAST (the
    commit marker), listing every file with its size and sha256 (and each block of
    `block_rows` rows' sha256)."""
    with fs.open(fs.join(folder, EMBEDDINGS), "wb") as f:
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, arr, allow_pickle=False)
        if not fs.is_remote(folder):
            f.flush()
            os.fsync(f.fileno())
    files = {EMBEDDINGS: {"size": fs.size(fs.join(folder, EMBEDDINGS))}}
    files[EMBEDDINGS]["sha256"] = writer.sha.hexdigest()
    if searcher is not None:
        files.update(_write_scann(folder, searcher))
    core = (FORMAT, int(step), *map(int, arr.shape), writer.sha.hexdigest(), time.time())
    manifest = {"source_checkpoint": None, "embed_seconds": None, **extra}
    manifest.update(zip(_CORE_KEYS, (*core, searcher is not None), strict=True))
    scann_files = {
        k.removeprefix(f"{SCANN_DIR}/"): v["size"] for k, v in files.items() if k != EMBEDDINGS
    }
    manifest.update({"scann_files": scann_files} if scann_files else {})  # as format 1 read it
    manifest["files"] = files
    manifest["row_blocks"] = {"rows": block_rows, "sha256": _row_block_hashes(arr, block_rows)}
    if fs.is_remote(folder):
        _write_json_atomic(fs.join(folder, MANIFEST), manifest)  # one object: the commit
        return
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    _fsync_tree(folder)


def _is_valid(path: str, checksum: bool = True) -> bool:
    try:
        verify_version(path, checksum=checksum)
        return True
    except (CorruptIndexError, OSError):
        return False


def _discard(path: str) -> None:
    """Remove a version so that it never looks half-deleted: locally renamed to a temp name
    first; on an object store its manifest (the commit marker) is deleted first."""
    if fs.is_remote(path):
        fs.remove(fs.join(path, MANIFEST))
        fs.rmtree(path)
        return
    base = os.path.dirname(path)
    m = _VERSION_RE.match(os.path.basename(path))
    step = int(m.group(1)) if m else 0
    trash = os.path.join(base, f".tmp-step_{step}-{os.getpid()}-{secrets.token_hex(4)}-del")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _writer_info() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()


def publish_index(
    index_dir: str,
    step: int,
    embeddings: Any,
    *,
    searcher: Any = None,
    extra: dict | None = None,
    block_rows: int | None = None,
) -> str:
    """Publish the embeddings (and optional ScaNN searcher) as version `step`: atomically on
    a local filesystem (temp dir + rename), committed by its manifest on an object store.

    Idempotent: if a valid version `step` already exists it is kept and its path returned.
    `extra` adds manifest fields (e.g. source_checkpoint, embed_seconds). Retention (keeping
    the last few versions) is index/retention.py's `cleanup`, which builds on this module.
    `block_rows`: rows per checksummed block (default row_block_rows(N)). Returns the final
    version path.
    """
    extra = dict(extra or {})
    if clash := set(extra) & set(_CORE_KEYS + ("files",)):
        raise ValueError(f"extra may not override manifest keys {sorted(clash)}")
    arr = _check_embeddings(embeddings)
    block_rows = int(block_rows or row_block_rows(arr.shape[0]))
    final = fs.join(index_dir, version_name(step))
    if fs.is_remote(index_dir):
        if not _is_valid(final):
            # Uncommit first: a reader must never pair an old manifest with new files.
            fs.remove(fs.join(final, MANIFEST))
            fs.write_bytes(fs.join(final, WRITER), _writer_info())
            _write_version(final, step, arr, searcher, extra, block_rows)
        return final
    os.makedirs(index_dir, exist_ok=True)
    if not (os.path.isdir(final) and _is_valid(final)):
        tmp = os.path.join(index_dir, f".tmp-step_{int(step)}-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        try:
            with open(os.path.join(tmp, WRITER), "wb") as f:
                f.write(_writer_info())
            _write_version(tmp, step, arr, searcher, extra, block_rows)
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
