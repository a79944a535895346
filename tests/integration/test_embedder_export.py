"""Issue 58's refresh from small exports: the trainer writes the document embedder alone
(<workdir>/embedder, checkpoint.EmbedderExport) every refresh.export_every steps, and the
refresh job embeds with the newest export or checkpoint, falling back to checkpoints alone for
a workdir that has no exports."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from realm_jax import checkpoint, sharding
from realm_jax import workdir as paths
from realm_jax.data import datasets
from realm_jax.index import embedding, store
from realm_jax.index.refresher import Refresher
from realm_jax.model.bert import ModelConfig
from realm_jax.model.realm import doc_embedder_name
from realm_jax.pretrain import step as pretrain_step
from tests.conftest import REPO, prepare_sample_head
from tests.support.runs import REALM_OVERRIDES
from tests.support.runs import realm_config as config

EXTERNAL = ("refresh.mode=external", "refresh.build_scann=false")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_sample_head(tmp_path_factory, config, 60)


@pytest.fixture(scope="module")
def run(data_dir):
    """(config, tokens, model, the initial state, a state with new parameters, the name)."""
    cfg = config(f"data.data_dir={data_dir}", *EXTERNAL)
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state0, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    noise = jax.random.key(1)
    state1 = state0.replace(
        params=jax.tree.map(
            lambda p: p + 0.05 * jax.random.normal(noise, p.shape, p.dtype), state0.params
        )
    )
    name = doc_embedder_name(ModelConfig.from_config(cfg.model, "embedder"))
    return cfg, datasets.load_blocks(data_dir)[0], model, state0, state1, name


def _noise(x):
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        return x
    return x + 1e-3 * jax.random.normal(jax.random.key(2), x.shape, x.dtype)


def _bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files
    )


def _paths(tree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def _manifest(workdir: str, step: int) -> dict:
    path = os.path.join(paths.index_dir(workdir), store.version_name(step), "manifest.json")
    with open(path) as f:
        return json.load(f)


def _check_export(workdir: str, step: int, name: str, want, abstract) -> None:
    """Export `step` holds exactly params[name]'s arrays, equal to `want` (numpy)."""
    import orbax.checkpoint as ocp

    folder = os.path.join(paths.embedder_export_dir(workdir), str(step), "state")
    saved = ocp.PyTreeCheckpointer().metadata(folder).item_metadata
    assert _paths(saved) == _paths({"params": {name: want}})  # nothing else
    mgr = checkpoint.export_manager(workdir, read_only=True)
    got = checkpoint.restore_params_subtree(mgr, step, name, abstract)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path))


def test_an_export_holds_the_doc_embedder_alone_and_is_refreshed_from(run, tmp_path):
    cfg, tokens, model, state0, state1, name = run
    work = str(tmp_path)
    mgr = checkpoint.manager(work, with_data=False)
    # Adam's moments as after some training (zeros at init, which orbax's store compresses)
    trained = state0.replace(opt_state=jax.tree.map(_noise, state0.opt_state))
    checkpoint.save(mgr, 0, trained)
    mgr.wait_until_finished()
    export = checkpoint.EmbedderExport(work, name, 5, 0)
    assert not export.maybe_save(3, state1.params)  # not a multiple of 5
    assert export.maybe_save(5, state1.params)
    export.close()
    refresher = Refresher(cfg, work, tokens)
    _check_export(work, 5, name, state1.params[name], refresher.abstract)
    export_bytes = _bytes(os.path.join(paths.embedder_export_dir(work), "5"))
    ckpt_bytes = _bytes(os.path.join(paths.checkpoint_dir(work), "0"))
    print(f"export {export_bytes} B, checkpoint {ckpt_bytes} B")
    assert export_bytes < ckpt_bytes / 4, (export_bytes, ckpt_bytes)

    # no checkpoint newer than export 5: version 5 from the export, its embeddings state1's
    assert refresher.run(max_versions=1) == 1
    assert store.list_versions(paths.index_dir(work)) == [5]
    manifest = _manifest(work, 5)
    assert manifest["source_kind"] == "export" and manifest["step"] == 5
    assert manifest["source_checkpoint"] == os.path.join(paths.embedder_export_dir(work), "5")
    path = os.path.join(paths.index_dir(work), store.version_name(5))
    want = np.asarray(
        jax.jit(lambda p, t: embedding.embed_block_tokens(model, p, t))(state1.params, tokens)
    )
    np.testing.assert_allclose(store.load_embeddings(path), want, atol=2e-5)

    # a newer checkpoint is taken over an older export
    checkpoint.save(mgr, 7, state0)
    mgr.wait_until_finished()
    assert refresher.run(max_versions=1) == 1
    assert _manifest(work, 7)["source_kind"] == "checkpoint"


def test_without_exports_it_refreshes_from_checkpoints(run, tmp_path):
    cfg, tokens, _, state0, state1, _ = run
    work = str(tmp_path)
    mgr = checkpoint.manager(work, with_data=False)
    for step, state in ((0, state0), (3, state1)):
        checkpoint.save(mgr, step, state)
        mgr.wait_until_finished()
    assert Refresher(cfg, work, tokens).run(max_versions=1) == 1
    assert store.list_versions(paths.index_dir(work)) == [3]
    assert _manifest(work, 3)["source_kind"] == "checkpoint"
    assert not os.path.exists(paths.embedder_export_dir(work))  # the refresher made nothing


def test_an_export_deleted_while_read_is_passed_over_not_damaged(run, tmp_path, caplog):
    """The trainer's retention may delete an export mid-read (checkpoint.EXPORTS_KEPT): the
    refresher goes on to the next source, logs no error and does not remember it as damaged."""
    cfg, tokens, _, state0, state1, name = run
    work = str(tmp_path)
    mgr = checkpoint.manager(work, with_data=False)
    checkpoint.save(mgr, 2, state0)
    mgr.wait_until_finished()
    export = checkpoint.EmbedderExport(work, name, 4, 0)
    export.maybe_save(4, state1.params)
    export.close()
    refresher = Refresher(cfg, work, tokens)
    exports = checkpoint.export_manager(work, read_only=True)
    real = checkpoint.restore_params_subtree

    def deleted_mid_read(source, step, *args):
        if os.fspath(source.directory) == paths.embedder_export_dir(work):
            import shutil

            shutil.rmtree(os.path.join(paths.embedder_export_dir(work), str(step)))
            raise FileNotFoundError("gone")
        return real(source, step, *args)

    checkpoint.restore_params_subtree = deleted_mid_read
    try:
        with caplog.at_level(logging.INFO, logger="realm_jax.refresh"):
            assert refresher.refresh_newest(mgr, -1, exports) == 2
    finally:
        checkpoint.restore_params_subtree = real
    assert "export 4 was deleted while read (retention); trying checkpoint 2" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert refresher._damaged == {}


def _local(work: str, data_dir: str, log) -> subprocess.Popen:
    over = [o for o in REALM_OVERRIDES if not o.startswith(("refresh.", "train.steps="))]
    over += [
        *EXTERNAL,
        "refresh.every=4",  # exports every 4 steps (refresh.export_every 0)
        "refresh.poll_seconds=0.2",
        "train.checkpoint_every=8",
        "train.keep_checkpoints=3",
        "train.log_every=4",
        "train.steps=100000",
        f"data.data_dir={data_dir}",
    ]
    cmd = [
        *(sys.executable, "-m", "realm_jax", "local", "--workdir", work),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *[f"--config.{o}" for o in over],
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _steps(folder: str) -> list[int]:
    """The complete orbax steps in `folder` (one being written has another name)."""
    return (
        sorted(int(s) for s in os.listdir(folder) if s.isdigit()) if os.path.isdir(folder) else []
    )


def _saved_by_both(work: str) -> list[int]:
    """Steps with both an export and a checkpoint (past step 0: the first index's)."""
    ckpts = set(_steps(paths.checkpoint_dir(work)))
    return [s for s in _steps(paths.embedder_export_dir(work)) if s in ckpts and s > 0]


def _from_exports(work: str) -> list[int]:
    d = paths.index_dir(work)
    found = []
    for step in store.list_versions(d) if os.path.isdir(d) else []:
        try:
            if _manifest(work, step)["source_kind"] == "export":
                found.append(step)
        except (OSError, ValueError, KeyError):
            continue
    return found


@pytest.mark.system  # a 50 s `local` run; CI keeps the export, refresh and fallback tests
def test_local_exports_every_refresh_and_the_job_publishes_them(data_dir, tmp_path):
    """`local`: the trainer exports every refresh.every (4) steps, checkpoints every 8; its
    refresh job publishes versions from exports. An export equals the trainer's checkpoint
    of the same step (its document embedder) and is far smaller on disk."""
    cfg = config(f"data.data_dir={data_dir}", *EXTERNAL)
    name = doc_embedder_name(ModelConfig.from_config(cfg.model, "embedder"))
    work, log = str(tmp_path / "run"), tmp_path / "local.log"
    t0 = time.time()
    with open(log, "wb") as f:
        proc = _local(work, data_dir, f)
    try:
        while not (_from_exports(work) and _saved_by_both(work)):
            assert time.time() - t0 < 300 and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint and stops both
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert re.search(r"published index \d+ from its export", text), text[-3000:]
    exports = _steps(paths.embedder_export_dir(work))
    assert len(exports) <= checkpoint.EXPORTS_KEPT and all(s % 4 == 0 for s in exports)
    both = _saved_by_both(work)
    assert both, (_steps(paths.checkpoint_dir(work)), exports)
    step = both[-1]
    # the checkpoint's document embedder (the trainer's state at `step`) is the export's
    mesh = sharding.make_mesh(cfg.mesh)
    _, abstract = embedding.abstract_params(cfg, mesh, name)
    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    want = checkpoint.restore_params_subtree(mgr, step, name, abstract)
    _check_export(work, step, name, want, abstract)
    export_bytes = _bytes(os.path.join(paths.embedder_export_dir(work), str(step)))
    ckpt_bytes = _bytes(os.path.join(paths.checkpoint_dir(work), str(step)))
    print(f"step {step}: export {export_bytes} B, checkpoint {ckpt_bytes} B")
    assert export_bytes < ckpt_bytes / 4, (export_bytes, ckpt_bytes)
    print(f"`local` to its end: {time.time() - t0:.0f}s")
    assert time.time() - t0 < 300
