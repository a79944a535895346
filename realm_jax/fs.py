"""One file-system layer for run paths: local paths and object-store URLs (gs://) alike.

Remote paths go through etils.epath, the path type orbax and TFDS use themselves (gs:// through
gcsfs, or tf.io.gfile where TensorFlow is installed); local paths keep plain os calls, so local
runs keep their fsync and atomic-rename guarantees. What an object store lacks (an atomic
rename of a folder, flock) is handled by the callers' protocols: a commit marker written last
(index/store.py, data/prepare.py) and a lease object (lock.py).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import posixpath
import secrets
import shutil
from collections.abc import Iterable, Iterator
from typing import IO

import fsspec
from etils import epath

# gcsfs caches folder listings for the life of the process by default: a trainer polling
# index/ would never see the refresher's new versions. Each listing is asked afresh.
fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)
# fsspec logs its read-ahead cache at INFO for every remote file opened: not a run's news.
logging.getLogger("fsspec.caching").setLevel(logging.WARNING)


class StorageError(RuntimeError):
    """An object store that cannot be used as given: no such bucket, no access, unreachable."""


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


# ------------------------------------------------------------------- buckets, local caches

_BUCKETS_OK: set[str] = set()  # gs:// buckets this process has reached
BUCKET_TIMEOUT_S = 20.0


def bucket_of(path: str) -> str | None:
    """The bucket of a gs:// URL ("gs://b/x" -> "b"); None for anything else."""
    p = os.fspath(path)
    return p.removeprefix("gs://").partition("/")[0] if p.startswith("gs://") else None


def urls_in(tree) -> list[str]:
    """Every gs:// string in a nested dict/list/tuple (a config's paths), in order."""
    if isinstance(tree, str):
        return [tree] if tree.startswith("gs://") else []
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, list | tuple):
        return [url for item in tree for url in urls_in(item)]
    return []


def check_buckets(paths: Iterable[str]) -> None:
    """A StorageError naming the path unless the bucket of every gs:// path exists and lets
    this process list it (once per bucket and process): a missing bucket otherwise looks like
    an empty folder, and an unreachable store costs gcsfs a minute of retries per call."""
    for path in paths:
        name = bucket_of(path or "")
        if name is None or name in _BUCKETS_OK:
            continue
        _probe_bucket(name, path)
        _BUCKETS_OK.add(name)


def _probe_bucket(name: str, path: str) -> None:
    """One object listing of the bucket, retried only on the store's own transient errors
    (429, 5xx): a refused or timed-out connection fails at once."""
    from google.api_core import exceptions, retry
    from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError
    from google.cloud import storage

    if not name:
        raise StorageError(f"{path}: no bucket name (expected gs://BUCKET/FOLDER)")
    transient = retry.if_exception_type(exceptions.TooManyRequests, exceptions.ServerError)
    try:
        blobs = storage.Client().list_blobs(
            name,
            max_results=1,
            timeout=BUCKET_TIMEOUT_S,
            retry=retry.Retry(predicate=transient, timeout=BUCKET_TIMEOUT_S),
        )
        list(blobs)
    except exceptions.NotFound:
        raise StorageError(f"{path}: bucket gs://{name} does not exist") from None
    except exceptions.BadRequest as e:
        raise StorageError(
            f"{path}: gs://{name} is not a usable bucket ({_first_line(e)})"
        ) from None
    except (exceptions.Forbidden, exceptions.Unauthorized) as e:
        raise StorageError(
            f"{path}: no access to bucket gs://{name} ({_first_line(e)}); check the "
            "account's storage permissions"
        ) from None
    except DefaultCredentialsError:
        raise StorageError(
            f"{path}: no Google Cloud credentials to reach gs://{name} (on a workstation: "
            "gcloud auth application-default login)"
        ) from None
    except GoogleAuthError as e:
        raise StorageError(
            f"{path}: cannot authenticate to gs://{name}: {_first_line(e)}"
        ) from None
    except (OSError, exceptions.GoogleAPIError) as e:  # requests' errors are OSErrors
        raise StorageError(f"{path}: cannot reach gs://{name}: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] or type(error).__name__


def cache_root() -> str:
    """Where remote inputs that must be read locally (prepared datasets, HF weight folders)
    are copied: $REALM_JAX_CACHE, else ~/.cache/realm-jax."""
    return os.environ.get("REALM_JAX_CACHE") or os.path.expanduser("~/.cache/realm-jax")


COMPLETE = ".complete"  # written into a cached copy before it is renamed into place


def cached_copy(src_root: str, files: dict[str, int], local: str) -> str:
    """`local`, a verified local copy of `files` ({relative path: size}) under src_root.

    Downloaded once per host: into a private temp folder, every size checked, the COMPLETE
    marker written, then renamed to `local` in one step, so a folder at `local` is always
    whole. Processes racing on the same host each download; the first rename wins and the
    others use its copy. A `local` that does not verify (an older layout's folder without the
    marker, a file truncated since) is moved aside and replaced."""
    if _verified(local, files):
        return local
    parent = os.path.dirname(local)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{local}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        download_tree(src_root, tmp, sorted(files))
        for rel, want in files.items():
            got = os.path.getsize(os.path.join(tmp, *rel.split("/")))
            if got != want:
                raise StorageError(
                    f"{join(src_root, rel)} has {got} bytes, expected {want}: it changed "
                    "while it was copied; try again"
                )
        write_text(os.path.join(tmp, COMPLETE), src_root + "\n")
        if os.path.isdir(local) and not _verified(local, files):  # unfinished or damaged
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.rename(local, f"{local}.stale-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(tmp, local)
        except OSError as e:  # another process renamed its copy first
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not _verified(local, files):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for name in os.listdir(parent):
            if name.startswith(os.path.basename(local) + ".stale-"):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return local


def _verified(local: str, files: dict[str, int]) -> bool:
    """Whether `local` is a complete copy: the marker, and every file with its size."""
    if not os.path.exists(os.path.join(local, COMPLETE)):
        return False
    for rel, want in files.items():
        try:
            if os.path.getsize(os.path.join(local, *rel.split("/"))) != want:
                return False
        except FileNotFoundError:
            return False
    return True
