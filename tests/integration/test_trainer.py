"""End-to-end training on a slice of the bundled sample: resume after SIGKILL, index refresh."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import checkpoint, sharding
from realm_jax import workdir as paths
from realm_jax.data import datasets, prepare
from realm_jax.index import embedding, store
from realm_jax.index.feed import IndexFeed
from realm_jax.index.refresher import Refresher
from realm_jax.model.realm import RealmModel
from realm_jax.pretrain import commands as pretrain_commands
from realm_jax.pretrain import step as pretrain_step
from realm_jax.train import warm_start
from realm_jax.workdir import index_dir
from tests.conftest import REPO, prepare_sample_head
from tests.support.runs import REALM_OVERRIDES as OVERRIDES
from tests.support.runs import realm_config as config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """60 real passages of the bundled sample, prepared with random masking."""
    return prepare_sample_head(tmp_path_factory, config, 60)


def _train_cli(workdir: str, data_dir: str, log: str, *extra, env=None) -> subprocess.Popen:
    """`python -m realm_jax train` (the tiny run's overrides) into `workdir`, started; the
    console to `log`. Its 2 fake devices (conftest) train faster than this process's 4."""
    cmd = [
        *(sys.executable, "-m", "realm_jax", "train", "--workdir", workdir),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *[f"--config.{o}" for o in OVERRIDES],
        f"--config.data.data_dir={data_dir}",
        *extra,
    ]
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )


def _event_losses(workdir: str, names: list[str], scratch) -> dict[int, float]:
    """step -> loss logged in the event files `names` of workdir's tb/ alone."""
    from realm_jax.train.metrics import read_scalars

    (scratch / "tb").mkdir(parents=True)
    for name in names:
        os.link(os.path.join(paths.tb_dir(workdir), name), scratch / "tb" / name)
    return read_scalars(str(scratch))["loss"]


def _kill_after_checkpoint(proc, workdir: str, step: int) -> None:
    """SIGKILL `proc` as soon as a finished checkpoint >= step exists in workdir."""
    mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(paths.checkpoint_dir(workdir)):
            mgr.reload()
            if any(s >= step for s in mgr.all_steps()):
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_resume_after_sigkill_continues_the_same_loss_curve(data_dir, tmp_path):
    """Three CLI runs: the uninterrupted one (24 steps), one killed with SIGKILL once its
    step-4 checkpoint is written, and its resume, whose every step's loss is the
    uninterrupted run's."""
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    proc = _train_cli(full, data_dir, str(tmp_path / "full.log"))  # (fills the compile cache)
    assert proc.wait() == 0, (tmp_path / "full.log").read_text()[-3000:]
    full_losses = _event_losses(full, os.listdir(paths.tb_dir(full)), tmp_path / "f")
    assert sorted(full_losses) == list(range(1, 25))

    proc = _train_cli(killed, data_dir, str(tmp_path / "killed.log"))
    _kill_after_checkpoint(proc, killed, 4)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    before = set(os.listdir(paths.tb_dir(killed)))
    proc = _train_cli(killed, data_dir, str(tmp_path / "resumed.log"))
    proc.wait()
    log = (tmp_path / "resumed.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    at = int(re.search(r"resumed from checkpoint (\d+)", log).group(1))
    new = sorted(set(os.listdir(paths.tb_dir(killed))) - before)
    resumed = _event_losses(killed, new, tmp_path / "r")  # the resumed process's steps only
    assert 4 <= at < 24 and sorted(resumed) == list(range(at + 1, 25)), (at, sorted(resumed))
    for step, loss in resumed.items():
        np.testing.assert_allclose(loss, full_losses[step], rtol=1e-5, err_msg=f"step {step}")

    # A hang (issue 48): the main thread blocks in its data loader after step 7 (the test-only
    # fault hook: a loader that never returns) while every other thread runs on; the watchdog
    # exits 75 within its bound naming the data stage, with every thread's stack in the log,
    # and leaves its step-4 checkpoint for the relaunch (which resumes as the SIGKILLed run
    # above does; the relaunch's losses are compared in the system tier's 2-process drill).
    hung = str(tmp_path / "hung")
    bound = ["--config.train.stall_timeout_s=4", "--config.train.checkpoint_every=4"]
    t0 = time.time()
    proc = _train_cli(hung, data_dir, str(tmp_path / "hung.log"), *bound,
                      env={"REALM_JAX_TEST_HANG": "data:7"})  # fmt: skip
    assert proc.wait(timeout=400) == 75, (tmp_path / "hung.log").read_text()[-3000:]
    log = (tmp_path / "hung.log").read_text()
    stalled = re.search(
        r"stalled: no realm training step completed for ([\d.]+) s \(bound 4 s", log
    )
    assert stalled and 4 <= float(stalled.group(1)) < 30, log[-3000:]
    assert "stage 'data'" in log and "after step 7" in log
    assert "Current thread" in log or "Thread 0x" in log  # faulthandler's stacks
    assert "in stage" in log and "watchdog.py" in log  # the blocked main thread, where it waits
    assert time.time() - t0 < 300
    kept = [int(s) for s in os.listdir(paths.checkpoint_dir(hung)) if s.isdigit()]
    assert max(kept) == 4, kept  # the relaunch resumes from step 4 (the steps after it: lost)


@pytest.mark.system  # two CLI runs: CI keeps the SIGKILL resume and the feed's swap
def test_inprocess_resume_between_refreshes_reads_the_kept_index(data_dir, tmp_path, caplog):
    """refresh.every=8, checkpoints every 4: a run resumed at step 4 must read the index
    re-embedded at step 0, as the uninterrupted run did (inprocess mode keeps each index it
    embeds): the same losses and the same index age at every step; without that version it
    says so and re-embeds, and its index is 4 steps younger."""
    import shutil

    over = ("refresh.every=8", "train.steps=12", f"data.data_dir={data_dir}")
    full_dir = tmp_path / "full"
    full = {h["step"]: h for h in pretrain_commands.train(config(*over), str(full_dir))}
    assert store.list_versions(paths.index_dir(str(full_dir))) == [0, 8]

    def resumed_at_4(name, drop_versions):
        run = tmp_path / name
        shutil.copytree(full_dir, run)
        for step in ("8", "12"):  # as if killed at step 5
            shutil.rmtree(os.path.join(paths.checkpoint_dir(str(run)), step))
        for v in drop_versions:
            shutil.rmtree(os.path.join(paths.index_dir(str(run)), store.version_name(v)))
        return {h["step"]: h for h in pretrain_commands.train(config(*over), str(run))}

    resumed = resumed_at_4("resumed", [8])
    assert sorted(resumed) == list(range(5, 13))
    for step, h in resumed.items():
        np.testing.assert_allclose(h["loss"], full[step]["loss"], rtol=1e-5, err_msg=f"{step}")
        assert h["staleness"] == full[step]["staleness"] == (step - 1) % 8, step
    with caplog.at_level(logging.WARNING, logger="realm_jax.refresh"):
        fresh = resumed_at_4("no_index", [0, 8])
    assert "this resume is not exact" in caplog.text
    assert [fresh[s]["staleness"] for s in range(5, 9)] == [0, 1, 2, 3]


class _SlowSearcher:
    """Stands in for a ScaNN searcher whose serialisation hangs (to kill a publish mid-write)."""

    def serialize(self, directory):
        with open(os.path.join(directory, "partial.bin"), "wb") as f:
            f.write(b"x" * 1000)
            f.flush()
            time.sleep(600)


def _publish_and_hang(idx_dir, n, d):  # runs in a child process
    store.publish_index(idx_dir, 9, np.ones((n, d), np.float32), searcher=_SlowSearcher())


@pytest.mark.system  # CI: the 2-process refresh job's embeddings, the feed's swap, a killed
# writer never read (test_gcs.py), `ask` (test_release_openqa.py)
def test_refresher_publishes_and_trainer_switches(data_dir, tmp_path, caplog):
    cfg = config(f"data.data_dir={data_dir}", "refresh.mode=external", "refresh.build_scann=false")
    workdir = str(tmp_path)
    tokens = datasets.load_blocks(data_dir)[0]
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state0, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    noise = jax.random.key(1)  # new document embedder parameters for the second checkpoint
    state1 = state0.replace(
        params=jax.tree.map(
            lambda p: p + 0.05 * jax.random.normal(noise, p.shape, p.dtype), state0.params
        )
    )
    mgr = checkpoint.manager(workdir, with_data=False)
    checkpoint.save(mgr, 0, state0)
    mgr.wait_until_finished()

    refresher = Refresher(cfg, workdir, tokens)
    assert refresher.run(max_versions=1) == 1
    feed = IndexFeed(cfg, workdir, mesh, model, tokens)
    feed.start(state0.params, 0)
    assert feed.step == 0
    queries = np.asarray(
        model.apply(
            {"params": state0.params},
            jax.numpy.asarray(tokens[:8, :32]),
            np.zeros((8, 32), np.int32),
            (tokens[:8, :32] != 0),
            method=RealmModel.embed_query,
        )
    )

    def top_ids():
        emb = np.asarray(jax.device_get(feed.emb))[: len(tokens)]
        return np.argsort(-(queries @ emb.T), axis=1)[:, :3], emb

    embed_ref = jax.jit(lambda p, t: embedding.embed_block_tokens(model, p, t))
    ids0, emb0 = top_ids()
    # Direct embedding of the blocks with the checkpoint's document embedder (reference).
    want0 = np.asarray(embed_ref(state0.params, tokens))
    np.testing.assert_allclose(emb0, want0, atol=2e-5)

    checkpoint.save(mgr, 5, state1)  # new document embedder parameters
    mgr.wait_until_finished()
    assert refresher.run(max_versions=1) == 1
    # A due step starts a look for a newer version on a background thread (process 0 never
    # lists storage on the training thread); the next takes its answer and starts reading
    # the version beside the training steps; a later one swaps it in once every host has its
    # rows. The trainer waits for none of it.
    assert not feed.maybe_refresh(state1.params, 5) and feed.step == 0
    feed._lookout.thread.join(60)
    assert not feed.maybe_refresh(state1.params, 6) and feed.step == 0
    assert feed._pending[2].done.wait(60)
    assert feed.maybe_refresh(state1.params, 7) and feed.step == 5
    ids1, emb1 = top_ids()
    want1 = np.asarray(embed_ref(state1.params, tokens))
    np.testing.assert_allclose(emb1, want1, atol=2e-5)
    assert not np.array_equal(ids0, ids1)  # retrieval follows the new index

    # A refresher killed mid-write: the trainer stays on version 5.
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(
        target=_publish_and_hang, args=(index_dir(workdir), len(tokens), 128)
    )
    child.start()
    deadline = time.time() + 60
    while time.time() < deadline and not any(
        n.startswith(".tmp") and os.path.exists(os.path.join(index_dir(workdir), n, "scann"))
        for n in os.listdir(index_dir(workdir))
    ):
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert not feed.maybe_refresh(state1.params, 10) and feed.step == 5
    assert store.list_versions(index_dir(workdir)) == [0, 5]
    # Staleness past the bound is warned about.
    with caplog.at_level("WARNING"):
        feed.maybe_refresh(state1.params, 5 + cfg.refresh.max_staleness + 1)
    assert "exceeds refresh.max_staleness" in caplog.text
    manifest = json.load(open(os.path.join(index_dir(workdir), "step_00000005", "manifest.json")))
    assert manifest["num_blocks"] == len(tokens) and manifest["step"] == 5

    # Host-side retrieval (`ask`): newest checkpoint's query embedder + the published index.
    from realm_jax.index import ask as serve

    hits = serve.ask(cfg, workdir, "Which earthquake struck Sichuan in 2008?", 3)
    titles = datasets.load_blocks(data_dir)[2]
    assert len(hits) == 3 and all(title in titles for title, _, _ in hits)


@pytest.mark.parametrize("background", [True, False])
def test_a_new_index_is_read_beside_the_training_steps(tmp_path, monkeypatch, background):
    """refresh.background_reads: while a host's read of a new version is slow (held here),
    every look returns at once and the trainer keeps the old index; the look after the read
    completes swaps the new rows in. Off: the look that finds the version reads it inline."""
    import threading

    from realm_jax.index import feed as feed_module
    from realm_jax.model.realm import realm_model
    from tests.support.realm_fixtures import synthetic_index, tiny_config

    cfg = tiny_config("refresh.mode=external", f"refresh.background_reads={background}")
    mesh = sharding.make_mesh(cfg.mesh)
    emb, tokens = synthetic_index(cfg)
    idx = index_dir(str(tmp_path))
    store.publish_index(idx, 1, emb)
    feed = IndexFeed(cfg, str(tmp_path), mesh, realm_model(cfg.model), tokens)
    feed.start(None, 1)
    store.publish_index(idx, 7, emb[::-1].copy())
    release, real = threading.Event(), store.load_rows

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(feed_module.store, "load_rows", held)
    if not background:
        release.set()
        assert feed.maybe_refresh(None, 2) and feed.step == 7
        assert feed.last_swap_seconds > 0
    else:
        t0, step = time.time(), 2
        # the first looks find the version (process 0 lists the store in a background
        # thread, so a look's answer comes at a later look) and start reading it
        while feed._pending is None and step < 200:
            assert not feed.maybe_refresh(None, step) and feed.step == 1
            step += 1
            time.sleep(0.02)
        for later in range(step, step + 4):
            assert not feed.maybe_refresh(None, later) and feed.step == 1
        step = later
        assert time.time() - t0 < 10  # no look waited for the held read
        release.set()
        assert feed._pending[2].done.wait(60)
        assert feed.maybe_refresh(None, step + 1) and feed.step == 7
    got = sharding.to_host(feed.emb)[: len(emb)]
    np.testing.assert_array_equal(got, emb[::-1])


def test_retention_keeps_a_version_while_the_trainer_reads_it(tmp_path, monkeypatch):
    """The lease comes before the read: while a host reads version 7 (held here), the refresh
    job publishes 8 and 9 and its retention (keep 1) removes 8 but neither 7 (being read) nor
    1 (in use); after the swap the trainer's lease names 7 and the read's lease is gone, so
    the next retention removes 1. Discovery ran off the training thread (process 0's lookout)."""
    import threading

    from realm_jax.index import feed as feed_module
    from realm_jax.index import retention
    from realm_jax.model.realm import realm_model
    from tests.support.realm_fixtures import synthetic_index, tiny_config

    cfg = tiny_config("refresh.mode=external", "refresh.background_reads=true")
    mesh = sharding.make_mesh(cfg.mesh)
    emb, tokens = synthetic_index(cfg)
    idx = index_dir(str(tmp_path))
    store.publish_index(idx, 1, emb)
    feed = IndexFeed(cfg, str(tmp_path), mesh, realm_model(cfg.model), tokens)
    feed.start(None, 1)
    store.publish_index(idx, 7, emb[::-1].copy())
    release, real, looked_from = threading.Event(), store.load_rows, []
    monkeypatch.setattr(
        feed_module.store, "load_rows", lambda *a, **k: (release.wait(60), real(*a, **k))[1]
    )
    real_newest = feed._newest
    monkeypatch.setattr(
        feed,
        "_newest",
        lambda after: (looked_from.append(threading.current_thread()), real_newest(after))[1],
    )
    step = 2
    while feed._pending is None and step < 200:
        assert not feed.maybe_refresh(None, step)
        step, _ = step + 1, time.sleep(0.02)
    assert feed._pending[0] == 7 and retention.leased_steps(idx) == {1, 7}
    assert looked_from and threading.main_thread() not in looked_from
    for s in (8, 9):
        store.publish_index(idx, s, emb)
    removed = retention.cleanup(idx, keep=1)
    assert [os.path.basename(p) for p in removed] == ["step_00000008"]
    assert store.list_versions(idx) == [1, 7, 9]
    release.set()
    assert feed._pending[2].done.wait(60)
    assert feed.maybe_refresh(None, step) and feed.step == 7
    np.testing.assert_array_equal(sharding.to_host(feed.emb)[: len(emb)], emb[::-1])
    assert retention.leased_steps(idx) == {7}
    retention.cleanup(idx, keep=1)
    assert store.list_versions(idx) == [7, 9]
    feed.close()
    assert retention.leased_steps(idx) == set()


@pytest.mark.system  # CI: ScaNN in unit/test_index.py
def test_scann_recall_on_sample_corpus_embeddings(tmp_path):
    """ScaNN (asymmetric hashing + re-scoring) vs exact search on the bundled sample's blocks,
    embedded by an embedder warm-started from real BERT weights (../shared bert-tiny-mlm)."""
    from realm_jax.data import pipeline
    from realm_jax.index import scann as scann_index
    from tests.conftest import shared_path

    bert = shared_path("models", "bert-tiny-mlm")
    cfg = config(
        f"data.corpus={os.path.join(REPO, 'data', 'sample', 'corpus.jsonl')}",
        "data.block_len=128",
        "data.query_len=48",
        "model.embedder.max_position_embeddings=512",
        "model.reader.max_position_embeddings=512",
        "model.embedder.hidden_size=128",
        "model.reader.hidden_size=128",
        "model.embedder.intermediate_size=512",
        "model.reader.intermediate_size=512",
        "model.embedder.hidden_act=gelu",
        "model.reader.hidden_act=gelu",
        "model.embedder.num_layers=2",
        "model.reader.num_layers=2",
        f"model.init_embedder_from={bert}",
    )
    ddir = str(tmp_path / "data")
    prepare.prepare(cfg, ddir)
    tokens = datasets.load_blocks(ddir)[0]
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state, _ = pretrain_step.create_state(
        cfg, mesh, jax.random.key(0), warm_start.params_hook(cfg)
    )
    _, tok = embedding.pad_index(None, tokens, mesh)
    emb = embedding.embed_blocks_fn(model, mesh, 16)(state.params, sharding.put_rows(tok, mesh))
    emb = np.asarray(jax.device_get(emb))[: len(tokens)]
    batch = next(iter(pipeline.train_loader(cfg, ddir, global_batch_size=64, seed=0)))
    q = np.asarray(
        model.apply(
            {"params": state.params},
            batch["query_ids"],
            np.zeros_like(batch["query_ids"]),
            batch["query_ids"] != 0,
            method=RealmModel.embed_query,
        )
    )
    params = scann_index.scann_params(len(emb), reorder=100, brute_force=False, tree=False)
    ids, _ = scann_index.search(scann_index.build_searcher(emb, k=10, **params), q, 10)
    exact = np.argsort(-(q @ emb.T), axis=1)[:, :10]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, exact)])
    assert len(tokens) > 500 and recall >= 0.95, recall


def test_config_that_does_not_match_prepared_data_is_refused(data_dir, tmp_path):
    cfg = config(f"data.data_dir={data_dir}", "data.query_len=40")
    with pytest.raises(ValueError, match="data.query_len is 40 but .* prepared with 32"):
        pretrain_commands.train(cfg, str(tmp_path))


def test_two_process_refresh_job_matches_single_process(data_dir, tmp_path):
    """The refresh job as on a pod: 2 jax.distributed processes embed their shares, process 0
    publishes; the embeddings equal a one-process embedding of every block."""
    import portpicker

    overrides = [*OVERRIDES, f"data.data_dir={data_dir}", "refresh.build_scann=false"]
    cfg = config(*overrides[len(OVERRIDES) :])
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(3))
    mgr = checkpoint.manager(str(tmp_path), with_data=False)
    checkpoint.save(mgr, 0, state)
    mgr.wait_until_finished()
    port = portpicker.pick_unused_port()
    worker = os.path.join(REPO, "tests", "support", "refresh_worker.py")
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(port), str(i), str(tmp_path), data_dir, *overrides],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "PUBLISHED -" in outs[1] and "PUBLISHED " + index_dir(str(tmp_path)) in outs[0]
    tokens = datasets.load_blocks(data_dir)[0]
    step, path = store.latest_valid(index_dir(str(tmp_path)), expected_num_blocks=len(tokens))
    want = jax.jit(lambda p, t: embedding.embed_block_tokens(model, p, t))(state.params, tokens)
    np.testing.assert_allclose(store.load_embeddings(path), np.asarray(want), atol=2e-5)
    assert step == 0


@pytest.mark.system  # CI: test_guarded_update_skips_a_non_finite_step (the update's guard)
def test_non_finite_steps_are_skipped_and_stop_the_run_without_saving(data_dir, tmp_path):
    """lr=1e30 blows the weights up after the first update: every later step is non-finite.
    Those updates are not applied (decided on device), the run stops past
    train.max_nonfinite with a message naming the step and the metric, and every checkpoint
    on disk holds finite weights (nothing was saved after the blow-up)."""
    from realm_jax.train.loop import TrainingStopped

    work = str(tmp_path / "nan")
    cfg = config(
        f"data.data_dir={data_dir}",
        "train.lr=1e30",
        "train.warmup_steps=0",
        "train.max_nonfinite=3",
        "train.checkpoint_every=2",
    )
    with pytest.raises(TrainingStopped, match=r"step \d+: loss.* not finite for 4 steps"):
        pretrain_commands.train(cfg, work)
    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    for step in mgr.all_steps():
        state = mgr.restore(step, args=ocp_args_state())["state"]
        leaves = jax.tree.leaves(state["params"])
        assert all(np.isfinite(np.asarray(x)).all() for x in leaves), step


def ocp_args_state():
    import orbax.checkpoint as ocp

    return ocp.args.Composite(state=ocp.args.PyTreeRestore())


def test_guarded_update_skips_a_non_finite_step():
    import optax

    from realm_jax.train.state import TrainState, guarded_update

    opt = optax.sgd(0.1)
    params = {"w": jnp.ones(3)}
    state = TrainState(
        step=jnp.int32(4), params=params, opt_state=opt.init(params), nonfinite=jnp.int32(0)
    )
    good = guarded_update(state, {"w": jnp.ones(3)}, {"loss": jnp.float32(1.0)}, opt)
    np.testing.assert_allclose(good.params["w"], 0.9)
    assert int(good.nonfinite) == 0 and int(good.step) == 5
    m = {"loss": jnp.float32(np.nan)}
    bad = guarded_update(good, {"w": jnp.ones(3)}, m, opt)
    np.testing.assert_allclose(bad.params["w"], 0.9)  # unchanged
    assert int(bad.nonfinite) == 1 and int(bad.step) == 6 and int(m["nonfinite"]) == 1
    inf = guarded_update(bad, {"w": jnp.full(3, np.inf)}, {"loss": jnp.float32(1.0)}, opt)
    assert int(inf.nonfinite) == 2 and np.isfinite(np.asarray(inf.params["w"])).all()


def test_embedder_lr_scale_scales_only_the_embedders_steps():
    """With plain SGD the scaled step is exactly factor x the unscaled one, for the
    embedders only (train.embedder_lr_scale)."""
    import optax

    from realm_jax.train.optimizer import scale_networks

    params = {n: {"w": jnp.ones(3)} for n in ("query_embedder", "doc_embedder", "reader")}
    grads = jax.tree.map(lambda x: 2 * x, params)
    opt = optax.chain(optax.sgd(0.5), scale_networks(0.1))
    updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates["query_embedder"]["w"], -0.1)  # -0.5 * 2 * 0.1
    np.testing.assert_allclose(updates["doc_embedder"]["w"], -0.1)
    np.testing.assert_allclose(updates["reader"]["w"], -1.0)


def test_embedders_frozen_steps_hold_the_embedders_then_release_them():
    """train.embedders_frozen_steps (the reader warm-up): through make_optimizer's AdamW with
    weight decay, the embedders stay bit-identical for the first N updates while the reader
    moves; from update N+1 they move at embedder_lr_scale x the reader's step (SGD check)."""
    import ml_collections
    import optax

    from realm_jax.train.optimizer import make_optimizer, scale_networks

    params = {n: {"w": jnp.ones(3)} for n in ("query_embedder", "doc_embedder", "reader")}
    grads = jax.tree.map(lambda x: 2 * x, params)
    train = ml_collections.ConfigDict(
        dict(
            steps=10,
            lr=0.1,
            warmup_steps=0,
            weight_decay=0.5,
            grad_clip=1.0,
            adam_b1=0.9,
            adam_b2=0.999,
            adam_eps=1e-6,
            embedder_lr_scale=1.0,
            embedders_frozen_steps=2,
        )
    )
    opt = make_optimizer(train)
    p, state = params, opt.init(params)
    for step in range(3):
        updates, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, updates)
        moved = {k: not np.allclose(p[k]["w"], 1.0) for k in p}
        assert moved["reader"]
        assert moved["query_embedder"] == moved["doc_embedder"] == (step >= 2), step
    sgd = optax.chain(optax.sgd(0.5), scale_networks(0.1, frozen_steps=1))
    state = sgd.init(params)
    first, state = sgd.update(grads, state, params)
    second, _ = sgd.update(grads, state, params)
    np.testing.assert_allclose(first["query_embedder"]["w"], 0.0)
    np.testing.assert_allclose(first["reader"]["w"], -1.0)
    np.testing.assert_allclose(second["doc_embedder"]["w"], -0.1)  # -0.5 * 2 * 0.1
    # train.embedders_warmup_steps: after the frozen update, a ramp of 4: 1/4, 2/4, 3/4, 1, 1
    sgd = optax.chain(optax.sgd(0.5), scale_networks(0.1, frozen_steps=1, warmup_steps=4))
    state, got = sgd.init(params), []
    for _ in range(6):
        u, state = sgd.update(grads, state, params)
        got.append(float(u["query_embedder"]["w"][0]))
        np.testing.assert_allclose(u["reader"]["w"], -1.0)
    np.testing.assert_allclose(got, [0.0, -0.025, -0.05, -0.075, -0.1, -0.1], rtol=1e-6)


def test_refresher_never_publishes_non_finite_embeddings(data_dir, tmp_path, caplog):
    cfg = config(f"data.data_dir={data_dir}", "refresh.mode=external", "refresh.build_scann=false")
    workdir = str(tmp_path)
    mesh = sharding.make_mesh(cfg.mesh)
    _, _, state, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    state = state.replace(params=jax.tree.map(lambda p: p * np.nan, state.params))
    mgr = checkpoint.manager(workdir, with_data=False)
    checkpoint.save(mgr, 3, state)
    mgr.wait_until_finished()
    refresher = Refresher(cfg, workdir, datasets.load_blocks(data_dir)[0])
    with caplog.at_level("ERROR"):
        assert refresher.refresh_once(mgr, 3) == ""
    assert store.list_versions(paths.index_dir(workdir)) == []
    assert "checkpoint 3" in caplog.text and "non-finite" in caplog.text


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return out


def _local(data_dir, workdir, *extra, **popen_kw) -> tuple[subprocess.Popen, list[int]]:
    """`local` in the background (external refresher, a long run) and its refresher's pid."""
    cmd = [
        *(sys.executable, "-m", "realm_jax", "local", "--workdir", str(workdir)),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *[f"--config.{o}" for o in OVERRIDES],
        f"--config.data.data_dir={data_dir}",
        "--config.refresh.mode=external",
        "--config.train.steps=100000",
        *extra,
    ]
    parent = subprocess.Popen(cmd, cwd=REPO, **popen_kw)
    deadline = time.time() + 120
    kids = []
    while time.time() < deadline and not kids:
        kids = _children(parent.pid)
        time.sleep(0.2)
    assert kids, "the refresher never started"
    return parent, kids


def test_local_refresher_dies_with_a_killed_parent(data_dir, tmp_path):
    """kill -9 of `local` leaves no refresher behind (parent-death signal)."""
    with open(tmp_path / "local.log", "wb") as log:
        parent, kids = _local(data_dir, tmp_path, stdout=log, stderr=subprocess.STDOUT)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(os.path.exists(f"/proc/{k}") for k in kids):
        for k in kids:  # reap if it became ours (it is reparented to init otherwise)
            try:
                os.waitpid(k, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.2)
    alive = [k for k in kids if os.path.exists(f"/proc/{k}")]
    for k in alive:
        os.kill(k, signal.SIGKILL)
    assert not alive, f"refresher {alive} outlived its killed parent"


def test_local_restarts_a_dead_refresher_then_stops(data_dir, tmp_path):
    """A dead refresh job is restarted (refresh.max_restarts=1 here); when the restarted one
    dies too, `local` stops (non-zero, naming the cause) instead of training on a frozen
    index."""
    with open(tmp_path / "local.log", "wb") as log:
        parent, kids = _local(
            data_dir, tmp_path, "--config.refresh.max_restarts=1", stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        time.sleep(2)
        os.kill(kids[0], signal.SIGKILL)
        deadline, again = time.time() + 120, []
        while time.time() < deadline and not again:
            again = [k for k in _children(parent.pid) if k != kids[0]]
            time.sleep(0.2)
        assert again, (tmp_path / "local.log").read_text()[-3000:]
        time.sleep(2)
        os.kill(again[0], signal.SIGKILL)
        parent.wait(timeout=180)
    finally:
        parent.kill()
    out = (tmp_path / "local.log").read_text()
    assert parent.returncode != 0
    assert f"the refresh job (pid {kids[0]}) exited with code -9: restarting it" in out
    assert f"the refresh job (pid {again[0]}) exited with code -9, after 1 restarts" in out
    # started without a fork of the multithreaded trainer through Python (no preexec_fn: the
    # child sets its own parent-death signal, runtime.die_with_parent), so no JAX fork warning
    assert "os.fork()" not in out, out[-3000:]


def test_amortized_refresh_serves_slices_embedded_with_each_steps_params(data_dir, tmp_path):
    """refresh.mode=amortized: before each step every device re-embeds 1/refresh.every of its
    own rows; after refresh.every steps the served index is exactly those slices, each as a
    whole-pass embedding with that step's parameters would give it (every=5: the
    last slice is moved back to end at the last row, overlapping the one before)."""
    every = 5
    cfg = config(f"data.data_dir={data_dir}", "refresh.mode=amortized", f"refresh.every={every}")
    tokens = datasets.load_blocks(data_dir)[0]
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state0, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))

    def moved(seed):  # the parameters of another step
        k = jax.random.key(seed)
        return jax.tree.map(
            lambda p: p + 0.05 * jax.random.normal(k, p.shape, p.dtype), state0.params
        )

    params = [moved(s) for s in range(2 * every)]
    feed = IndexFeed(cfg, str(tmp_path), mesh, model, tokens)
    feed.start(params[0], 0)
    whole = [np.asarray(feed.embed(p, feed.tokens)) for p in params]  # a whole pass each
    n_dev = mesh.devices.size
    per_dev = whole[0].shape[0] // n_dev

    def expected(steps):  # steps[j]: the step whose parameters embedded slice j
        out = whole[0].reshape(n_dev, per_dev, -1).copy()
        for j, s in enumerate(steps):
            first, size = embedding.slice_rows(per_dev, every, j)
            out[:, first : first + size] = whole[s].reshape(n_dev, per_dev, -1)[
                :, first : first + size
            ]
        return out.reshape(whole[0].shape)

    first, size = embedding.slice_rows(per_dev, every, every - 1)
    assert first + size == per_dev and first < (every - 1) * size  # the overlap is exercised
    served = {}
    for step in range(1, 2 * every):
        assert feed.due(step)
        assert feed.maybe_refresh(params[step], step) == (step % every == every - 1)
        served[step] = (np.asarray(feed.emb), feed.step)
    np.testing.assert_array_equal(served[1][0], whole[0])  # nothing served mid-cycle
    # the first cycle: slice 0 from the first whole pass (step 0), then steps 1 .. every-1
    np.testing.assert_allclose(served[every - 1][0], expected(range(every)), atol=1e-5)
    assert served[every - 1][1] == 0 and served[every][1] == 0  # its oldest slice's step
    last = 2 * every - 1
    np.testing.assert_allclose(served[last][0], expected(range(every, 2 * every)), atol=1e-5)
    assert served[last][1] == every


@pytest.mark.system  # a CLI run: CI keeps the amortized slices' test
def test_amortized_refresh_trains_without_a_refresh_job(data_dir, tmp_path):
    """A REALM run with refresh.mode=amortized: no refresh job, no whole-pass stall after the
    first index, staleness within 2 * refresh.every - 1 steps."""
    cfg = config(
        f"data.data_dir={data_dir}",
        "refresh.mode=amortized",
        "refresh.every=3",
        "train.steps=8",
        "train.checkpoint_every=8",
    )
    history = pretrain_commands.train(cfg, str(tmp_path))
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 8 and all(np.isfinite(h["loss"]) for h in steps)
    assert max(h["staleness"] for h in steps) <= 2 * 3 - 1
    assert not os.path.exists(index_dir(str(tmp_path)))  # nothing published


def test_refresh_job_embeds_a_large_corpus_in_parts_and_reports_progress(data_dir, tmp_path):
    """refresh.progress_every_blocks: the refresh job embeds the corpus in parts (each device's
    own rows), writing its progress after each; the index equals a whole-pass embedding."""
    cfg = config(
        f"data.data_dir={data_dir}",
        "refresh.mode=external",
        "refresh.progress_every_blocks=50",
    )
    workdir = str(tmp_path)
    tokens = datasets.load_blocks(data_dir)[0]
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, state, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    mgr = checkpoint.manager(workdir, with_data=False)
    checkpoint.save(mgr, 0, state)
    mgr.wait_until_finished()
    refresher = Refresher(cfg, workdir, tokens)
    assert refresher.parts == -(-len(tokens) // 50) > 1
    assert refresher.run(max_versions=1) == 1
    progress = store.read_progress(index_dir(workdir))
    assert progress["checkpoint"] == 0 and progress["phase"] == "publish"
    assert progress["done"] == progress["of"] == refresher.parts
    whole = np.asarray(
        refresher.embed({refresher.name: state.params[refresher.name]}, refresher.tokens)
    )
    published = store.load_embeddings(store.latest_valid(index_dir(workdir))[1])
    np.testing.assert_allclose(published, whole[: len(tokens)], atol=1e-5)


def test_first_index_wait_follows_the_refresh_jobs_progress(data_dir, tmp_path, caplog):
    """The trainer waits for its first index as long as the refresh job reports progress (a
    pass over 13M blocks outlasts any fixed wait), and gives up after refresh.wait_seconds
    with neither an index nor progress."""
    import threading

    # the job reports every 0.25 s, 12x inside wait_seconds (a loaded 2-core CI machine
    # stalled a thread for over 1.5 s), and for 4 s in all, past wait_seconds
    cfg = config(f"data.data_dir={data_dir}", "refresh.mode=external", "refresh.wait_seconds=3")
    cfg.refresh.poll_seconds = 0.1
    tokens = datasets.load_blocks(data_dir)[0]
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, _, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    alone = str(tmp_path / "alone")
    t0 = time.time()
    with pytest.raises(TimeoutError, match="no progress from a refresh job"):
        IndexFeed(cfg, alone, mesh, model, tokens).start(None, 0)
    assert 3 <= time.time() - t0 < 15

    work = str(tmp_path / "busy")
    idir = index_dir(work)
    os.makedirs(idir)
    stop = threading.Event()

    def refresh_job():  # loads its corpus, reports for 4 s (past wait_seconds), publishes
        since = time.time()
        for j in range(16):
            if j < 4:  # as `realm-jax refresh` reports before it has a checkpoint
                store.write_progress(idir, checkpoint=None, phase="loading the corpus")
            else:
                store.write_progress(idir, checkpoint=0, phase="embed", done=j, of=16, since=since)
            if stop.wait(0.25):
                return
        store.publish_index(idir, 0, np.ones((len(tokens), cfg.model.proj_size), np.float32))

    job = threading.Thread(target=refresh_job)
    t1 = time.time()
    job.start()
    caplog.set_level("INFO", logger="realm_jax.refresh")
    try:
        feed = IndexFeed(cfg, work, mesh, model, tokens)
        feed.start(None, 0)
    finally:
        stop.set()
        job.join()
    assert feed.step == 0 and time.time() - t1 > 3.9  # it waited past wait_seconds
    assert "the refresh job is loading the corpus" in caplog.text
    assert "the refresh job is at checkpoint 0, embed part" in caplog.text
