"""One process per role per workdir: a second trainer on a workdir would resume from the first's
checkpoint and both would save into the same folder.

`workdir_lock(workdir, role)` holds an exclusive flock on <workdir>/<role>.lock for the run.
flock is released by the kernel when its holder dies (kill -9 included), so a crashed run never
leaves the workdir stuck; the file itself stays (harmless) and names the last holder.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator

from realm_jax import workdir as paths

log = logging.getLogger("realm_jax.lock")

# The trainer and the refresher of one run share a workdir (`local`), so each role has its own
# lock: two trainers exclude each other, a trainer and a refresher do not.
ROLES = ("trainer", "refresher")


class LockError(RuntimeError):
    """The workdir is held by another live process of the same role."""


def _holder(fd: int) -> str:
    """The holder's info written in the lock file, as 'pid P on host H since T: ARGV'."""
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0).decode())
        argv = " ".join(str(a) for a in info.get("argv", []))
        return f"pid {info['pid']} on host {info['host']} since {info['started']}: {argv}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "holder unknown"  # empty or half-written (the holder is writing it right now)


def _write_holder(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
    }
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


@contextlib.contextmanager
def workdir_lock(workdir: str, role: str, enabled: bool = True) -> Iterator[None]:
    """Hold `role`'s lock on `workdir` for the body; LockError if another process holds it.

    enabled=False does nothing: with several JAX processes only process 0 locks (callers pass
    `jax.process_index() == 0`; the other processes' hosts may not even share the folder)."""
    if role not in ROLES:
        raise ValueError(f"unknown lock role {role!r}; expected one of {ROLES}")
    if not enabled:
        yield
        return
    if "://" in workdir:
        # Object stores (gs://...) have no flock: nothing stops a second run there.
        log.warning(
            "workdir %s is on an object store: no %s lock (make sure only one runs)", workdir, role
        )
        yield
        return
    os.makedirs(paths.root(workdir), exist_ok=True)
    # os.open's descriptor is not inherited by child processes (PEP 446), so `local`'s
    # refresher child never holds the trainer's lock.
    fd = os.open(paths.lock_path(workdir, role), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise LockError(
                f"workdir {paths.root(workdir)} is in use by another {role} ({_holder(fd)}); "
                "stop it first, or use another --workdir"
            ) from None
        try:
            _write_holder(fd)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
