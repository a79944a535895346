"""grain pipeline: batch shapes, determinism, per-process sharding, orbax save/restore resume,
and resume onto another process or worker count (the global order does not depend on them)."""

import os
import subprocess
import sys

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from realm_jax import checkpoint
from realm_jax import tokenization as tk
from realm_jax.config import load_config
from realm_jax.data import datasets
from realm_jax.data import pipeline as PL
from realm_jax.data import prepare as P
from tests.conftest import REPO

SAMPLE = os.path.join(REPO, "data", "sample", "corpus.jsonl")
SPEC = os.path.join(REPO, "configs", "realm.py:smoke")
B = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    tiny = root / "tiny.jsonl"
    with open(SAMPLE) as f, open(tiny, "w") as g:
        g.writelines(line for _, line in zip(range(12), f, strict=False))
    overrides = [f"data.corpus={tiny}", "data.masking=random"]
    P.prepare(load_config(SPEC, overrides), str(root / "data"))
    return str(root / "data"), overrides


def _batches(config, data_dir, n, seed=0, it=None, **kw):
    it = it or iter(PL.train_loader(config, data_dir, global_batch_size=B, seed=seed, **kw))
    return it, [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def test_batch_shapes_and_masking(prepared):
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    _, (b,) = _batches(cfg, d, 1)
    L, M = cfg.data.query_len, cfg.data.max_predictions
    assert b["query_ids"].shape == (B, L) and b["query_ids"].dtype == np.int32
    for k in ("mlm_positions", "mlm_targets"):
        assert b[k].shape == (B, M) and b[k].dtype == np.int32
    assert b["mlm_weights"].shape == (B, M) and b["mlm_weights"].dtype == np.float32
    assert b["block_id"].shape == (B,) and b["block_id"].dtype == np.int32
    for q, pos, tgt, w in zip(
        b["query_ids"], b["mlm_positions"], b["mlm_targets"], b["mlm_weights"], strict=False
    ):
        n = int(w.sum())
        assert n >= 1 and (q[pos[:n]] == tk.MASK_ID).all() and (tgt[:n] != tk.MASK_ID).all()
        assert (tgt[n:] == 0).all() and q[0] == tk.CLS_ID


def test_deterministic_for_seed(prepared):
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    assert _same(_batches(cfg, d, 3, seed=5)[1], _batches(cfg, d, 3, seed=5)[1])
    assert not _same(_batches(cfg, d, 3, seed=5)[1], _batches(cfg, d, 3, seed=6)[1])


def _as_process(monkeypatch, pid: int, count: int) -> None:
    """Make this test process JAX process `pid` of `count` (for the pipeline and grain)."""
    monkeypatch.setattr(jax, "process_count", lambda: count)
    monkeypatch.setattr(jax, "process_index", lambda: pid)


def _concat(parts):
    """The global batches from each process's local batches (process p: rows p*b...)."""
    return [{k: np.concatenate([b[k] for b in rows]) for k in rows[0]} for rows in zip(*parts)]


def test_sharding_by_process(prepared, monkeypatch):
    """Each process reads its rows of the same global batches: the processes' batches side by
    side are the one-process batches, for 2 and 4 processes."""
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    n = len(datasets.examples_source(d))
    want = list(PL.train_loader(cfg, d, global_batch_size=B, seed=0, num_epochs=1))
    assert len(want) == n // B
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="not divisible"):
        PL.local_batch_size(7)
    for count in (2, 4):
        parts = []
        for pid in range(count):
            _as_process(monkeypatch, pid, count)
            batches = list(PL.train_loader(cfg, d, global_batch_size=B, seed=0, num_epochs=1))
            assert all(b["query_ids"].shape == (B // count, cfg.data.query_len) for b in batches)
            parts.append(batches)
        assert _same(_concat(parts), want), count


def test_one_process_order_is_grain_index_samplers(prepared):
    """At one process the order (records and span draws, across an epoch boundary) is exactly
    that of grain's IndexSampler, which realm-jax used before: single-process runs and their
    checkpoints keep their data order."""
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    source = datasets.examples_source(d)
    n_batches = 2 * len(source) // B + 1
    _, got = _batches(cfg, d, n_batches, seed=3)
    it = iter(_legacy_loader(cfg, source, seed=3))
    assert _same(got, [next(it) for _ in range(n_batches)])


def _legacy_loader(cfg, source, seed):
    """The DataLoader realm-jax built before GlobalBatchSampler (its order depends on the
    process count)."""
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        seed=seed,
    )
    ops = [
        PL.MaskSpan(cfg.data.query_len, cfg.data.max_predictions),
        grain.transforms.Batch(batch_size=PL.local_batch_size(B), drop_remainder=True),
    ]
    return grain.DataLoader(data_source=source, sampler=sampler, operations=ops, worker_count=0)


@pytest.mark.parametrize("saved_by,resumed_by", [(2, 1), (1, 2), (4, 2)])
def test_resume_onto_another_process_count(prepared, tmp_path, monkeypatch, saved_by, resumed_by):
    """A data iterator state saved by `saved_by` processes after 3 batches restores on each of
    `resumed_by` processes: side by side they go on with the one-process global batches 3, 4,
    5 (a pod slice resumed with another host count)."""
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    _, want = _batches(cfg, d, 6)
    handler, directory = PL.IteratorHandler(), epath.Path(tmp_path)
    for pid in range(saved_by):
        _as_process(monkeypatch, pid, saved_by)
        it, _ = _batches(cfg, d, 3)
        handler.save(directory, args=PL.iterator_save_args(it))
    assert sorted(f.name for f in directory.iterdir()) == [
        f"process_{i}-of-{saved_by}.json" for i in range(saved_by)
    ]
    parts = []
    for pid in range(resumed_by):
        _as_process(monkeypatch, pid, resumed_by)
        it = iter(PL.train_loader(cfg, d, global_batch_size=B, seed=0))
        handler.restore(directory, args=PL.iterator_restore_args(it))
        parts.append(_batches(cfg, d, 3, it=it)[1])
    assert _same(_concat(parts), want[3:])


def test_iterator_state_translation_round_trips():
    """batches_consumed inverts loader_state for any process and worker count (grain's state
    layout with workers was checked against real worker processes by hand: slow to start)."""
    sampler = "GlobalBatchSampler(num_records=50, global_batch_size=8, seed=0, num_epochs=None)"
    base = {"version": 2, "data_source": "src", "sampler": sampler}
    for count in (1, 2, 4):
        for workers in (0, 1, 3):
            for n in range(10):
                for pid in range(count):
                    state = PL.loader_state(base, n, pid, count, workers, 8 // count, sampler)
                    assert PL.batches_consumed(state, pid, count, 8 // count) == n
    state = PL.loader_state(base, 3, 0, 2, 0, 4, sampler)
    state["last_seen_indices"]["0"] += 2  # mid-batch: not a state the loop leaves
    with pytest.raises(ValueError, match="whole batch"):
        PL.batches_consumed(state, 0, 2, 4)


def test_legacy_one_process_checkpoint_resumes_exactly(prepared, tmp_path):
    """A checkpoint whose data_iter grain's own handler saved from the IndexSampler loader
    (realm-jax before GlobalBatchSampler, one process) resumes with the same next batches, and
    the manager then saves with the new handler."""
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    legacy = iter(_legacy_loader(cfg, datasets.examples_source(d), seed=0))
    [next(legacy) for _ in range(3)]
    mngr = ocp.CheckpointManager(str(tmp_path), item_names=("data_iter",))
    mngr.save(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(legacy)))
    mngr.wait_until_finished()
    want = [next(legacy) for _ in range(3)]
    mngr = ocp.CheckpointManager(str(tmp_path), item_names=("data_iter",))
    it = iter(PL.train_loader(cfg, d, global_batch_size=B, seed=0))
    mngr.restore(3, args=ocp.args.Composite(data_iter=PL.iterator_restore_args(it)))
    assert _same(_batches(cfg, d, 3, it=it)[1], want)
    mngr.save(6, args=ocp.args.Composite(data_iter=PL.iterator_save_args(it)))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [3, 6]


def test_another_data_order_is_a_mismatch_not_damage(prepared, tmp_path):
    """A data iterator saved for another order (here another seed, as a checkpoint from before
    fingerprints could be) is a CheckpointMismatch out of checkpoint.try_restore, not a
    failed restore that would set the checkpoint aside as damaged."""
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    it, _ = _batches(cfg, d, 2)
    mngr = ocp.CheckpointManager(str(tmp_path), item_names=("data_iter",))
    mngr.save(2, args=ocp.args.Composite(data_iter=PL.iterator_save_args(it)))
    mngr.wait_until_finished()
    other = iter(PL.train_loader(cfg, d, global_batch_size=B, seed=1))
    args = ocp.args.Composite(data_iter=PL.iterator_restore_args(other))
    with pytest.raises(checkpoint.CheckpointMismatch, match="another data order.*seed=1"):
        checkpoint.try_restore(lambda: mngr.restore(2, args=args))


RESTORE = """
import sys, numpy as np, orbax.checkpoint as ocp
from realm_jax.config import load_config
from realm_jax.data import pipeline as PL
spec, data_dir, ckpt, out, *ov = sys.argv[1:]
it = iter(PL.train_loader(load_config(spec, ov), data_dir, global_batch_size=8, seed=0))
mngr = ocp.CheckpointManager(ckpt)
mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data_iter=PL.iterator_restore_args(it)))
batches = [next(it) for _ in range(3)]
np.savez(out, **{f"{i}_{k}": v for i, b in enumerate(batches) for k, v in b.items()})
"""


def test_resume_in_new_process(prepared, tmp_path):
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    it, _ = _batches(cfg, d, 4)
    ckpt = str(tmp_path / "ckpt")
    mngr = ocp.CheckpointManager(ckpt)
    mngr.save(4, args=ocp.args.Composite(data_iter=PL.iterator_save_args(it)))
    mngr.wait_until_finished()
    _, want = _batches(cfg, d, 3, it=it)  # the uninterrupted run goes on
    out = str(tmp_path / "resumed.npz")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    subprocess.run(
        [sys.executable, "-c", RESTORE, SPEC, d, ckpt, out, *ov],
        check=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    got = np.load(out)
    for i, b in enumerate(want):
        for k, v in b.items():
            np.testing.assert_array_equal(got[f"{i}_{k}"], v, err_msg=f"batch {i} {k}")


def _span_loader(records, seed, num_epochs=4):
    import grain

    sampler = grain.samplers.IndexSampler(
        num_records=len(records), shuffle=True, num_epochs=num_epochs, seed=seed
    )
    return grain.DataLoader(
        data_source=records, sampler=sampler, operations=[PL.MaskSpan(10, 3)], worker_count=0
    )


def test_one_salient_span_drawn_per_epoch_deterministically_and_resumably():
    """Each example keeps all its spans; every read draws one (a different draw per epoch),
    the draws depend only on the seed, and a restored iterator continues the same draws."""
    records = [
        {
            "token_ids": np.array([101, 11 + i, 12, 13, 14, 15, 102], np.int32),
            "span_starts": np.array([1, 3, 5], np.int32),
            "span_ends": np.array([1, 4, 5], np.int32),
            "block_id": np.int32(i),
        }
        for i in range(6)
    ]
    out = list(_span_loader(records, seed=3))  # 4 epochs x 6 examples
    again = list(_span_loader(records, seed=3))
    assert _same(out, again)
    per_example = {}
    for ex in out:
        masked = tuple(np.flatnonzero(ex["query_ids"] == tk.MASK_ID))
        assert masked in ((1,), (3, 4), (5,))  # always exactly one of the example's spans
        np.testing.assert_array_equal(ex["mlm_positions"][: len(masked)], masked)
        per_example.setdefault(int(ex["block_id"]), []).append(masked)
    assert all(len(v) == 4 for v in per_example.values())
    assert sum(len(set(v)) > 1 for v in per_example.values()) >= 4  # draws change by epoch
    assert not _same(out, list(_span_loader(records, seed=4)))

    it = iter(_span_loader(records, seed=3))
    head = [next(it) for _ in range(9)]
    state = it.get_state()
    resumed = iter(_span_loader(records, seed=3))
    resumed.set_state(state)
    assert _same(head + list(resumed), out)
