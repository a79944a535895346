"""Checkpoint hygiene (issue 14): a damaged newest checkpoint is moved aside and the run
resumes from the one before, which retention then keeps; the log says so in a few lines; a
changed config or data is a CheckpointMismatch, not damage; the refresh job falls back too."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import checkpoint, sharding
from realm_jax import workdir as paths
from realm_jax.data import datasets, pipeline
from realm_jax.index import store
from realm_jax.index.refresher import Refresher
from realm_jax.pretrain import commands as pretrain_commands
from realm_jax.pretrain import step as pretrain_step
from realm_jax.train import loop
from tests.conftest import REPO, prepare_sample_head
from tests.support.runs import damage
from tests.support.runs import realm_config as config

DATA_ARGS = (pipeline.iterator_save_args, pipeline.iterator_restore_args)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """40 passages of the bundled sample, prepared with random masking."""
    return prepare_sample_head(tmp_path_factory, config, 40)


def _config(data_dir, *extra):
    return config(f"data.data_dir={data_dir}", "train.keep_checkpoints=2", *extra)


def _iterator(cfg, data_dir):
    return iter(
        pipeline.train_loader(
            cfg, data_dir, global_batch_size=cfg.train.batch_size, seed=cfg.data.seed
        )
    )


@pytest.fixture(scope="module")
def base(data_dir, tmp_path_factory):
    """A workdir as the trainer leaves it (keep 2): checkpoints 4 and 8, each written by the
    loop's own calls (init_or_resume saves 0, checkpoint.save the rest) with the data
    iterator 4 and 8 batches in. The weights are the initial ones; `step` tells them apart."""
    cfg = _config(data_dir)
    mesh = sharding.make_mesh(cfg.mesh)
    _, _, state, shardings = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    work = str(tmp_path_factory.mktemp("base"))
    mgr = checkpoint.manager(work, keep=2)
    it = _iterator(cfg, data_dir)
    fp = loop.fingerprint(cfg, data_dir)
    assert loop.init_or_resume(mgr, state, shardings, it, DATA_ARGS, fingerprint=fp)[0] == 0
    for step in (4, 8):
        for _ in range(4):
            next(it)
        state = state.replace(step=jnp.int32(step))
        checkpoint.save(mgr, step, state, pipeline.iterator_save_args(it))
    mgr.wait_until_finished()
    assert sorted(mgr.all_steps()) == [4, 8]
    return cfg, state, shardings, work


def _copy(base, tmp_path) -> str:
    work = str(tmp_path / "work")
    shutil.copytree(base[3], work)
    return work


def _log_lines(caplog) -> list[str]:
    """realm-jax's warnings and errors, line by line (orbax's own loggers are the CLI's
    business: runtime.setup keeps them at ERROR)."""
    return [
        line
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("realm_jax")
        for line in r.getMessage().splitlines()
    ]


@pytest.mark.parametrize("how", ["truncated", "zero-filled", "missing"])
def test_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_kept(
    base, data_dir, tmp_path, caplog, how
):
    cfg, state, shardings, _ = base
    work = _copy(base, tmp_path)
    damage(work, 8, how)
    mgr = checkpoint.manager(work, keep=2)
    it = _iterator(cfg, data_dir)
    fp = loop.fingerprint(cfg, data_dir)
    with caplog.at_level(logging.INFO):
        start, restored = loop.init_or_resume(mgr, state, shardings, it, DATA_ARGS, fingerprint=fp)
    assert start == 4 and int(restored.step) == 4
    # The data iterator is where checkpoint 4 left it: 4 batches in.
    fresh = _iterator(cfg, data_dir)
    for _ in range(4):
        next(fresh)
    np.testing.assert_array_equal(next(it)["query_ids"], next(fresh)["query_ids"])

    # Moved aside (not deleted), out of the manager's rotation.
    aside = os.listdir(paths.damaged_checkpoint_dir(work))
    assert len(aside) == 1 and aside[0].startswith("8-") and aside[0].endswith("Z"), aside
    assert os.path.isdir(os.path.join(paths.damaged_checkpoint_dir(work), aside[0], "state"))
    assert mgr.all_steps() == [4]

    # The log: which step, why (one line), where it went; no orbax/tensorstore dump.
    lines = _log_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("checkpoint 8 in ") and "cannot be restored" in lines[0]
    assert lines[0].endswith("trying checkpoint 4") and "TensorStore" not in lines[0]
    assert lines[1].startswith("checkpoint 8 moved out of rotation to ") and aside[0] in lines[1]

    # The next save is not refused (step 8 is free again) and retention keeps checkpoint 4
    # until it completes.
    assert checkpoint.save(mgr, 8, restored.replace(step=jnp.int32(8)), DATA_ARGS[0](it))
    mgr.wait_until_finished()
    assert sorted(mgr.all_steps()) == [4, 8]
    assert os.path.isdir(os.path.join(paths.checkpoint_dir(work), "4"))
    again = checkpoint.manager(work, keep=2)
    assert loop.init_or_resume(again, state, shardings, it, DATA_ARGS, fingerprint=fp)[0] == 8


def test_a_changed_config_is_a_mismatch_and_nothing_is_moved(base, data_dir, tmp_path):
    work = _copy(base, tmp_path)
    width = base[0].model.reader.hidden_size
    cfg = _config(data_dir, f"model.reader.hidden_size={2 * width}")
    with pytest.raises(checkpoint.CheckpointMismatch) as e:
        pretrain_commands.train(cfg, work)
    message = str(e.value)
    assert f"model.reader.hidden_size: checkpoint {width}, now {2 * width}" in message, message
    assert "--workdir" in message and "revert" in message.lower()
    assert "model.embedder" not in message  # only what changed
    assert not os.path.exists(paths.damaged_checkpoint_dir(work))
    assert sorted(os.listdir(paths.checkpoint_dir(work))) == ["4", "8"]
    assert isinstance(e.value, ValueError)


def test_data_changes_are_named_and_old_checkpoints_are_accepted(base, data_dir, tmp_path, caplog):
    cfg, state, shardings, _ = base
    work = _copy(base, tmp_path)
    it = _iterator(cfg, data_dir)
    seed, batch = cfg.data.seed, cfg.train.batch_size
    changed = _config(data_dir, f"data.seed={seed + 7}", f"train.batch_size={2 * batch}")
    now = loop.fingerprint(changed, data_dir)
    now["datasets.counts.blocks"] += 1  # as if prepared again from a longer corpus
    with pytest.raises(checkpoint.CheckpointMismatch) as e:
        loop.init_or_resume(
            checkpoint.manager(work), state, shardings, it, DATA_ARGS, fingerprint=now
        )
    for field in (
        f"data.seed: checkpoint {seed}, now {seed + 7}",
        f"train.batch_size: checkpoint {batch}, now {2 * batch}",
    ):
        assert field in str(e.value), str(e.value)
    assert "datasets.counts.blocks: checkpoint" in str(e.value)
    assert not os.path.exists(paths.damaged_checkpoint_dir(work))

    # A checkpoint written before fingerprints existed: one warning, then it restores.
    legacy = str(tmp_path / "legacy")
    mgr = checkpoint.manager(legacy)
    checkpoint.save(mgr, 4, state, DATA_ARGS[0](_iterator(cfg, data_dir)))  # no fingerprint
    mgr.wait_until_finished()
    fp = loop.fingerprint(cfg, data_dir)
    with caplog.at_level(logging.INFO):
        start, _ = loop.init_or_resume(
            checkpoint.manager(legacy), state, shardings, it, DATA_ARGS, fingerprint=fp
        )
    assert start == 4
    lines = _log_lines(caplog)
    assert len(lines) == 1 and "no fingerprint" in lines[0], lines
    # Saves from now on carry it.
    assert checkpoint.read_fingerprint(checkpoint.manager(legacy), 4) is None
    mgr = checkpoint.manager(legacy)
    mgr.fingerprint = fp
    checkpoint.save(mgr, 5, state, DATA_ARGS[0](it))
    mgr.wait_until_finished()
    assert checkpoint.read_fingerprint(mgr, 5) == fp


def test_nothing_is_moved_when_no_checkpoint_restores(tmp_path):
    def tree(v):
        return {"w": jnp.full((64, 16), float(v)) + jnp.arange(16.0)}

    mgr = checkpoint.manager(str(tmp_path), with_data=False)
    for step in (1, 2):
        checkpoint.save(mgr, step, tree(step))
    mgr.wait_until_finished()
    for step in (1, 2):
        damage(str(tmp_path), step, "zero-filled", every=True)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpoint.abstract_like(tree(0), jax.tree.map(lambda _: one, tree(0)))
    with pytest.raises(checkpoint.NoRestorableCheckpoint, match=r"tried \[2, 1\].*nothing"):
        checkpoint.restore_latest(checkpoint.manager(str(tmp_path), with_data=False), abstract)
    assert sorted(os.listdir(paths.checkpoint_dir(str(tmp_path)))) == ["1", "2"]
    assert not os.path.exists(paths.damaged_checkpoint_dir(str(tmp_path)))


def test_refresher_publishes_from_the_checkpoint_before_a_damaged_one(
    base, data_dir, tmp_path, caplog
):
    cfg = _config(data_dir, "refresh.mode=external", "refresh.build_scann=false")
    state, work = base[1], _copy(base, tmp_path)
    damage(work, 8, "zero-filled", every=True)
    refresher = Refresher(cfg, work, datasets.load_blocks(data_dir)[0])
    with caplog.at_level(logging.INFO):
        assert refresher.run(max_versions=1) == 1
    assert store.list_versions(paths.index_dir(work)) == [4]
    errors = _log_lines(caplog)
    assert len(errors) == 1 and "checkpoint 8 cannot be restored" in errors[0], errors
    assert "trying checkpoint 4" in errors[0] and "\n" not in errors[0]
    assert sorted(os.listdir(paths.checkpoint_dir(work))) == ["4", "8"]  # it moved nothing

    # The known-damaged 8 is not retried; once the trainer has set it aside and saved 8
    # again, the new one is published.
    mgr = checkpoint.manager(work, keep=2)
    mgr.reload()
    assert refresher.refresh_newest(mgr, 4) is None
    checkpoint.set_aside(mgr, [8])
    checkpoint.save(mgr, 8, state)
    mgr.wait_until_finished()
    assert refresher.run(max_versions=1) == 1
    assert store.list_versions(paths.index_dir(work)) == [4, 8]


# A damaged checkpoint's full log in a process of its own, as the CLI sets logging up: orbax's
# failed reads leave tracebacks behind (through sys.unraisablehook and asyncio's logger) when a
# tensorstore thread or the garbage collector reaches them, after the restore returned.
# Whether they come depends on how many reads are still in flight when the first one fails:
# without the filters, about half the damaged checkpoints here printed 9 to 237 lines each (the
# trainer's larger state: 16,676 lines for one in a `train` resume; the run 25,000),
# so each kind of damage is restored twice.
CHILD = textwrap.dedent(
    """
    import argparse, gc, os, shutil, sys, time
    import numpy as np
    import jax
    from realm_jax import checkpoint, runtime
    from tests.support.runs import damage

    runtime.setup(argparse.Namespace(verbose=False, cpu_devices=0, coordinator=None,
                                     multihost=False))
    if sys.argv[2] == "unfiltered":  # to measure what the filters remove
        checkpoint._install_debris_filters = lambda: None
    rng = np.random.default_rng(0)
    tree = {f"w{i}": rng.standard_normal((1024, 256)).astype(np.float32) for i in range(40)}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpoint.abstract_like(tree, jax.tree.map(lambda _: one, tree))
    for how in [h + r for r in ("", " again") for h in ("truncated", "zero-filled", "missing")]:
        work = os.path.join(sys.argv[1], how)
        mgr = checkpoint.manager(work, with_data=False)
        for step in (1, 2):
            checkpoint.save(mgr, step, tree)
        mgr.wait_until_finished()
        damage(work, 2, how.split()[0], every=True)
        print(f"=== {how}", file=sys.stderr, flush=True)
        mgr = checkpoint.manager(work, with_data=False)
        step, _ = checkpoint.restore_latest(mgr, abstract)
        checkpoint.save(mgr, 2, tree)  # the training goes on: debris comes out meanwhile
        mgr.wait_until_finished()
        gc.collect()
        time.sleep(0.2)
        print(f"restored {step}", file=sys.stderr, flush=True)
    """
)


def run_child(tmp_path, mode: str = "filtered") -> dict[str, list[str]]:
    """stderr of CHILD, split by damage kind."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    parts, current = {}, None
    for line in out.stderr.splitlines():
        if line.startswith("=== "):
            current = parts.setdefault(line[4:], [])
        elif current is not None:
            current.append(line)
    return parts


def test_a_damaged_checkpoint_takes_a_few_log_lines(tmp_path):
    parts = run_child(tmp_path)
    assert len(parts) == 6 and {k.split()[0] for k in parts} == {
        "truncated",
        "zero-filled",
        "missing",
    }
    for how, lines in parts.items():
        # the step and why, where it went, then (the caller's) which step was restored
        assert len(lines) <= 5, f"{how}: {len(lines)} lines:\n" + "\n".join(lines[:40])
        assert "checkpoint 2 in " in lines[0] and "trying checkpoint 1" in lines[0], lines
        assert "checkpoint 2 moved out of rotation to " in lines[1], lines
        assert lines[-1] == "restored 1", lines
