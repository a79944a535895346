"""The benchmarks' own arithmetic against hand counts: the matmul census
(benchmarks/train_throughput.step_matmuls) and the peer benchmark's summary. The studies'
tools are tested in tests/experiments/test_study_tools.py."""

import jax
import jax.numpy as jnp

from benchmarks.train_throughput import matmuls_alone, step_matmuls


def test_step_matmuls_counts_scans_nested_jits_and_batched_dots():
    w = jnp.ones((4, 4))
    q = jnp.ones((2, 3, 5, 4))

    @jax.jit
    def inner(h):
        return h @ w

    def f(h, q):
        h, _ = jax.lax.scan(lambda c, _: (inner(c), None), h, None, length=5)
        return h.sum() + jnp.einsum("bhqd,bhkd->bhqk", q, q).sum()

    counts = step_matmuls(jax.jit(f), jnp.ones((6, 4)), q)
    plain = (((1,), (0,)), ((), ()))
    batched = (((3,), (3,)), ((0, 1), (0, 1)))
    assert counts == {
        ((6, 4), (4, 4), "float32", plain): 5,
        ((2, 3, 5, 4), (2, 3, 5, 4), "float32", batched): 1,
    }
    alone = matmuls_alone(counts)
    assert alone["plain"][1] == 5 * 2 * 6 * 4 * 4  # FLOPs: 2 * M * N * K per dot
    assert alone["batched"][1] == 2 * (2 * 3 * 5 * 5) * 4
    assert alone["plain"][0] > 0 and alone["batched"][0] > 0


def test_peer_summary_ratios_and_section_from_hand_figures():
    """benchmarks/peer_hf_realm's summary: per-round throughput from each process's median timed
    call, medians and ranges over rounds, ratios realm-jax / HF (speed) and HF / realm-jax
    (memory); checked against figures worked out by hand."""
    from benchmarks.peer_hf_realm import report_body, summarise

    def res(times, rss, warm=1.0):
        return {"times": times, "peak_rss_gb": rss, "warmup_s": warm}

    runs = {  # batch 8: 8 / 2.0 = 4 ex/s, 8 / 2.5 = 3.2; HF 8 / 10 = 0.8, 8 / 16 = 0.5
        ("jax", "train"): [res([2.0, 9.0, 1.0], 5.0), res([2.5, 2.5, 2.5], 4.0)],
        ("hf", "train"): [res([10.0], 15.0), res([16.0], 14.0)],
        ("jax", "embed"): [res([4.0], 1.0)],  # 256 blocks: 64 blocks/s
        ("hf", "embed"): [res([8.0], 0.5)],  # 32 blocks/s
        ("jax-remat-dots", "train"): [res([4.0], 2.0), res([4.0], 2.0)],  # 2 ex/s
    }
    s = summarise(runs, batch=8, embed_blocks=256)
    assert s[("jax", "train")]["rate"] == {"median": 3.6, "min": 3.2, "max": 4.0}
    assert s[("hf", "train")]["rate"] == {"median": 0.65, "min": 0.5, "max": 0.8}
    r = s[("ratio", "train")]
    assert abs(r["speed"] - 3.6 / 0.65) < 1e-12
    assert r["speed_pairs"]["min"] == 4.0 / 0.8 and r["speed_pairs"]["max"] == 3.2 / 0.5
    assert r["memory"] == 14.5 / 4.5
    assert r["memory_pairs"]["min"] == 15.0 / 5.0 and r["memory_pairs"]["max"] == 14.0 / 4.0
    assert s[("ratio", "embed")]["speed"] == 2.0 and s[("ratio", "embed")]["memory"] == 0.5
    meta = dict(
        command="python benchmarks/peer_hf_realm.py",
        rounds=2,
        steps=3,
        embed_reps=1,
        threads=2,
        batch=8,
        versions={"jax": "J", "flax": "F", "torch": "T", "transformers": "X"},
        load=(0.5, 1.5),
    )
    body = report_body(s, meta)
    assert "| training step: examples/s | 3.60 (3.20-4.00) | 0.65 (0.50-0.80) | 5.54x" in body
    embed = "| document embedding: blocks/s | 64.00 (64.00-64.00) | 32.00 (32.00-32.00) | 2.00x"
    assert embed in body
    # 2 / 0.65 = 3.08x; rounds 2 / 0.8 = 2.50 and 2 / 0.5 = 4.00; memory 14.5 / 2 = 7.25x
    dots = "| training step with model.remat (dots): examples/s | 2.00 (2.00-2.00) | 0.65"
    assert dots + " (0.50-0.80) | 3.08x (rounds 2.50-4.00) |" in body
    assert "| training step with model.remat (dots): peak RSS GB | 2.00 (2.00-2.00)" in body
    assert "| 7.25x (rounds 7.00-7.50) |" in body
    assert "model.remat (nothing)" not in body  # no such side was run
    assert "torch T, transformers X" in body and "JAX J" in body
    assert "load average 0.5 at the start and 1.5 at the end" in body
