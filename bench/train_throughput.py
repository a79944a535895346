"""Train-step throughput and model FLOPs utilisation (MFU) of the REALM step.

    python bench/train_throughput.py [--sizes smoke,small] [--steps 10]

FLOPs are counted from the config (bench/flops.py); the peak is a float32 matmul measured in
the same run on the same device(s), so the ratio is machine-independent. Writes the
"Train step throughput" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "bench"), os.path.join(REPO, "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import write_section  # noqa: E402
from flops import realm_step_flops  # noqa: E402

from realm_jax import sharding, train_step  # noqa: E402
from realm_jax.config_lib import load_config  # noqa: E402

NUM_BLOCKS = 4096


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """Measured float32 matmul FLOP/s on the default device."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def synthetic(config, rng):
    d, t = config.data, config.train
    tokens = np.zeros((NUM_BLOCKS, d.block_len), np.int32)
    tokens[:, 0], tokens[:, 1:-1] = 101, rng.integers(1000, 30000, (NUM_BLOCKS, d.block_len - 2))
    tokens[:, 8], tokens[:, -1] = 102, 102
    emb = rng.normal(size=(NUM_BLOCKS, config.model.proj_size)).astype(np.float32)
    q = np.zeros((t.batch_size, d.query_len), np.int32)
    q[:, 0], q[:, 1:-1], q[:, -1] = (
        101,
        rng.integers(1000, 30000, (t.batch_size, d.query_len - 2)),
        102,
    )
    p = d.max_predictions
    pos = np.tile(np.arange(1, p + 1, dtype=np.int32), (t.batch_size, 1))
    tgt = np.take_along_axis(q, pos, 1)
    q[:, 1 : p + 1] = 103
    batch = dict(
        query_ids=q,
        mlm_positions=pos,
        mlm_targets=tgt,
        mlm_weights=np.ones((t.batch_size, p), np.float32),
        block_id=np.full((t.batch_size,), -1, np.int32),
    )
    return emb, tokens, batch


def measure(variant: str, overrides: list[str], steps: int) -> dict:
    config = load_config(os.path.join(REPO, f"configs/realm.py:{variant}"), overrides)
    mesh = sharding.make_mesh(config.mesh)
    model, opt, state, shard = train_step.create_state(config, mesh, jax.random.key(0))
    emb, tokens, batch = synthetic(config, np.random.default_rng(0))
    e, t = train_step.pad_index(emb, tokens, mesh)
    e, t = sharding.put_rows(e, mesh), sharding.put_rows(t, mesh)
    gb = sharding.global_batch(batch, mesh)
    fn = train_step.compile_train_step(config, mesh, model, opt, shard, NUM_BLOCKS)
    t0 = time.perf_counter()
    state, m = fn(state, gb, e, t, jnp.int32(0))
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = fn(state, gb, e, t, jnp.int32(0))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s, median_s = float(np.min(times)), float(np.median(times))
    flops = realm_step_flops(config, NUM_BLOCKS)
    return {
        "variant": variant,
        "config": config,
        "step_s": step_s,
        "median_s": median_s,
        "compile_s": compile_s,
        "flops": flops,
        "achieved": flops["total"] / step_s,
    }


SMALL = ["train.batch_size=8", "train.num_candidates=4", "data.block_len=128", "data.query_len=48"]
DENSE = ["train.mlm_vocab_chunk=-1"]  # materialised [B, K, P, V] logits: the reference path
SIZES = {
    "smoke": ("smoke", []),
    # The "4-layer, 256-wide" size, at the smoke run's batch and lengths.
    "small": ("small", SMALL),
    "smoke-dense-mlm": ("smoke", DENSE),
    "small-dense-mlm": ("small", SMALL + DENSE),
}


def dropout_masks(reps: int = 15) -> tuple[float, float]:
    """Best seconds for one [32, 4, 175, 175] attention-dropout mask (the 4x256 reader's):
    flax-style Bernoulli (a threefry word per element) and realm_jax's hashed mask."""
    from realm_jax.models import dropout_keep

    shape = (32, 4, 175, 175)
    x = jnp.ones(shape, jnp.float32)
    fns = {
        "bernoulli": lambda k, x: jnp.where(jax.random.bernoulli(k, 0.9, shape), x / 0.9, 0),
        "hashed": lambda k, x: jnp.where(dropout_keep(k, shape, 0.1), x / 0.9, 0),
    }
    best = {}
    for name, fn in fns.items():
        f = jax.jit(fn)
        f(jax.random.key(0), x).block_until_ready()
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            f(jax.random.key(i), x).block_until_ready()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return best["bernoulli"], best["hashed"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="smoke,small,smoke-dense-mlm,small-dense-mlm")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    peak = matmul_peak()
    print(f"matmul peak (float32, 2048^3): {peak / 1e9:.1f} GFLOP/s")
    results, peaks = [], [peak]
    for name in args.sizes.split(","):
        results.append((name, measure(*SIZES[name], args.steps)))
        peaks.append(matmul_peak())
        print(f"{name}: best {results[-1][1]['step_s'] * 1e3:.0f} ms/step")
    p = max(peaks)  # the fastest the machine ran a matmul in this run: the conservative peak
    rows, best = [], {}
    for name, r in results:
        best[name] = r["step_s"]
        c = r["config"]
        f = r["flops"]
        share = {k: v / f["total"] for k, v in f.items() if k != "total"}
        rows.append(
            f"| {name} | {c.model.num_layers}x{c.model.hidden_size} | {c.train.batch_size} | "
            f"{c.train.num_candidates} | {c.data.query_len}/{c.data.block_len} | "
            f"{r['step_s'] * 1e3:.0f} | {r['median_s'] * 1e3:.0f} | "
            f"{c.train.batch_size / r['step_s']:.1f} | "
            f"{f['total'] / 1e9:.1f} | {r['achieved'] / 1e9:.1f} | {p / 1e9:.1f} | "
            f"{100 * r['achieved'] / p:.0f}% | "
            f"{100 * f['total'] / r['median_s'] / p:.0f}% | {r['compile_s']:.0f} |"
        )
        print(rows[-1])
        print("  FLOP share:", {k: f"{v:.0%}" for k, v in share.items()})
    ratios = [
        f"- fused vocab-chunked MLM softmax vs materialised logits, {n}: "
        f"{best[n + '-dense-mlm'] / best[n]:.2f}x faster (best step against best step)"
        for n in ("smoke", "small")
        if n in best and n + "-dense-mlm" in best
    ]
    bern, hashed = dropout_masks()
    ratios.append(
        f"- one [32, 4, 175, 175] attention-dropout mask: threefry Bernoulli {bern * 1e3:.1f} ms, "
        f"hashed mask (models.dropout_keep) {hashed * 1e3:.1f} ms: {bern / hashed:.0f}x faster"
    )
    print("\n".join(ratios))
    body = (
        f"Device: {jax.devices()[0].device_kind} x {jax.device_count()} (JAX {jax.__version__}); "
        f"{args.steps} steps timed one by one after compilation; synthetic batch and a "
        f"{NUM_BLOCKS}-block index. FLOPs counted from the config (bench/flops.py: forward x3 "
        "for everything trained, retrieval scoring x1; the null document at the query's "
        "length, as the reader reads it); peak = the best float32 2048x2048 "
        f"matmul of {len(peaks)} measured in the same run (before and after each size: "
        f"{min(peaks) / 1e9:.0f} to {max(peaks) / 1e9:.0f} GFLOP/s; the machine is shared). "
        "Steps are timed singly: MFU is the best step against that best matmul (like for like), "
        "and the median step is shown too. `-dense-mlm` rows materialise the [B, K, P, vocab] "
        "logits (train.mlm_vocab_chunk=-1) instead of the fused chunked softmax.\n\n"
        "| size | layers x width | batch | K | Lq/Lb | best ms/step | median ms/step | "
        "queries/s | GFLOP/step | GFLOP/s | matmul peak GFLOP/s | MFU | MFU at median | "
        "compile s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nSide by side in the same run:\n\n"
        + "\n".join(ratios)
    )
    write_section("Train step throughput", body)


if __name__ == "__main__":
    main()
