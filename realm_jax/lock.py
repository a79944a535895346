"""One process per role per workdir: a second trainer on a workdir would resume from the first's
checkpoint and both would save into the same folder.

`workdir_lock(workdir, role)` holds an exclusive flock on <workdir>/<role>.lock for the run.
flock is released by the kernel when its holder dies (kill -9 included), so a crashed run never
leaves the workdir stuck; the file itself stays (harmless) and names the last holder.

An object store (gs://) has no flock: there the lock is a lease object <workdir>/<role>.lock
holding the holder's info and an expiry, LEASE_SECONDS ahead, that a background thread renews
every RENEW_SECONDS. A second process is refused while the lease is fresh and takes it over
once it has expired (a killed holder stops renewing). Every write and the release carry a GCS
generation-match precondition, so of two processes racing for a free (or expired) lease one
wins and the other gets LockError, and a holder that lost its lease (it could not renew in
time and another took it) finds out at its next renewal and says so in an error line. Each
lease object carries its writer's random token: a write whose precondition fails only because
the client retried it after it had landed (a lost response) is recognised as ours, not as a
lost lease. Expiry compares wall clocks of different hosts: skew well under LEASE_SECONDS is
assumed.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator

from realm_jax import fs
from realm_jax import workdir as paths

log = logging.getLogger("realm_jax.lock")

# The trainer and the refresher of one run share a workdir (`local`), so each role has its own
# lock: two trainers exclude each other, a trainer and a refresher do not.
ROLES = ("trainer", "refresher", "update")
LEASE_SECONDS = 60.0  # an object-store lease not renewed for this long is free
RENEW_SECONDS = 15.0  # how often its holder renews it


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


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


def _holder_info() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
    }


def _write_holder(fd: int) -> None:
    data = (json.dumps(_holder_info()) + "\n").encode()
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
    if fs.is_remote(workdir):
        with object_lease(paths.lock_path(workdir, role), role):
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


def held_elsewhere(workdir: str, role: str) -> bool:
    """Whether another process holds `role`'s lock on a local workdir right now (a probe: a
    shared flock, released at once, refused while a holder has its exclusive one). False on
    an object store (its leases are read by their holders only) and when no lock file exists."""
    if role not in ROLES:
        raise ValueError(f"unknown lock role {role!r}; expected one of {ROLES}")
    if fs.is_remote(workdir):
        return False
    try:
        fd = os.open(paths.lock_path(workdir, role), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------- object-store leases


def _describe(info: dict) -> str:
    argv = " ".join(str(a) for a in info.get("argv", []))
    left = float(info.get("expires", 0)) - time.time()
    return (
        f"pid {info.get('pid')} on host {info.get('host')} since {info.get('started')}, "
        f"lease valid {left:.0f}s more: {argv}"
    )


class ObjectLease:
    """A lease object on GCS (google-cloud-storage, which honours STORAGE_EMULATOR_HOST):
    holder info + expiry + this lease's token, written only with a generation-match
    precondition (a multipart upload: the whole object in one request)."""

    def __init__(self, url: str, role: str, ttl: float = LEASE_SECONDS):
        from google.cloud import storage  # lazy: only object-store workdirs need it

        if not url.startswith("gs://"):
            raise ValueError(f"lease objects are supported on gs:// only, got {url}")
        bucket, _, self.name = url.removeprefix("gs://").partition("/")
        self.url, self.role, self.ttl = url, role, ttl
        self.bucket = storage.Client().bucket(bucket)
        self.generation: int | None = None  # of our last write; None while not held
        self.token = secrets.token_hex(16)  # tells our writes from any other holder's

    def _write(self, if_generation_match: int) -> None:
        """Write the lease if the object is still at `if_generation_match` (0: absent);
        PreconditionFailed when another process wrote or deleted it since."""
        from google.api_core import exceptions

        info = {**_holder_info(), "expires": time.time() + self.ttl, "role": self.role}
        blob = self.bucket.blob(self.name)
        try:
            blob.upload_from_string(
                json.dumps({**info, "token": self.token}),
                content_type="application/json",
                if_generation_match=if_generation_match,
            )
        except exceptions.PreconditionFailed:
            # google-cloud-storage retries a conditional upload after a timeout or a 5xx; if
            # the first attempt had landed, the retry fails its precondition on our own write.
            current = self._current()
            if current is None or current[1].get("token") != self.token:
                raise
            self.generation = current[0]
            return
        self.generation = blob.generation

    def _current(self) -> tuple[int, dict] | None:
        """(generation, content) of the lease object now; None when there is none. Content
        that is not a JSON object reads as {}."""
        from google.api_core import exceptions

        blob = self.bucket.get_blob(self.name)
        if blob is None:
            return None
        try:
            info = json.loads(blob.download_as_bytes(if_generation_match=blob.generation))
        except exceptions.NotFound:
            return None
        except (ValueError, exceptions.PreconditionFailed):
            info = {}  # unreadable, or rewritten meanwhile: a write's precondition decides
        return blob.generation, info if isinstance(info, dict) else {}

    def acquire(self, wait_for_dead: bool = False) -> None:
        """Take the lease; LockError while another holder's is fresh, or when another
        process takes it between our read and our write.

        wait_for_dead: a fresh lease is watched instead of refused at once: if its holder
        renews it (a new generation) it is alive and this is a LockError; if the lease runs
        out unrenewed (its holder died: kill -9, or a pod host's JAX abort, runs no release)
        it is taken. A relaunch right after a crash then waits at most one lease period
        instead of failing."""
        from google.api_core import exceptions

        current = self._current()
        if current is not None and float(current[1].get("expires", 0)) > time.time():
            if not wait_for_dead:
                raise self._held(current[1])
            current = self._wait_out(current)
        try:
            # Only if nobody wrote since we read: of two processes that both saw the lease
            # free or expired, one write lands, the other fails its precondition.
            self._write(current[0] if current is not None else 0)
        except exceptions.PreconditionFailed:
            raise LockError(
                f"workdir lease {self.url} was just taken by another {self.role}; "
                "stop it first, or use another --workdir"
            ) from None

    def _held(self, info: dict) -> LockError:
        return LockError(
            f"workdir lease {self.url} is held by another {self.role} "
            f"({_describe(info)}); stop it first, or use another --workdir"
        )

    def _wait_out(self, current: tuple[int, dict]) -> tuple[int, dict] | None:
        """Watch a fresh lease until it is renewed (LockError: a live holder) or expires
        unrenewed (returned, to be taken with a precondition on its generation)."""
        generation, info = current
        deadline = time.time() + self.ttl + 5  # one lease period (clock skew beyond: refuse)
        log.warning(
            "workdir lease %s is held by another %s (%s): waiting for it to be renewed (a live "
            "holder: refused) or to run out (a holder that died: taken over)",
            self.url,
            self.role,
            _describe(info),
        )
        while time.time() < deadline:
            time.sleep(min(1.0, max(0.05, self.ttl / 20)))
            now = self._current()
            if now is None:
                return None  # released meanwhile
            if now[0] != generation:
                raise self._held(now[1])  # renewed, or taken by another: alive
            if float(now[1].get("expires", 0)) <= time.time():
                log.info("workdir lease %s ran out unrenewed: taking it over", self.url)
                return now
        raise self._held(info)

    def renew(self) -> bool:
        """Extend the lease; False when it was lost (another process holds it now) or is not
        held (never a write without a precondition)."""
        from google.api_core import exceptions

        if self.generation is None:
            return False
        try:
            self._write(self.generation)
            return True
        except exceptions.PreconditionFailed:
            self.generation = None
            return False

    def release(self) -> None:
        """Delete the lease, unless another process holds it by now. The delete carries the
        generation precondition; the generation is also compared first, for servers that
        ignore preconditions on DELETE (fake-gcs-server does), where the window for deleting
        another's lease is then the gap between the two requests."""
        from google.api_core import exceptions

        if self.generation is None:
            return
        try:
            blob = self.bucket.get_blob(self.name)
            if blob is not None and blob.generation == self.generation:
                blob.delete(if_generation_match=self.generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            pass
        self.generation = None


def _renew_until(lease: ObjectLease, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        try:
            if not lease.renew():
                log.error(
                    "lost the %s lease %s: another process holds it now (this one could not "
                    "renew it for %.0fs); stop this one",
                    lease.role,
                    lease.url,
                    lease.ttl,
                )
                return
        except Exception as e:  # a network error: try again next round, the lease still runs
            log.warning("could not renew the %s lease %s: %s", lease.role, lease.url, e)


@contextlib.contextmanager
def object_lease(url: str, role: str, *, ttl: float | None = None) -> Iterator[ObjectLease]:
    """Hold an object-store lease for the body, renewed in a background thread."""
    lease = ObjectLease(url, role, ttl or LEASE_SECONDS)
    lease.acquire(wait_for_dead=True)
    stop = threading.Event()
    every = min(RENEW_SECONDS, lease.ttl / 4)
    renewer = threading.Thread(target=_renew_until, args=(lease, stop, every), daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        lease.release()
