"""The training loop's watchdog covers the final checkpoint's wait: a run whose last save never
finishes (storage that never answers) exits 75 with the stall line naming stage 'final save',
where it used to wait for ever (the watchdog was closed before the wait)."""

import os
import subprocess
import sys
import textwrap

from realm_jax import watchdog
from tests.conftest import REPO

# loop.run on a stand-in task and checkpoint manager: two steps, the save at step 2 started,
# then the manager's wait_until_finished never returns
CHILD = textwrap.dedent(
    """
    import sys, threading
    import jax.numpy as jnp
    import numpy as np
    from realm_jax.config import load_config
    from realm_jax.train import loop

    class HungStorage:
        def save(self, step, **_kw):
            return True

        def wait_until_finished(self):
            threading.Event().wait()  # the final upload is never answered

        def latest_step(self):
            return None

    def batches():
        while True:
            yield {"x": np.zeros((8, 1), np.float32)}

    config = load_config(sys.argv[1] + ":smoke", [
        "train.batch_size=8", "train.steps=2", "train.log_every=1", "train.eval_every=0",
        "train.checkpoint_every=2", "train.first_step_timeout_s=4",
    ])
    task = loop.Task(name="fake", step=lambda s, b: (s + 1, {"loss": jnp.float32(1.0)}))
    loop.run(config, sys.argv[2], task, jnp.int32(0), batches(), HungStorage(), 0,
             lambda it: None)
    print("run returned")
    """
)


def test_a_final_save_that_never_finishes_ends_the_run(tmp_path):
    realm = os.path.join(REPO, "configs", "realm.py")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, realm, str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    out = child.stdout + child.stderr
    assert child.returncode == watchdog.EXIT_STALLED, out[-3000:]
    assert "stage 'final save'" in out and "(bound 4 s;" in out and "after step 2" in out
    assert "run returned" not in out
