"""The process's watchdog (watchdog.for_process, started by the CLI for training commands)
covers start-up: a checkpoint restore whose storage never answers exits 75 with the stall line
naming stage 'checkpoint restore', where it used to wait for ever (the watchdog was created by
the loop, after the restore). And the loop then uses that watchdog, not one of its own."""

import os
import subprocess
import sys
import textwrap

from realm_jax import watchdog
from tests.conftest import REPO

# the CLI's order: the process's watchdog first, then the manager and the restore
CHILD = textwrap.dedent(
    """
    import sys, threading
    from realm_jax import watchdog
    from realm_jax.config import load_config
    from realm_jax.train import loop

    class HungStorage:
        def all_steps(self):
            threading.Event().wait()  # listing the checkpoints is never answered

    config = load_config(sys.argv[1] + ":smoke", ["train.first_step_timeout_s=3"])
    watchdog.for_process(config.train, "realm-jax train")
    loop.init_or_resume(HungStorage(), None, None, None, (None, None))
    print("restore returned")
    """
)


def test_a_restore_that_never_answers_ends_the_process(tmp_path):
    realm = os.path.join(REPO, "configs", "realm.py")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, realm],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    out = child.stdout + child.stderr
    assert child.returncode == watchdog.EXIT_STALLED, out[-3000:]
    assert "stage 'checkpoint restore'" in out and "(bound 3 s;" in out, out[-3000:]
    assert "restore returned" not in out


def test_the_loop_uses_the_process_watchdog_and_a_phase_follows_it():
    class Section:
        stall_timeout_s, stall_floor_s, first_step_timeout_s = 0.0, 60.0, 120.0

        def get(self, key, default=None):
            return getattr(self, key, default)

    try:
        wd = watchdog.for_process(Section(), "test")
        assert watchdog.current() is wd and watchdog.for_process(Section(), "other") is wd
        wd.beat(1)
        wd.beat(2)
        wd.phase("after the realm loop")  # the command's work after its loop: a slow bound
        assert wd.bound() == 120.0
    finally:
        watchdog.release()
    assert watchdog.current() is None
