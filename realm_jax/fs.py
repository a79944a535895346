"""One file-system layer for run paths: local paths and object-store URLs (gs://) alike.

Remote paths go through etils.epath, the path type orbax and TFDS use themselves (gs:// through
gcsfs, or tf.io.gfile where TensorFlow is installed); local paths keep plain os calls, so local
runs keep their fsync and atomic-rename guarantees. What an object store lacks (an atomic
rename of a folder, flock) is handled by the callers' protocols: a commit marker written last
(index/store.py, data/prepare.py) and a lease object (lock.py).
"""

from __future__ import annotations

import builtins
import os
import posixpath
import secrets
import shutil
from collections.abc import Iterator
from typing import IO

import fsspec
from etils import epath

# gcsfs caches folder listings for the life of the process by default: a trainer polling
# index/ would never see the refresher's new versions. Each listing is asked afresh.
fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)


def is_remote(path: str) -> bool:
    """Whether `path` is an object-store URL (gs://bucket/...) rather than a local path."""
    return "://" in os.fspath(path)


def _ep(path: str) -> epath.Path:
    return epath.Path(os.fspath(path))


def join(path: str, *names: str) -> str:
    """os.path.join for local paths; '/'-joined for URLs on every OS."""
    return posixpath.join(path, *names) if is_remote(path) else os.path.join(path, *names)


def abspath(path: str) -> str:
    """An absolute local path; a URL unchanged (without a trailing '/')."""
    return os.fspath(path).rstrip("/") if is_remote(path) else os.path.abspath(path)


def basename(path: str) -> str:
    return posixpath.basename(os.fspath(path).rstrip("/"))


def dirname(path: str) -> str:
    p = os.fspath(path).rstrip("/")
    return posixpath.dirname(p) if is_remote(p) else os.path.dirname(p)


def exists(path: str) -> bool:
    return _ep(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    """A folder (on an object store: a prefix with at least one object under it)."""
    return _ep(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    p = _ep(path)
    return p.exists() and not p.is_dir()


def listdir(path: str) -> list[str]:
    """Names of a folder's entries; [] when it does not exist."""
    if not is_remote(path):
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []
    p = _ep(path)
    if not p.is_dir():
        return []
    return [basename(os.fspath(c)) for c in p.iterdir()]


def makedirs(path: str) -> None:
    """mkdir -p; nothing to do on an object store (prefixes need no folder objects)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def size(path: str) -> int:
    return _ep(path).stat().length if is_remote(path) else os.path.getsize(path)


def signature(path: str) -> tuple:
    """What changes when the file is rewritten: (inode, size, mtime_ns) locally, (size, mtime)
    on an object store (every write there makes a new object)."""
    if is_remote(path):
        st = _ep(path).stat()
        return (st.length, st.mtime)
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def mtime(path: str) -> float:
    return float(_ep(path).stat().mtime) if is_remote(path) else os.stat(path).st_mtime


def open(path: str, mode: str = "rb") -> IO:  # noqa: A001 (the module is the namespace)
    """A file object; on an object store a write becomes visible, whole, at close()."""
    return _ep(path).open(mode) if is_remote(path) else builtins.open(path, mode)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file so that a reader sees the old content or the new, never a part: a
    fsynced temp file renamed over it locally; one object upload (atomic) on an object store."""
    if is_remote(path):
        _ep(path).write_bytes(data)
        return
    parent = os.path.dirname(path) or "."
    tmp = os.path.join(
        parent, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    )
    with builtins.open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(parent)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def fsync_dir(path: str) -> None:
    """Make a local folder's entries durable; nothing to do on an object store."""
    if is_remote(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Delete one file; no error when it is already gone."""
    try:
        _ep(path).unlink() if is_remote(path) else os.remove(path)
    except FileNotFoundError:
        pass


def rmtree(path: str) -> None:
    """Delete a folder and everything under it; no error when it is already gone."""
    if is_remote(path):
        p = _ep(path)
        if p.exists():
            p.rmtree(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def rename(src: str, dst: str) -> None:
    """Move a file or folder. Atomic locally (os.rename); on an object store a copy of every
    object then a delete, which a reader can see half done: callers use it only to move
    things out of the way, never to publish."""
    if is_remote(src) and is_remote(dst):
        # A server-side copy of each object, then the delete: gcsfs's own move first tries
        # GCS's objects.move, which not every bucket serves (the emulator answers 501), and
        # retries it for seconds per object before it falls back to the same copy.
        fsys, _ = fsspec.core.url_to_fs(src)
        if isfile(src):
            fsys.copy(src, dst)
            remove(src)
            return
        for rel in walk_files(src):
            fsys.copy(join(src, *rel.split("/")), join(dst, *rel.split("/")))
        rmtree(src)
    elif is_remote(src) or is_remote(dst):
        _ep(src).rename(_ep(dst))
    else:
        os.rename(src, dst)


def walk_files(root: str) -> Iterator[str]:
    """Paths of every file under `root`, relative to it ('/'-separated), sorted."""
    if not is_remote(root):
        out = []
        for dirpath, _, names in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            out += [
                name if rel == "." else posixpath.join(*rel.split(os.sep), name) for name in names
            ]
        yield from sorted(out)
        return
    out = []
    base = abspath(root).partition("://")[2]
    for dirpath, _, names in _ep(root).walk():
        # fsspec yields folders without their scheme ("bucket/a/b"), epath may add it back.
        rel = posixpath.relpath(os.fspath(dirpath).partition("://")[2] or os.fspath(dirpath), base)
        out += [name if rel == "." else posixpath.join(rel, name) for name in names]
    yield from sorted(out)


def upload_tree(local_root: str, dest_root: str, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy every file under a local folder to `dest_root` (local or remote); returns the
    relative paths copied. `skip` names relative paths to leave out (a marker written last)."""
    done = []
    for rel in walk_files(local_root):
        if rel in skip:
            continue
        dest = join(dest_root, *rel.split("/"))
        makedirs(dirname(dest))
        with builtins.open(os.path.join(local_root, *rel.split("/")), "rb") as src:
            with open(dest, "wb") as out:  # streamed: an object store gets a chunked upload
                shutil.copyfileobj(src, out, 1 << 22)
        done.append(rel)
    return done


def download_tree(src_root: str, local_root: str, rels: list[str]) -> None:
    """Copy the files `rels` (relative to src_root) into a local folder."""
    for rel in rels:
        dest = os.path.join(local_root, *rel.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(join(src_root, *rel.split("/")), "rb") as src, builtins.open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
