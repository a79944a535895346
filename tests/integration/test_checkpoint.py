"""Resuming skips a damaged checkpoint and falls back to the previous one."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import checkpoint


def _state(v):
    return {"step": jnp.int32(v), "params": {"w": jnp.full((4, 3), float(v))}}


def test_damaged_latest_checkpoint_falls_back_to_previous(tmp_path, caplog):
    mgr = checkpoint.manager(str(tmp_path), with_data=False)
    for step in (1, 2):
        checkpoint.save(mgr, step, _state(step))
    mgr.wait_until_finished()
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpoint.abstract_like(_state(0), jax.tree.map(lambda _: sharding, _state(0)))
    step, state = checkpoint.restore_latest(mgr, abstract)
    assert step == 2 and float(state["params"]["w"][0, 0]) == 2.0

    # Truncate every data file of checkpoint 2 (a crash or a bad copy).
    damaged = 0
    for root, _, files in os.walk(tmp_path / "checkpoints" / "2"):
        for f in files:
            if not f.startswith("_") and not f.endswith(".json"):
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(1)
                damaged += 1
    assert damaged
    with caplog.at_level("ERROR"):
        step, state = checkpoint.restore_latest(mgr, abstract)
    assert step == 1 and np.allclose(state["params"]["w"], 1.0)
    assert "checkpoint 2" in caplog.text and "cannot be restored" in caplog.text


def test_no_checkpoint_restores_none_and_all_damaged_is_an_error(tmp_path):
    mgr = checkpoint.manager(str(tmp_path), with_data=False)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpoint.abstract_like(_state(0), jax.tree.map(lambda _: sharding, _state(0)))
    assert checkpoint.restore_latest(mgr, abstract) is None
    checkpoint.save(mgr, 1, _state(1))
    mgr.wait_until_finished()
    for root, _, files in os.walk(tmp_path / "checkpoints" / "1"):
        for f in files:
            if not f.startswith("_") and not f.endswith(".json"):
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(1)
    with pytest.raises(RuntimeError, match="could be restored"):
        checkpoint.restore_latest(mgr, abstract)
