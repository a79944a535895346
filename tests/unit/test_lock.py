"""The workdir lock (lock.py): one trainer and one refresher per workdir, never stuck after a
crash. The other holder is always a separate process (flock is per open file)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from realm_jax import workdir as paths
from realm_jax.lock import LockError, workdir_lock
from tests.conftest import REPO

HOLD = """
import sys, time
from realm_jax.lock import workdir_lock
with workdir_lock(sys.argv[1], sys.argv[2]):
    print("HELD", flush=True)
    time.sleep(600)
"""


def _hold(workdir, role: str = "trainer") -> subprocess.Popen:
    """A process holding `role`'s lock on workdir (returns once it holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir), role],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "HELD":
        proc.kill()
        pytest.fail(f"the holder did not take the lock: {line!r} {proc.stderr.read()}")
    return proc


@pytest.fixture
def holders():
    procs = []
    yield lambda *a, **kw: procs.append(_hold(*a, **kw)) or procs[-1]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()


def test_a_second_process_cannot_take_the_trainer_lock(tmp_path, holders):
    holder = holders(tmp_path / "run")  # the workdir does not exist yet: created
    with pytest.raises(LockError) as e:
        with workdir_lock(str(tmp_path / "run"), "trainer"):
            pytest.fail("took a lock another process holds")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"workdir {tmp_path / 'run'} is in use by another trainer (")
    assert f"pid {holder.pid} on host {socket.gethostname()} since " in msg
    assert msg.endswith("); stop it first, or use another --workdir")
    info = json.loads(open(paths.lock_path(str(tmp_path / "run"), "trainer")).read())
    assert info["pid"] == holder.pid and info["argv"][1:] == [str(tmp_path / "run"), "trainer"]


def test_the_lock_is_free_at_once_after_its_holder_is_killed(tmp_path, holders):
    holder = holders(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with workdir_lock(str(tmp_path), "trainer"):  # no wait, no stale-lock clean-up
        info = json.loads(open(paths.lock_path(str(tmp_path), "trainer")).read())
        assert info["pid"] == os.getpid()


def test_roles_do_not_exclude_each_other_and_a_released_lock_can_be_retaken(tmp_path, holders):
    holders(tmp_path, "refresher")
    for _ in range(2):  # the same process, again after release
        with workdir_lock(str(tmp_path), "trainer"):
            pass
    with pytest.raises(LockError, match="in use by another refresher"):
        with workdir_lock(str(tmp_path), "refresher"):
            pass


def test_disabled_unknown_role_and_unreadable_holder(tmp_path, holders):
    with pytest.raises(ValueError, match="unknown lock role 'reader'"):
        with workdir_lock(str(tmp_path), "reader"):
            pass
    holders(tmp_path)
    with workdir_lock(str(tmp_path), "trainer", enabled=False):  # a process other than 0
        pass
    with open(paths.lock_path(str(tmp_path), "trainer"), "w") as f:
        f.write("{not json")  # the holder's info garbled: the error still reads well
    with pytest.raises(LockError, match=r"another trainer \(holder unknown\); stop it first"):
        with workdir_lock(str(tmp_path), "trainer"):
            pass


def test_an_object_store_workdir_takes_a_lease(monkeypatch):
    """gs:// has no flock: the lock is a lease object (tests/test_gcs.py runs it, and two
    processes racing for it, against fake-gcs-server); no local lock file is made for a URL."""
    import contextlib

    from realm_jax import lock

    taken = []
    monkeypatch.setattr(
        lock,
        "object_lease",
        lambda url, role: taken.append((url, role)) or contextlib.nullcontext(),
    )
    with workdir_lock("gs://bucket/run/", "trainer"):
        assert taken == [("gs://bucket/run/trainer.lock", "trainer")]
    assert not os.path.exists("gs:")


def test_lock_imports_nothing_of_the_package_but_workdir():
    from tests.support.source import module_imports

    imports = module_imports(os.path.join(REPO, "realm_jax", "lock.py"))
    assert imports <= {"realm_jax.workdir", "realm_jax.fs"}, imports


@pytest.mark.parametrize(
    "command, config, role",
    [
        ("train", "realm.py:smoke", "trainer"),
        ("local", "realm.py:smoke", "trainer"),
        ("ict", "ict.py:smoke", "trainer"),
        ("refresh", "realm.py:smoke", "refresher"),
    ],
)
def test_the_cli_refuses_a_held_workdir_before_touching_it(
    tmp_path, holders, command, config, role
):
    """Exit 2 with one line on stderr, before any data is read (there is none prepared
    here) and before any checkpoint, index or refresher process exists."""
    work = tmp_path / "run"
    holder = holders(work, role)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "realm_jax", command, "--workdir", str(work)]
        + ["--config", os.path.join(REPO, "configs", config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("realm-jax ")]
    assert errors == [
        f"realm-jax {command}: error: workdir {work} is in use by another {role} "
        f"(pid {holder.pid} on host {socket.gethostname()} since {_started(work, role)}: "
        f"-c {work} {role}); stop it first, or use another --workdir"
    ], proc.stderr[-3000:]
    assert sorted(os.listdir(work)) == [f"{role}.lock"]  # no checkpoints/, index/, data/
    assert "started refresher" not in proc.stderr  # `local` spawned nothing
    assert time.time() - t0 < 60


def _started(work, role: str) -> str:
    return json.loads(open(paths.lock_path(str(work), role)).read())["started"]
