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
Format 4 (publish_rows, the refresh job and the in-process refresh) is written by every process
of a job at once: each writes the rows its own devices hold as ``rows/<start>-<stop>.npy`` parts
(each with its block sums) and process 0 writes the manifest once every part is written, so no
device and no host ever holds the whole matrix to publish it (issue 58). Readers of formats 3
and 4 share one row reader (load_rows); load_embeddings (the whole matrix, for ScaNN, the Python
API, evaluation) is built on it for format 4.
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
# 4: the rows in parts written by the processes that own them (publish_rows), each part with its
# row blocks' sums (manifest["row_parts"]). publish_index (a whole host matrix: fine-tuning's
# frozen index, imports) still writes format 3, so its callers and workdirs are unchanged.
FORMAT_ROWS = 4
READ_FORMATS = (1, 2, 3, 4)
ROWS_DIR = "rows"
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
    """Compare the .npy header and size with the manifest and the expected shape (format 4:
    that its row parts partition the rows; their sizes are checked with the files)."""
    n, d = manifest["num_blocks"], manifest["dim"]
    if manifest["format"] >= FORMAT_ROWS:
        _segments(path, manifest)
    else:
        _check_npy(path, n, d)
    if exp_n is not None and n != exp_n:
        raise CorruptIndexError(f"{path}: wrong num_blocks {n}, expected {exp_n}")
    if exp_d is not None and d != exp_d:
        raise CorruptIndexError(f"{path}: wrong dim {d}, expected {exp_d}")


def _check_npy(path: str, n: int, d: int, rel: str = EMBEDDINGS) -> int:
    """An .npy file of the version must hold [n, d] C-order float32, whole; its data offset."""
    epath = fs.join(path, *rel.split("/"))
    try:
        with fs.open(epath, "rb") as f:
            shape, fortran, dtype, offset = _read_npy_header(f, epath)
    except FileNotFoundError:
        raise CorruptIndexError(f"{path}: missing {rel}") from None
    if dtype != np.float32 or fortran or len(shape) != 2:
        raise CorruptIndexError(f"{epath}: expected 2-D C-order float32, got {dtype} {shape}")
    if tuple(shape) != (n, d):
        raise CorruptIndexError(f"{epath}: wrong shape {tuple(shape)}, manifest says {(n, d)}")
    size, want = fs.size(epath), offset + n * d * 4
    if size != want:
        what = "truncated" if size < want else "has trailing bytes"
        raise CorruptIndexError(f"{epath}: {what} ({size} bytes, expected {want})")
    return offset


def _segments(path: str, manifest: dict) -> list[dict] | None:
    """The version's rows as checksummed segments [{file, start, stop, rows, sha256}]: the
    parts of format 4, the one embeddings file of format 3; None before format 3 (no block
    sums). CorruptIndexError when they do not partition [0, num_blocks)."""
    n = manifest["num_blocks"]
    if manifest["format"] >= FORMAT_ROWS:
        segs = manifest.get("row_parts")
        if not isinstance(segs, list) or not segs:
            raise CorruptIndexError(f"{path}: {MANIFEST} lists no row parts")
    elif manifest["format"] == 3 and (blocks := manifest.get("row_blocks")):
        segs = [{"file": EMBEDDINGS, "start": 0, "stop": n, **blocks}]
    else:
        return None
    try:
        segs = sorted(segs, key=lambda seg: int(seg["start"]))
        _check_partition(path, segs, n)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptIndexError(f"{path}: malformed row parts in {MANIFEST} ({e})") from e
    return segs


def _check_partition(path: str, segs: list[dict], n: int) -> None:
    """Segments (sorted by start) must cover rows 0..n once each, with one sum per block."""
    at = 0
    for seg in segs:
        a, b, rows = int(seg["start"]), int(seg["stop"]), int(seg["rows"])
        if a != at or b <= a:
            raise CorruptIndexError(f"{path}: row parts do not partition {n} rows (at row {at})")
        if rows < 1 or len(seg["sha256"]) != -(-(b - a) // rows):
            raise CorruptIndexError(f"{path}: {MANIFEST} row blocks do not cover rows {a}-{b}")
        at = b
    if at != n:
        raise CorruptIndexError(f"{path}: row parts cover {at} of {n} rows")


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
    need = [EMBEDDINGS]
    if manifest["format"] >= FORMAT_ROWS:
        need = [seg["file"] for seg in manifest["row_parts"]]
    if not isinstance(files, dict) or not all(rel in files for rel in need):
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
    if checksum and manifest["format"] < FORMAT_ROWS:  # format 4's parts: in _check_files
        digest = _file_sha256(fs.join(path, EMBEDDINGS))
        if digest != manifest["sha256"]:
            raise CorruptIndexError(
                f"{path}: checksum mismatch in {EMBEDDINGS} "
                f"(sha256 {digest[:12]}..., manifest {manifest['sha256'][:12]}...)"
            )
    return manifest


def _stat_signature(path: str) -> tuple | None:
    """What changes when a version's data is rewritten: its manifest and embeddings (format
    4: every file the manifest lists)."""
    try:
        names = [MANIFEST, EMBEDDINGS]
        if not fs.exists(fs.join(path, EMBEDDINGS)):
            names[1:] = sorted(json.loads(fs.read_bytes(fs.join(path, MANIFEST)))["files"])
        return tuple(fs.signature(fs.join(path, *n.split("/"))) for n in names)
    except (OSError, ValueError, KeyError, TypeError):
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
    """Read a version's whole embeddings [N, D] into memory, checking their sha256 (for the
    readers that need every row on one host: ScaNN, the Python API, evaluation).

    Formats 1-3: the file is read once into a buffer that is hashed and then viewed as the
    array (one read, one copy). Format 4: load_rows of every row, each block checked."""
    manifest = _load_manifest(path)
    _check_shape(path, manifest, None, None)
    n, d = manifest["num_blocks"], manifest["dim"]
    if manifest["format"] >= FORMAT_ROWS:
        return load_rows(path, [(0, n)], verify=verify)[0][(0, n)]
    epath = fs.join(path, EMBEDDINGS)
    size = fs.size(epath)
    with fs.open(epath, "rb") as f:
        _, _, _, offset = _read_npy_header(f, epath)
        f.seek(0)
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size and (k := f.readinto(view[got : got + (1 << 26)])):
            got += k
    if got != size:
        raise CorruptIndexError(f"{epath}: truncated while reading ({got} of {size} bytes)")
    if verify and hashlib.sha256(buf).hexdigest() != manifest["sha256"]:
        raise CorruptIndexError(f"{path}: checksum mismatch in {EMBEDDINGS}")
    return np.frombuffer(buf, dtype=np.float32, count=n * d, offset=offset).reshape(n, d)


def load_rows(
    path: str, ranges: list[tuple[int, int]], *, verify: bool = True
) -> tuple[dict[tuple[int, int], np.ndarray], int]:
    """Read only rows [a, b) of a version's embeddings for each range (rows past num_blocks,
    the devices' padding, come back as zeros): ({range: [b - a, D] float32}, bytes read).

    Formats 3 and 4: only the row blocks holding asked-for rows are read, each checked
    against its sha256 (CorruptIndexError names the rows of a block that fails), so a host
    verifies what it reads and nothing else. Older formats have no per-block sums: the whole
    matrix is read and verified (load_embeddings), as before."""
    manifest = _load_manifest(path)
    _check_shape(path, manifest, None, None)
    d = manifest["dim"]
    segs = _segments(path, manifest)
    if segs is None:
        whole = load_embeddings(path, verify=verify)
        return {(a, b): _rows_of(whole, a, b, d) for a, b in ranges}, whole.nbytes
    out = {(a, b): np.zeros((b - a, d), np.float32) for a, b in ranges}
    read = 0
    for seg in segs:
        read += _read_segment(path, seg, d, out, verify)
    return out, read


def _rows_of(arr: np.ndarray, a: int, b: int, d: int) -> np.ndarray:
    """arr[a:b], zero rows where b runs past the end."""
    part = arr[a : min(b, arr.shape[0])]
    if part.shape[0] == b - a:
        return part
    return np.concatenate([part, np.zeros((b - a - part.shape[0], d), np.float32)])


_RUN_BYTES = 1 << 26  # at most this much read at once (a whole load holds it beside the rows)


def _read_segment(path: str, seg: dict, d: int, out: dict, verify: bool) -> int:
    """Copy the rows of one segment that fall in out's ranges into out's arrays, reading (and
    checking) each block holding one of them once, in runs of consecutive blocks; bytes read."""
    lo_seg, hi_seg, rows = int(seg["start"]), int(seg["stop"]), int(seg["rows"])
    wanted = sorted(
        {
            k
            for a, b in out
            for k in range((max(a, lo_seg) - lo_seg) // rows, -(-(min(b, hi_seg) - lo_seg) // rows))
        }
    )
    if not wanted:
        return 0
    per_run = max(1, _RUN_BYTES // (rows * d * 4))
    runs: list[list[int]] = []
    for k in wanted:
        if runs and runs[-1][1] == k and k - runs[-1][0] < per_run:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])
    rel, read = seg["file"], 0
    offset = _check_npy(path, hi_seg - lo_seg, d, rel)
    epath = fs.join(path, *rel.split("/"))
    with fs.open(epath, "rb") as f:
        for first, last in runs:
            lo, hi = lo_seg + first * rows, min(lo_seg + last * rows, hi_seg)
            f.seek(offset + (lo - lo_seg) * d * 4)
            buf = f.read((hi - lo) * d * 4)
            read += len(buf)
            if len(buf) != (hi - lo) * d * 4:
                raise CorruptIndexError(f"{epath}: truncated in rows {lo}-{hi}")
            for k in range(first, last) if verify else ():
                a, b = lo_seg + k * rows, min(lo_seg + (k + 1) * rows, hi_seg)
                piece = buf[(a - lo) * d * 4 : (b - lo) * d * 4]
                if hashlib.sha256(piece).hexdigest() != seg["sha256"][k]:
                    where = "" if rel == EMBEDDINGS else f" ({rel})"
                    raise CorruptIndexError(
                        f"{path}: checksum mismatch in {EMBEDDINGS} rows {a}-{b}{where}"
                    )
            got = np.frombuffer(buf, np.float32).reshape(hi - lo, d)
            for (a, b), dst in out.items():
                if max(a, lo) < min(b, hi):
                    dst[max(a, lo) - a : min(b, hi) - a] = got[max(a, lo) - lo : min(b, hi) - lo]
    return read


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
    _write_manifest(folder, manifest)


def _write_manifest(folder: str, manifest: dict) -> None:
    """The commit marker, written last: one object on an object store; locally a file, then
    every file of the temp dir fsynced (before the caller renames it into place)."""
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


def _check_extra(extra: dict | None) -> dict:
    extra = dict(extra or {})
    if clash := set(extra) & set(_CORE_KEYS + ("files", "row_blocks", "row_parts")):
        raise ValueError(f"extra may not override manifest keys {sorted(clash)}")
    return extra


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
    extra = _check_extra(extra)
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


# Publishing by row ranges (format 4). Why parts of plain .npy files and not orbax/tensorstore's
# sharded array writes: this store is plain files under a manifest that is the commit marker,
# read without JAX by ScaNN's build, the Python API and evaluation, and verified per row block;
# orbax would bring a second commit protocol (its own metadata and finalisation) and a layout
# these readers would have to learn, for what a few files per process already give.


def part_name(start: int, stop: int) -> str:
    """A row part's path inside its version folder."""
    return f"{ROWS_DIR}/{start:012d}-{stop:012d}.npy"


def write_part(folder: str, start: int, rows: np.ndarray, block_rows: int) -> dict:
    """Write rows [start, start + len(rows)) of a version as one part, fsynced locally; its
    record for the manifest: file, rows range, block sums, size and the file's sha256."""
    arr = _check_embeddings(rows)
    rel = part_name(start, start + arr.shape[0])
    fpath = fs.join(folder, *rel.split("/"))
    fs.makedirs(fs.dirname(fpath))
    with fs.open(fpath, "wb") as f:
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, arr, allow_pickle=False)
        if not fs.is_remote(folder):
            f.flush()
            os.fsync(f.fileno())
    return {
        "file": rel,
        "start": int(start),
        "stop": int(start + arr.shape[0]),
        "rows": int(block_rows),
        "sha256": _row_block_hashes(arr, block_rows),
        "size": fs.size(fpath),
        "file_sha256": writer.sha.hexdigest(),
    }


def _parts_record(folder: str, process: int) -> str:
    return fs.join(folder, ROWS_DIR, f"p{process:05d}.json")


def _write_my_parts(folder, parts, num_rows: int, block_rows: int, process: int) -> None:
    """This process's rows (those past num_rows, the devices' padding, dropped) as parts, then
    the list of their records (process 0 gathers these to write the manifest)."""
    records = []
    for start, rows in parts:
        rows = rows[: max(0, num_rows - int(start))]
        if len(rows):
            records.append(write_part(folder, int(start), rows, block_rows))
    fs.write_bytes(_parts_record(folder, process), json.dumps(records).encode())


def _open_version(index_dir: str, step: int) -> str:
    """Process 0: the folder every process writes version `step` into ("" when a valid one is
    already published): a new temp dir locally, the final folder uncommitted on an object store
    (a reader must never pair an old manifest with new files)."""
    final = fs.join(index_dir, version_name(step))
    if fs.is_remote(index_dir):
        if _is_valid(final):
            return ""
        fs.remove(fs.join(final, MANIFEST))
        fs.write_bytes(fs.join(final, WRITER), _writer_info())
        return final
    os.makedirs(index_dir, exist_ok=True)
    if os.path.isdir(final) and _is_valid(final):
        return ""
    tmp = os.path.join(index_dir, f".tmp-step_{int(step)}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    with open(os.path.join(tmp, WRITER), "wb") as f:
        f.write(_writer_info())
    return tmp


def _commit_rows(folder, step, num_rows, dim, processes, searcher_fn, extra) -> None:
    """Process 0, once every process wrote its rows: check that the parts partition the rows,
    build the searcher from them when asked (read back on this host, never gathered on
    devices), write the manifest and, locally, rename the temp dir into place."""
    records = []
    for p in range(processes):
        try:
            records += json.loads(fs.read_bytes(_parts_record(folder, p)))
        except FileNotFoundError:
            raise OSError(
                f"{folder}: process {p}'s rows are not there: every process of the job must "
                "write to the same index folder (gs:// on a pod)"
            ) from None
    keys = ("file", "start", "stop", "rows", "sha256")
    segs = sorted(({k: r[k] for k in keys} for r in records), key=lambda r: r["start"])
    _check_partition(folder, segs, num_rows)
    files = {r["file"]: {"size": r["size"], "sha256": r["file_sha256"]} for r in records}
    searcher = None
    if searcher_fn is not None:
        whole = {(0, num_rows): np.empty((num_rows, dim), np.float32)}
        for seg in segs:
            _read_segment(folder, seg, dim, whole, verify=True)
        searcher = searcher_fn(whole.pop((0, num_rows)))
    if searcher is not None:
        files.update(_write_scann(folder, searcher))
    digest = hashlib.sha256("".join(files[s["file"]]["sha256"] for s in segs).encode())
    core = (FORMAT_ROWS, int(step), int(num_rows), int(dim), digest.hexdigest(), time.time())
    manifest = {"source_checkpoint": None, "embed_seconds": None, **extra}
    manifest.update(zip(_CORE_KEYS, (*core, searcher is not None), strict=True))
    manifest.update(files=files, row_parts=segs)
    _write_manifest(folder, manifest)
    final = fs.join(fs.dirname(folder), version_name(step))
    if folder != final:  # a local temp dir
        try:
            _install(folder, final)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        _fsync_dir(fs.dirname(final))


_rounds = [0]  # publish_rows calls so far: every process makes them in the same order


def publish_rows(
    index_dir: str,
    step: int,
    parts: list[tuple[int, np.ndarray]],
    num_rows: int,
    dim: int,
    *,
    searcher_fn=None,
    extra: dict | None = None,
    block_rows: int | None = None,
    timeout_s: float = 3600.0,
) -> str:
    """Publish version `step` (format 4) from every process at once: each writes `parts`,
    the (first row, rows) its own devices hold (sharding.owned_row_shards), and process 0
    writes the manifest once all are written, after `searcher_fn(whole host matrix)` when
    given (a ScaNN searcher, built from the rows read back on process 0's host).

    A collective: every process calls it, in the same order. A failure on any process (a
    storage error, non-finite rows) raises OSError on every process, naming who failed,
    instead of leaving the others waiting. Idempotent like publish_index. Returns the path."""
    import jax

    extra = _check_extra(extra)
    block_rows = int(block_rows or row_block_rows(num_rows))
    me, processes = jax.process_index(), jax.process_count()
    _rounds[0] += 1
    tag = f"index-{int(step)}-{_rounds[0]}"
    final = fs.join(index_dir, version_name(step))
    folder = _process_0s_text(lambda: _open_version(index_dir, step))
    if not folder:
        return final  # already published
    failed = _failed_on(
        lambda: _write_my_parts(folder, parts, num_rows, block_rows, me), tag, timeout_s
    )
    if failed:
        if me == 0 and folder != final:
            shutil.rmtree(folder, ignore_errors=True)
        raise OSError(
            f"index version {step} not published: process(es) {failed} could not write "
            "their rows (their logs say why)"
        )

    def commit() -> None:
        if me == 0:
            _commit_rows(folder, step, num_rows, dim, processes, searcher_fn, extra)

    if _failed_on(commit, tag + "-commit", timeout_s):
        if me == 0 and folder != final:
            shutil.rmtree(folder, ignore_errors=True)
        raise OSError(f"index version {step} not published: process 0 could not commit it")
    return final


def _process_0s_text(fn) -> str:
    """fn() on process 0 (a folder name), the same text on every process; an error there
    raises OSError on every process."""
    from realm_jax import sharding

    text = ""
    try:
        text = fn() if _process_index() == 0 else ""
    except Exception as e:  # noqa: BLE001 - reaches every process, never leaves them waiting
        log.error("index: could not open a version folder: %s", e)
        text = f"!{type(e).__name__}: {e}"
    text = sharding.broadcast_text(text)
    if text.startswith("!"):
        raise OSError(f"index: process 0 could not open the version folder ({text[1:]})")
    return text


def _failed_on(fn, tag: str, timeout_s: float = 3600.0) -> list[int]:
    """Run fn() on every process, then wait for all (a coordination barrier: writes may take
    minutes) and return the processes on which it raised (logged there)."""
    import jax
    from jax.experimental import multihost_utils

    from realm_jax import runtime

    ok = True
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any failure is reported to every process
        log.error("index: process %d: %s: %s", jax.process_index(), type(e).__name__, e)
        ok = False
    if jax.process_count() == 1:
        return [] if ok else [0]
    runtime.barrier(tag, timeout_s)
    flags = np.asarray(multihost_utils.process_allgather(np.int32(ok))).reshape(-1)
    return [int(p) for p in np.flatnonzero(flags == 0)]


def _process_index() -> int:
    import jax

    return jax.process_index()


def non_finite_rows(parts: list[tuple[int, np.ndarray]], num_rows: int) -> int:
    """Rows (below num_rows) of every process's `parts` that hold NaN or inf, summed over the
    processes (a collective: every process calls it), so all agree not to publish them."""
    import jax
    from jax.experimental import multihost_utils

    bad = sum(
        int((~np.isfinite(rows[: max(0, num_rows - start)]).all(axis=1)).sum())
        for start, rows in parts
    )
    if jax.process_count() == 1:
        return bad
    return int(np.asarray(multihost_utils.process_allgather(np.int64(bad))).sum())
