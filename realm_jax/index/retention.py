"""Leases and retention for the versioned index (see realm_jax.index for the layout).

Trainers hold a lease (``in_use/<owner>.json``) on the version they use; `cleanup` keeps the
newest sound versions plus every leased one, and reaps ``.tmp-*`` directories abandoned by
crashed writers. On an object store (gs://) a version folder without its manifest (a writer
killed mid-publish, or one still writing) is never trusted, and is removed once nothing in it
has changed for TMP_MAX_AGE_S. Everything here is also importable from ``realm_jax.index``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time

from realm_jax import fs
from realm_jax.index.store import (
    MANIFEST,
    WRITER,
    _discard,
    _is_valid,
    _verified,
    _write_json_atomic,
    list_versions,
    log,
    version_name,
)
from realm_jax.lock import pid_alive

LEASE_DIR = "in_use"
TMP_MAX_AGE_S = 3600.0  # a temp dir with no activity for this long is abandoned on any host
_TMP_RE = re.compile(r"^\.tmp-step_(\d+)-(\d+)-[0-9a-f]+")
_OWNER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _lease_path(index_dir: str, owner: str) -> str:
    if not _OWNER_RE.match(owner):
        raise ValueError(f"lease owner must match {_OWNER_RE.pattern}, got {owner!r}")
    return fs.join(index_dir, LEASE_DIR, f"{owner}.json")


def mark_in_use(index_dir: str, step: int, owner: str) -> None:
    """Record (atomically) that `owner` uses version `step`; replaces owner's previous lease."""
    path = _lease_path(index_dir, owner)
    fs.makedirs(fs.dirname(path))
    _write_json_atomic(path, {"step": int(step), "time": time.time()})


def release(index_dir: str, owner: str) -> None:
    """Drop `owner`'s lease (no error if it has none)."""
    fs.remove(_lease_path(index_dir, owner))


def leased_steps(index_dir: str, *, max_age: float | None = None) -> set[int]:
    """Steps named by leases (leases older than `max_age` seconds ignored when given).

    Raises ValueError on an unreadable lease so retention errs on the side of keeping.
    """
    ldir = fs.join(index_dir, LEASE_DIR)
    steps: set[int] = set()
    for name in fs.listdir(ldir):
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            lease = json.loads(fs.read_bytes(fs.join(ldir, name)))
            step, stamp = int(lease["step"]), float(lease["time"])
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"unreadable lease {fs.join(ldir, name)}: {e}") from e
        if max_age is None or time.time() - stamp <= max_age:
            steps.add(step)
    return steps


def _last_activity(path: str) -> float:
    """Newest mtime of a directory and its direct children (a writer touches them)."""
    times = [os.stat(path).st_mtime]
    for entry in os.scandir(path):
        try:
            times.append(entry.stat(follow_symlinks=False).st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


def _tmp_abandoned(path: str, pid: int, now: float) -> bool:
    """A temp dir is abandoned if idle for an hour, or its writer on this host is dead.

    The writer's host is read from its .writer file; without one (a crash between mkdir and
    writing it) the pid is trusted as local only after a minute idle.
    """
    try:
        idle = now - _last_activity(path)
    except FileNotFoundError:
        return False
    if idle > TMP_MAX_AGE_S:
        return True
    try:
        with open(os.path.join(path, WRITER)) as f:
            host = json.load(f).get("host")
    except (OSError, ValueError, AttributeError):
        host = socket.gethostname() if idle > 60 else None
    return host == socket.gethostname() and not pid_alive(pid)


def _uncommitted_fresh(path: str, now: float) -> bool:
    """On an object store: a version folder with no manifest whose newest file changed within
    TMP_MAX_AGE_S (a writer may still be filling it). Locally a version folder only appears
    by rename, complete, so this never holds there."""
    if not fs.is_remote(path) or fs.exists(fs.join(path, MANIFEST)):
        return False
    times = [fs.mtime(fs.join(path, rel)) for rel in fs.walk_files(path)]
    return bool(times) and now - max(times) <= TMP_MAX_AGE_S


def cleanup(index_dir: str, keep: int, *, lease_max_age: float | None = None) -> list[str]:
    """Retention: keep the newest `keep` sound versions plus every leased one; drop the rest.

    Also removes abandoned `.tmp-*` dirs (local) and, on an object store, version folders
    left without a manifest for TMP_MAX_AGE_S. Versions failing the cheap verify (no hashing)
    do not count toward `keep`. An unreadable lease makes this skip version removal entirely.
    Returns the removed paths.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    removed: list[str] = []
    if not fs.isdir(index_dir):
        return removed
    now = time.time()
    for name in sorted(fs.listdir(index_dir) if not fs.is_remote(index_dir) else []):
        m = _TMP_RE.match(name)
        path = os.path.join(index_dir, name)
        if m and os.path.isdir(path) and _tmp_abandoned(path, int(m.group(2)), now):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    try:
        leased = leased_steps(index_dir, max_age=lease_max_age)
    except ValueError as e:
        log.warning("not removing index versions: %s", e)
        return removed
    kept = 0
    for step in reversed(list_versions(index_dir)):
        path = fs.join(index_dir, version_name(step))
        if kept < keep and _is_valid(path, checksum=False):
            kept += 1
        elif _uncommitted_fresh(path, now):
            continue  # maybe still being written: its grace period is not over
        elif step not in leased:
            _discard(path)
            _verified.pop(path, None)
            removed.append(path)
    return removed
