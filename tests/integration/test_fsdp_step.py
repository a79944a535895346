"""FSDP runs, not only compiles: the REALM train step with parameters and Adam state sharded
over a 4-way data axis (mesh.fsdp) takes the same steps as one device: equal losses, and
equal parameters after two updates.

Issue 58 found `train --cpu_devices 4 --config.mesh.shape='(4,1)' --config.mesh.fsdp=True`
aborting in its first step (XLA:CPU's collectives timing out after 40 s, exit 134) while the
old MLM loss all-to-all'd the vocabulary table inside its chunk loop; with the loss
vocabulary-parallel and batch-major (ops/fused_softmax.py) the same command ran to its end.
The command itself runs in the system tier (test_fsdp_train_command_runs_on_four_devices)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import sharding
from realm_jax.index import embedding
from realm_jax.pretrain import step as pretrain_step
from tests.conftest import REPO
from tests.support.realm_fixtures import synthetic_batch, synthetic_index, tiny_config


def _two_steps(devices: int, fsdp: bool):
    """(losses of two steps, the parameters after them on the host)."""
    config = tiny_config(f"mesh.shape=({devices},1)", f"mesh.fsdp={fsdp}")
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:devices])
    model, optimizer, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
    emb, tokens = synthetic_index(config)
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
    fn = pretrain_step.compile_train_step(config, mesh, model, optimizer, shardings, len(emb))
    losses = []
    for seed in (1, 2):
        batch = sharding.global_batch(synthetic_batch(config, seed=seed), mesh)
        state, metrics = fn(state, batch, *index, jnp.int32(0))
        losses.append(float(jax.device_get(metrics["loss"])))
    return losses, sharding.to_host(state.params)


def test_fsdp_steps_equal_the_one_device_steps():
    """Losses to 1e-5; parameters to Adam's scale: a weight whose gradient is near zero moves
    by about lr times the sign of float noise (biases of 1e-4 moved apart by 4e-5 between one
    device and 4 replicated ones alike), so they are compared within lr per step."""
    assert len(jax.devices()) >= 4, "the test process fakes 4 CPU devices (tests/conftest.py)"
    one, p_one = _two_steps(1, False)
    fsdp, p_fsdp = _two_steps(4, True)
    np.testing.assert_allclose(fsdp, one, rtol=1e-5)
    assert one[1] != one[0]  # the second step saw the first update
    lr = tiny_config().train.lr
    for a, c in zip(jax.tree.leaves(p_one), jax.tree.leaves(p_fsdp)):
        np.testing.assert_allclose(c, a, rtol=1e-3, atol=2 * lr)


@pytest.mark.system  # about 2.5 minutes on 2 cores
def test_fsdp_train_command_runs_on_four_devices(tmp_path):
    """The command issue 58 saw abort: smoke, 4 fake devices, FSDP, in-process refresh."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    work = str(tmp_path / "w")
    common = ["--config", "configs/realm.py:smoke", "--workdir", work]
    run = [sys.executable, "-m", "realm_jax"]
    p = subprocess.run([*run, "prepare", *common], cwd=REPO, env=env, capture_output=True)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run(
        [
            *run,
            "train",
            *common,
            "--cpu_devices",
            "4",
            "--config.mesh.shape=(4,1)",
            "--config.mesh.fsdp=True",
            "--config.refresh.mode=inprocess",
            "--config.train.steps=30",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 30/30" in p.stdout + p.stderr
