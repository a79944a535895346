"""grain pipeline: batch shapes, determinism, per-process sharding, orbax save/restore resume."""

import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from realm_jax import tokenization as tk
from realm_jax.config import load_config
from realm_jax.data import pipeline as PL
from realm_jax.data import prepare as P
from realm_jax.data import prepared as prepared_lib
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


def test_sharding_by_process(prepared, monkeypatch):
    d, ov = prepared
    cfg = load_config(SPEC, ov)
    n = len(prepared_lib.examples_source(d))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="not divisible"):
        PL.local_batch_size(7)
    rows = []
    for pid in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
        batches = list(PL.train_loader(cfg, d, global_batch_size=B, seed=0, num_epochs=1))
        assert len(batches) == (n // 2) // (B // 2)
        assert all(b["query_ids"].shape == (B // 2, cfg.data.query_len) for b in batches)
        rows.append({r.tobytes() for b in batches for r in b["query_ids"]})
    assert len(rows[0] & rows[1]) <= 1  # disjoint shares (bar a duplicate sentence)


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
