"""The studies' tools against hand counts: the stage stamps and paired test
(experiments/tools/), the gradient noise scale and the GPU run's pack round trip."""

import os

import jax

from tests.conftest import REPO


def test_stage_stamps_reuse_only_a_stage_of_the_same_config_code_and_upstream(
    tmp_path, monkeypatch
):
    """experiments/tools/stage_stamp.py (issue 22: a benchmark reused an ICT workdir made by
    older code): the stamp follows the resolved config, the code and the upstream stages; a
    finished stage is current only under its own stamp, an unfinished one resumes, a stale one
    is moved aside whole."""
    from experiments.tools import stage_stamp as st

    cfg = os.path.join(REPO, "configs", "ict.py") + ":smoke"
    base = st.stamp(cfg, [], ["data-1"])
    assert base == st.stamp(cfg, [], ["data-1"])
    assert base != st.stamp(cfg, ["train.lr=0.5"], ["data-1"])  # another config
    assert base != st.stamp(cfg, [], ["data-2"])  # another upstream stage
    monkeypatch.setattr(st, "code_digest", lambda: "other code")
    assert base != st.stamp(cfg, [], ["data-1"])  # other code
    monkeypatch.undo()

    work = str(tmp_path / "ict")
    assert not st.current(work, base) and not st.started(work, base)
    st.write(work, base, finished=False)
    assert st.started(work, base) and not st.current(work, base)
    st.write(work, base)
    assert st.current(work, base) and not st.current(work, "another")
    (tmp_path / "ict" / "checkpoints").mkdir()
    moved = st.set_aside(work)
    assert not os.path.exists(work) and os.path.isdir(os.path.join(moved, "checkpoints"))


def test_paired_retrieval_counts_and_sign_test_by_hand():
    import pytest

    from experiments.tools.paired_retrieval import EXACT_MATCH, compare, sign_test, spread, table

    # the exact sign test, by hand: 0 of 5 -> 2 * (1/2)^5; 1 of 6 -> 2 * 7/64; 3 of 6 -> 1
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(5, 0) == pytest.approx(2 / 32)
    assert sign_test(1, 5) == pytest.approx(2 * 7 / 64)
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    # a large n stays finite (log space): 158 of 355 is about z = -2.07, p about 0.04
    assert 0.03 < sign_test(158, 197) < 0.05

    def rec(q, hit, ids):
        return {"question": q, "hits": {"5": hit}, "top_blocks": [{"id": i} for i in ids]}

    base = [rec("a", True, [1, 2]), rec("b", False, [1, 3]), rec("c", True, [4, 5])]
    other = [rec("a", False, [1, 1]), rec("b", False, [1, 1]), rec("c", True, [1, 5])]
    c = compare(base, other, 5)
    assert (c["gained"], c["lost"]) == (0, 1) and c["recall"] == pytest.approx(1 / 3)
    assert spread(base, 5) == (5, 2 / 6)  # block 1 twice in 6 retrievals; 5 distinct
    assert spread(other, 5) == (2, 5 / 6)
    assert "| 0 / 1 | 1 |" in table([("base", base), ("other", other)], 5)
    with pytest.raises(ValueError, match="question 1 differs"):
        compare(base, [base[0], rec("x", True, [1]), base[2]], 5)
    # exact match (--exact_match): the records' `correct`, not their hits; 2 gained, 0 lost
    for r, ok in zip(base, (False, False, True)):
        r["correct"] = ok
    for r, ok in zip(other, (True, True, True)):
        r["correct"] = ok
    c = compare(base, other, EXACT_MATCH)
    assert (c["gained"], c["lost"], c["recall"]) == (2, 0, 1.0) and c["p"] == 0.5
    assert "| exact match |" in table([("base", base), ("other", other)], EXACT_MATCH)
    # the command a section prints: quoted where spaced, without --note's text
    from experiments.tools.paired_retrieval import command_line

    argv = ["--base", "ICT only=a.jsonl", "--note", "some text", "b=b.jsonl", "--note=x"]
    assert command_line("t.py", argv) == 'python t.py --base "ICT only=a.jsonl" b=b.jsonl'


def test_seeds_exact_match_tests_starts_over_seeds_by_hand():
    """experiments/tools/seeds_exact_match.py: Welch's t-test against the closed form of
    Student's t with 4 degrees of freedom, and the per-seed table from hand-counted records."""
    import math

    import pytest

    from experiments.tools.seeds_exact_match import table, welch

    # 1,2,3 against 4,5,6: t = 3 / sqrt(1/3 + 1/3), Welch's df = 4 exactly; for df 4,
    # P(T <= t) = 1/2 + 3/4 x (1 - x^2 / 3) with x = t / sqrt(4 + t^2)
    t, p = welch([1, 2, 3], [4, 5, 6])
    assert t == pytest.approx(3 / math.sqrt(2 / 3))
    x = t / math.sqrt(4 + t * t)
    assert p == pytest.approx(2 * (1 - (0.5 + 0.75 * x * (1 - x * x / 3))))
    assert math.isnan(welch([1.0], [2.0, 3.0])[1]) and math.isnan(welch([1, 1], [2, 2])[1])

    def run(*correct):
        return [{"question": str(i), "correct": c} for i, c in enumerate(correct)]

    # four questions; start A's seeds answer 1 and 2 of them, B's 3 and 4
    a = [run(1, 0, 0, 0), run(1, 1, 0, 0)]
    b = [run(1, 1, 1, 0), run(1, 1, 1, 1)]
    body = table([("A", a), ("B", b)])
    # A: 25, 50 -> mean 37.5, sd 17.7; B: 75, 100; seeds 1 vs 2 of A: 1 gained, 0 lost
    assert "| A | 2 | 25.0, 50.0 | 37.5 (17.7) | - | - | 1 / 0, 1 |" in body
    _, p = welch([25, 50], [75, 100])
    assert f"| B | 2 | 75.0, 100.0 | 87.5 (17.7) | +50.0 | {p:.2g} | 1 / 0, 1 |" in body
    with pytest.raises(ValueError, match="different question counts"):
        table([("A", a), ("B", [run(1, 0, 0)])])


def test_gradient_noise_scale_recovers_a_known_signal_and_noise():
    import numpy as np
    import pytest

    from experiments.gradient_noise.gradient_noise import noise_scale

    # per-example gradients g = mu + noise, noise ~ N(0, sigma^2 I) in d dims: |G|^2 = |mu|^2,
    # tr(S) = d sigma^2, B_noise = d sigma^2 / |mu|^2 = 200 * 4 / 8 = 100
    rng = np.random.default_rng(0)
    d, sigma, b, count = 200, 2.0, 16, 400
    mu = np.full(d, np.sqrt(8.0 / d))
    g = mu + sigma * rng.standard_normal((count, b, d))
    micro = g.mean(axis=1)  # the gradient of each micro-batch of b examples
    mean = micro.mean(axis=0)
    f = noise_scale(float((micro**2).sum(axis=1).mean()), float(mean @ mean), b, b * count)
    assert f["grad_sq"] == pytest.approx(8.0, rel=0.15)
    assert f["trace"] == pytest.approx(d * sigma**2, rel=0.05)
    assert f["noise_scale"] == pytest.approx(100.0, rel=0.2)
    assert f["signal_share_at_16"] == pytest.approx(8 / (8 + 800 / 16), rel=0.15)
    # identical gradients: no noise at all
    same = noise_scale(4.0, 4.0, 16, 512)
    assert same["grad_sq"] == pytest.approx(4.0) and same["trace"] == pytest.approx(0.0)
    assert same["signal_share_at_16"] == pytest.approx(1.0)


def test_gradient_noise_jackknife_error_matches_the_spread_over_repeats():
    import numpy as np
    import pytest

    from experiments.gradient_noise.gradient_noise import jackknife, noise_scale

    d, sigma, b, count = 200, 2.0, 16, 32
    mu = np.full(d, np.sqrt(8.0 / d))
    est, se = [], []
    for seed in range(60):  # 60 repeats of the measurement: the spread of |G|^2 estimates
        rng = np.random.default_rng(seed)
        micro = (mu + sigma * rng.standard_normal((count, b, d))).mean(axis=1)
        micro = micro.astype(np.float32)
        mean = micro.mean(axis=0, dtype=np.float64)
        sq = float((micro.astype(np.float64) ** 2).sum(axis=1).mean())
        est.append(noise_scale(sq, float(mean @ mean), b, b * count)["grad_sq"])
        se.append(jackknife(micro, b)["grad_sq_se"])
    assert np.mean(se) == pytest.approx(np.std(est), rel=0.25)


def test_gpu_reader_pack_round_trips_batches_weights_and_embedders(tmp_path):
    """experiments/minilm_reader_gpu/gpu_minilm_reader.py moves a run between machines: the batches
    come back equal (ids narrowed to uint8/uint16 only where exact, -1 ids kept), bfloat16 bits
    widen to ml_dtypes' own cast, and the returned embedders, unpacked as a checkpoint workdir, are
    what the ICT warm start (model.init_embedders_from_ict) restores."""
    import json

    import ml_dtypes
    import numpy as np
    from flax import linen as nn

    from experiments.minilm_reader_gpu.gpu_minilm_reader import (
        WORD,
        _bf16_bits,
        _flat,
        _from_bf16_bits,
        _load_batches,
        _save_batches,
        main,
    )
    from realm_jax.config import load_config
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.inputs import dummy_input
    from realm_jax.model.realm import RetrieverModel
    from realm_jax.train.warm_start import ict_embedder_params

    rng = np.random.default_rng(0)
    batches = [
        {
            "query_ids": rng.integers(0, 30522, (4, 6)).astype(np.int32),
            "mlm_positions": rng.integers(0, 6, (4, 2)).astype(np.int32),
            "mlm_weights": rng.integers(0, 2, (4, 2)).astype(np.float32),
            "block_id": np.array([3, -1, 70000, 5], np.int32),
            "example_id": np.arange(4, dtype=np.int64),  # host-side only: not stored
        }
        for _ in range(3)
    ]
    _save_batches(str(tmp_path / "b.npz"), batches)
    stored = np.load(tmp_path / "b.npz")
    assert stored["query_ids"].dtype == np.uint16 and stored["mlm_positions"].dtype == np.uint8
    assert stored["block_id"].dtype == np.int32  # -1 and 70000 fit no narrower unsigned type
    back = _load_batches(str(tmp_path / "b.npz"))
    for a, b in zip(batches, back, strict=True):
        assert set(b) == set(a) - {"example_id"}
        for k, v in b.items():
            assert v.dtype == a[k].dtype and np.array_equal(v, a[k])

    w = rng.normal(size=(5, 7)).astype(np.float32)
    want = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(_from_bf16_bits(_bf16_bits(w)), want)

    config = load_config("configs/realm.py:smoke")
    ecfg = ModelConfig.from_config(config.model, "embedder")
    t = dummy_input(8)
    params = nn.meta.unbox(RetrieverModel(ecfg).init(jax.random.key(1), t, t)["params"])
    returned = tmp_path / "returned"
    returned.mkdir()
    names = sorted(params)
    for n in names:
        flat = {k: np.asarray(v) for k, v in _flat(params[n]).items()}
        np.save(returned / f"{n}.word.npy", flat.pop(WORD))
        np.savez(returned / f"{n}.rest.npz", **flat)
    (returned / "metrics.json").write_text(json.dumps({"embedders": names, "steps_done": 7}))
    workdir = str(tmp_path / "wd")
    main(["unpack", "--returned", str(returned), "--workdir", workdir])
    restored = ict_embedder_params(workdir, ecfg)
    assert sorted(restored) == names
    for n in names:
        got, want = _flat(restored[n]), _flat(params[n])
        assert set(got) == set(want)
        for k in want:
            assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), (n, k)


def test_a_world_study_reads_its_finished_arms_from_the_ledger_and_runs_nothing(
    tmp_path, monkeypatch
):
    """experiments/tools/cli_runs.py Ledger (runs/ does not outlive a machine, the ledger is in
    the repository): a record is written whole and read back; trusted_start's world study with
    every arm recorded runs no process and tabulates the records (means over seeds by hand)."""
    from experiments.tools import cli_runs
    from experiments.trusted_start import study

    ledger = cli_runs.Ledger(str(tmp_path / "ledger"))
    assert ledger.get("desc-s0-start") is None
    values = {  # (seed, arm) -> recall@5 at the step read; REALM's history has two steps
        (0, "BM25"): 0.50, (1, "BM25"): 0.70, (0, "start"): 0.20, (1, "start"): 0.30,
        (0, "realm"): 0.40, (1, "realm"): 0.35,
    }  # fmt: skip
    for (seed, arm), v in values.items():
        steps = {"0": 0.1, "400": v} if arm == "realm" else {"0": v}
        at1 = {"0": 0.05, "400": 0.1} if arm == "realm" else steps
        rec = ledger.put(f"desc-s{seed}-{arm}", {"recall@1": at1, "recall@5": steps}, "cmd", 1)
        assert rec["measured"]["recall@5"] == steps and rec["command"] == "cmd"
    assert ledger.get("desc-s1-realm")["measured"]["recall@5"]["400"] == 0.35
    assert not list((tmp_path / "ledger").glob("*.tmp"))

    def refuse(*args, **kwargs):
        raise AssertionError(f"a recorded arm ran: {args}")

    monkeypatch.setattr(study, "LEDGER", ledger.folder)
    monkeypatch.setattr(study, "RESULTS", str(tmp_path / "README.md"))
    monkeypatch.setattr(study, "run", refuse)
    monkeypatch.setattr(study, "measured", refuse)
    root = os.path.relpath(tmp_path / "runs", REPO)
    rc = study.main(["world", "--mention", "described", "--seeds", "0,1", "--arms",
                     "start,realm", "--root", root])  # fmt: skip
    assert rc == 0
    text = (tmp_path / "README.md").read_text()
    assert "| realm | 10.0 (10.0 / 10.0) | 37.5 (40.0 / 35.0) |" in text
    assert "| BM25 | 60.0 (50.0 / 70.0) | 60.0 (50.0 / 70.0) |" in text
    assert "REALM - start, recall@5: +12.5 points (per seed +20.0, +5.0)" in text
