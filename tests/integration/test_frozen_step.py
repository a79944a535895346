"""The frozen-embedders train step (train.embedders_frozen_steps: compile_train_step(frozen=True))
against the full step on the same batch and state, and the loop's choice of step by step number."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import checkpoint, sharding
from realm_jax.config import load_config
from realm_jax.index import embedding
from realm_jax.pretrain import commands as pretrain_commands
from realm_jax.pretrain import step as pretrain_step
from realm_jax.train import loop
from realm_jax.train.optimizer import EMBEDDERS
from tests.conftest import REPO, prepare_sample_head
from tests.support.realm_fixtures import synthetic_batch, synthetic_index, tiny_config
from tests.support.runs import realm_config

# train.frozen_step is off by default (configs/realm.py): its checks run in the system tier
# (about 4 min on a loaded 2-core machine), outside make test's 15 minutes (docs/testing.md)
pytestmark = pytest.mark.system

# dropout on (the frozen step must keep the full step's keys); the clip far away, so that the
# reader's update does not depend on whether the embedders' gradients join its global norm
OVERRIDES = (
    "train.embedders_frozen_steps=5",
    "train.frozen_step=true",
    "train.grad_clip=1e9",
    "model.embedder.dropout=0.1",
    "model.reader.dropout=0.1",
    "model.proj_dropout=0.1",
)


def _under_embedder(path) -> bool:
    return any(getattr(k, "key", None) in EMBEDDERS for k in path)


@pytest.fixture(scope="module")
def steps():
    """(state before, full step's (state, metrics), frozen step's (state, metrics), compiled
    full and frozen steps, their args) on the same batch and state."""
    config = tiny_config(*OVERRIDES)
    mesh = sharding.make_mesh(config.mesh)
    emb, tokens = synthetic_index(config)
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
    batch = sharding.global_batch(synthetic_batch(config), mesh)
    out, fns = {}, {}
    before = None
    for frozen in (False, True):  # a fresh state each time: the step donates it
        model, opt, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
        assert model.uses_dropout  # the same dropout keys in both steps
        if before is None:
            before = jax.device_get(state)
        fn = pretrain_step.compile_train_step(
            config, mesh, model, opt, shardings, len(emb), frozen=frozen
        )
        fns[frozen] = (fn, (state, batch, *index, jnp.int32(0)))
        out[frozen] = jax.device_get(fn(state, batch, *index, jnp.int32(0)))
    return before, out[False], out[True], fns


def test_frozen_step_updates_the_reader_as_the_full_step_does(steps):
    before, (full, m_full), (frozen, m_frozen), _ = steps
    assert set(m_frozen) == set(m_full)
    np.testing.assert_allclose(m_frozen["loss"], m_full["loss"], rtol=1e-6)
    for name in EMBEDDERS:
        assert m_full[f"grad_norm/{name}"] > 0 and m_frozen[f"grad_norm/{name}"] == 0
    assert m_frozen["grad_norm/reader"] > 0
    np.testing.assert_allclose(m_frozen["grad_norm/reader"], m_full["grad_norm/reader"], rtol=1e-5)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), full.params, before.params)
    assert max(jax.tree.leaves(moved["reader"])) > 0  # the step did change the reader
    old_leaves = jax.tree.leaves(before.params)
    full_leaves = jax.tree_util.tree_leaves_with_path(full.params)
    for (path, a), b, o in zip(
        full_leaves, jax.tree.leaves(frozen.params), old_leaves, strict=True
    ):
        if not _under_embedder(path):  # the reader's update, not only its weights
            np.testing.assert_allclose(b - o, a - o, rtol=1e-4, atol=1e-9, err_msg=str(path))
    full_opt = jax.tree_util.tree_leaves_with_path(full.opt_state)
    for (path, a), b in zip(full_opt, jax.tree.leaves(frozen.opt_state), strict=True):
        if not _under_embedder(path):  # the reader's Adam moments (its gradient), the counts
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-12, err_msg=str(path))
    assert int(frozen.step) == int(full.step) == 1


def test_frozen_step_leaves_the_embedders_and_their_moments_bit_identical(steps):
    before, _, (frozen, _), _ = steps
    n = 0
    for new, old in ((frozen.params, before.params), (frozen.opt_state, before.opt_state)):
        flat_new = jax.tree_util.tree_leaves_with_path(new)
        flat_old = jax.tree.leaves(old)
        for (path, a), b in zip(flat_new, flat_old, strict=True):
            if _under_embedder(path):
                np.testing.assert_array_equal(a, b, err_msg=str(path))
                n += 1
    assert n > 0


def test_frozen_step_computes_no_embedder_backward(steps):
    """XLA's FLOP count: the frozen step skips the embedders' backward (about twice their
    forward), so it costs less than the full step by more than a rounding."""
    *_, fns = steps
    flops = {}
    for frozen, (fn, args) in fns.items():
        cost = fn.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        flops[frozen] = cost["flops"]
    assert flops[True] < 0.9 * flops[False], flops


def test_frozen_step_in_micro_batches_matches_one_pass():
    """train.grad_accum=2 (accumulated_grads over the reader's params alone): the frozen
    step's reader gradient and loss as in one pass, the embedders kept."""
    same = ("train.embedders_frozen_steps=5", "train.batch_size=16")
    metrics = {}
    for accum in (1, 2):
        config = tiny_config(*same, f"train.grad_accum={accum}")
        mesh = sharding.make_mesh(config.mesh)
        emb, tokens = synthetic_index(config)
        e, t = embedding.pad_index(emb, tokens, mesh)
        index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
        batch = sharding.global_batch(synthetic_batch(config, seed=4), mesh)
        model, opt, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
        before = jax.device_get(state.params)
        fn = pretrain_step.compile_train_step(
            config, mesh, model, opt, shardings, len(emb), frozen=True
        )
        new, m = jax.device_get(fn(state, batch, *index, jnp.int32(0)))
        for name in EMBEDDERS:
            for a, b in zip(jax.tree.leaves(new.params[name]), jax.tree.leaves(before[name])):
                np.testing.assert_array_equal(a, b)
        metrics[accum] = m
    for k in ("loss", "grad_norm/reader", "grad_norm"):
        np.testing.assert_allclose(metrics[2][k], metrics[1][k], rtol=1e-4, err_msg=k)


class _Storage:  # a checkpoint manager that keeps nothing
    def save(self, step, **_kw):
        return True

    def wait_until_finished(self):
        pass

    def latest_step(self):
        return None


@pytest.mark.parametrize("start", [0, 1, 3])
def test_loop_runs_the_frozen_step_exactly_before_the_unfreezing_step(tmp_path, start):
    """loop.run with REALM's choice (pretrain step.step_for): steps start..3 of 5, the
    embedders frozen for the first 2 (a resume at 1 and at 3 too)."""
    ran = []

    def variant(name):
        def step(state, batch):
            ran.append((name, int(state)))  # the state is the step number here
            return state + 1, {"loss": jnp.float32(1.0)}

        return step

    full, frozen = variant("full"), variant("frozen")
    config = load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"),
        [
            "train.batch_size=8",
            "train.steps=5",
            "train.log_every=1",
            "train.eval_every=0",
            "train.checkpoint_every=100",
        ],
    )
    task = loop.Task(name="t", step=full, step_for=pretrain_step.step_for(full, frozen, 2))

    def batches():
        while True:
            yield {"x": np.zeros((8, 1), np.float32)}

    loop.run(
        config,
        str(tmp_path),
        task,
        jnp.int32(start),
        batches(),
        _Storage(),
        start,
        lambda _it: None,
    )
    want = [("frozen" if s < 2 else "full", s) for s in range(start, 5)]
    assert ran == want


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """60 real passages of the bundled sample, prepared with random masking."""
    return prepare_sample_head(tmp_path_factory, realm_config, 60)


@pytest.mark.parametrize("on", [True, False], ids=["frozen_step", "default"])
def test_realm_training_runs_the_frozen_step_until_the_embedders_unfreeze(
    data_dir, tmp_path, monkeypatch, on
):
    """`train` with train.embedders_frozen_steps=2 of 4 steps: the frozen step runs steps 0 and 1,
    the full step 2 and 3; the checkpoint of step 2 holds the embedders of step 0 bit for bit
    (and their Adam moments), step 4's do not (the full step 2 moved them). Without
    train.frozen_step (the default) every step is the full one and no frozen step is compiled."""
    ran, compile_step = [], pretrain_step.compile_train_step

    def spied(*args, frozen=False, **kwargs):
        fn = compile_step(*args, frozen=frozen, **kwargs)

        def run(state, *rest):
            ran.append(("frozen" if frozen else "full", int(jax.device_get(state.step))))
            return fn(state, *rest)

        return run

    monkeypatch.setattr(pretrain_step, "compile_train_step", spied)
    over = (
        "train.steps=4",
        "train.embedders_frozen_steps=2",
        f"train.frozen_step={str(on).lower()}",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=3",
        f"data.data_dir={data_dir}",
    )
    config = realm_config(*over)
    pretrain_commands.train(config, str(tmp_path))
    if not on:
        assert ran == [("full", 0), ("full", 1), ("full", 2), ("full", 3)]
        return
    assert ran == [("frozen", 0), ("frozen", 1), ("full", 2), ("full", 3)]
    mesh = sharding.make_mesh(config.mesh)
    _, _, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(1))
    abstract = checkpoint.abstract_like(state, shardings)
    mgr = checkpoint.manager(str(tmp_path), with_data=False, read_only=True)
    saved = {s: jax.device_get(checkpoint.restore(mgr, s, abstract)) for s in (0, 2, 4)}

    def embedders(s):  # the embedders' weights and Adam moments, flat
        leaves = jax.tree_util.tree_leaves_with_path((saved[s].params, saved[s].opt_state))
        return [x for path, x in leaves if _under_embedder(path)]

    for a, b in zip(embedders(0), embedders(2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(embedders(2), embedders(4), strict=True))
