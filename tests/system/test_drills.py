"""The record the reliability drills compare (acceptance/drills.py): with train.record_example_ids
the loop writes the ids of the examples each step trained on; a resume writes the steps it
redoes again, so the last record of every step is what the run trained on."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import checkpoint
from realm_jax import tokenization as tk
from realm_jax import workdir as paths
from realm_jax.data import datasets, pipeline
from realm_jax.train import loop
from tests.conftest import prepare_sample_head
from tests.support.runs import realm_config as config

DATA_ARGS = (pipeline.iterator_save_args, pipeline.iterator_restore_args)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """30 passages of the bundled sample, prepared with random masking."""
    return prepare_sample_head(tmp_path_factory, config, 30)


def _config(data_dir, steps):
    return config(
        f"data.data_dir={data_dir}",
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=5",
        "train.log_every=1",
        "train.eval_every=0",
        "train.record_example_ids=true",
    )


def _loader(cfg, data_dir):
    return pipeline.train_loader(
        cfg, data_dir, global_batch_size=cfg.train.batch_size, seed=cfg.data.seed
    )


def _records(work: str) -> list[dict]:
    out = []
    with open(paths.example_ids_path(work)) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a kill
    return out


def _train(cfg, data_dir, work: str) -> int:
    """The shared loop with a task whose step only counts: what it records is the loop's."""
    state = {"n": jnp.zeros((), jnp.int32)}
    shardings = jax.tree.map(lambda x: x.sharding, state)
    mgr = checkpoint.manager(work, keep=cfg.train.keep_checkpoints)
    it = iter(_loader(cfg, data_dir))
    start, state = loop.init_or_resume(mgr, state, shardings, it, DATA_ARGS)
    count = jax.jit(lambda s, _batch: ({"n": s["n"] + 1}, {"loss": jnp.float32(0.0)}))
    task = loop.Task(name="count", step=count)
    loop.run(cfg, work, task, state, it, mgr, start, pipeline.iterator_save_args)
    return start


def test_batches_carry_the_ids_of_the_examples_they_hold(data_dir):
    cfg = _config(data_dir, 1)
    batch = next(iter(_loader(cfg, data_dir)))
    by_id = {int(r["example_id"]): r for r in datasets.examples_source(data_dir)}
    assert batch["example_id"].shape == (cfg.train.batch_size,)
    for i, eid in enumerate(batch["example_id"]):
        tokens = tk.pad_to(by_id[int(eid)]["token_ids"], cfg.data.query_len)
        masked = batch["mlm_positions"][i][batch["mlm_weights"][i] > 0]
        keep = np.ones_like(tokens, bool)
        keep[masked] = False
        np.testing.assert_array_equal(batch["query_ids"][i][keep], tokens[keep])
        np.testing.assert_array_equal(batch["mlm_targets"][i][: len(masked)], tokens[masked])


def test_a_resume_rewrites_the_steps_it_redoes(data_dir, tmp_path):
    cfg = _config(data_dir, 6)
    whole = str(tmp_path / "whole")
    _train(cfg, data_dir, whole)
    # The reference: the first 6 batches of a fresh loader, read outside the loop.
    fresh = iter(_loader(cfg, data_dir))
    expected = {s: [int(i) for i in next(fresh)["example_id"]] for s in range(1, 7)}
    assert {r["step"]: r["example_ids"] for r in _records(whole)} == expected

    # Killed while writing step 6's record, before checkpoint 5 had completed (async save):
    # the resume redoes step 5 from checkpoint 4 and its records follow the cut line.
    cut = str(tmp_path / "cut")
    _train(_config(data_dir, 5), data_dir, cut)
    os.rename(os.path.join(paths.checkpoint_dir(cut), "5"), str(tmp_path / "unfinished"))
    with open(paths.example_ids_path(cut), "a") as f:
        f.write('{"step": 6, "exam')
    assert _train(cfg, data_dir, cut) == 4
    records = _records(cut)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5, 6]
    assert {r["step"]: r["example_ids"] for r in records} == expected  # the last one wins
    assert records[4] == records[5]  # the redone step trained on the same examples


def test_off_by_default_and_the_batch_reaches_the_device_without_ids(data_dir, tmp_path):
    cfg = config(f"data.data_dir={data_dir}", "train.steps=1", "train.eval_every=0")
    assert cfg.train.record_example_ids is False
    work = str(tmp_path / "off")
    seen = []

    def step(state, batch):
        seen.append(sorted(batch))
        return state, {"loss": jnp.float32(0.0)}

    state = {"n": jnp.zeros((), jnp.int32)}
    mgr = checkpoint.manager(work)
    it = iter(_loader(cfg, data_dir))
    start, state = loop.init_or_resume(
        mgr, state, jax.tree.map(lambda x: x.sharding, state), it, DATA_ARGS
    )
    loop.run(cfg, work, loop.Task(name="t", step=step), state, it, mgr, start, DATA_ARGS[0])
    assert seen and "example_id" not in seen[0]
    assert not os.path.exists(paths.example_ids_path(work))
