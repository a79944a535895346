"""Train-step throughput and model FLOPs utilisation (MFU) of the REALM step.

    python benchmarks/train_throughput.py [--sizes smoke,small] [--steps 10]

FLOPs are counted from the config (benchmarks/flops.py); the peak is a float32 matmul measured in
the same run on the same device(s), so the ratio is machine-independent. Writes the
"Train step throughput" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks._report import write_section  # noqa: E402
from benchmarks.flops import realm_step_flops  # noqa: E402
from realm_jax import sharding  # noqa: E402
from realm_jax.config import load_config  # noqa: E402
from realm_jax.index import embedding  # noqa: E402
from realm_jax.model import inputs  # noqa: E402
from realm_jax.ops import fused_softmax  # noqa: E402
from realm_jax.pretrain import step as pretrain_step  # noqa: E402

NUM_BLOCKS = 4096


def best_seconds(f, *args, reps: int = 10) -> float:
    """Best wall time of f(*args) over reps calls, after one call to compile."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


_square = jax.jit(lambda x: x @ x)


@functools.cache
def _square_input(n: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """Measured float32 matmul FLOP/s on the default device (best of reps, after a warm-up)."""
    return 2 * n**3 / best_seconds(_square, _square_input(n), reps=reps)


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


def build(variant: str, overrides: list[str]):
    """(config, mesh, model, optimizer, state, state shardings, (emb, tokens, batch))."""
    config = load_config(os.path.join(REPO, f"configs/realm.py:{variant}"), overrides)
    mesh = sharding.make_mesh(config.mesh)
    model, opt, state, shard = pretrain_step.create_state(config, mesh, jax.random.key(0))
    return config, mesh, model, opt, state, shard, synthetic(config, np.random.default_rng(0))


def step_matmuls(fn, *args) -> collections.Counter:
    """Every dot_general that fn(*args) runs, traced from its jaxpr: a count per (lhs shape, rhs
    shape, dtype, dimension numbers), a dot inside a scan counted once per iteration."""
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr, times: int) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                lhs, rhs = (v.aval for v in eqn.invars[:2])
                key = (lhs.shape, rhs.shape, str(lhs.dtype), eqn.params["dimension_numbers"])
                counts[key] += times
                continue
            inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr, inner)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub, inner)

    mesh = getattr(fn, "mesh", None)  # sharding.traced_in_mesh: trace its jitted step in its
    if mesh is None:  # mesh, as its call does (set_mesh cannot be entered inside a trace)
        walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
    else:
        with jax.set_mesh(mesh):
            walk(jax.make_jaxpr(fn.jitted)(*args).jaxpr, 1)
    return counts


def matmuls_alone(counts: collections.Counter) -> dict:
    """Each distinct matmul of the step jitted and timed alone (best of 5), times its count:
    the step's time if everything but its matmuls were free. Batched matmuls (attention's
    [B, heads, L, L] scores and context) and plain ones are totalled apart."""
    out = {"batched": [0.0, 0.0], "plain": [0.0, 0.0]}  # [seconds, FLOPs]
    for (lhs, rhs, dtype, dims), n in counts.items():
        (contract, _), (batch, _) = dims
        a, b = jnp.ones(lhs, dtype), jnp.ones(rhs, dtype)
        f = jax.jit(lambda x, y, dims=dims: jax.lax.dot_general(x, y, dims))
        size = np.prod(jax.eval_shape(f, a, b).shape) * np.prod([lhs[i] for i in contract])
        kind = out["batched" if batch else "plain"]
        kind[0] += n * best_seconds(f, a, b, reps=5)
        kind[1] += n * 2 * float(size)
    return out


ONE_CORE = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.path.insert(0, sys.argv[1])  # the repo root
from benchmarks.train_throughput import core_rates
print(*core_rates())
"""


def core_rates() -> tuple[float, float]:
    """FLOP/s of a 2048^3 matmul and of one batched attention matmul of the 4x256 reader
    ([24 x 4 heads] x [175, 175] @ [175, 64])."""
    probs, v = jnp.ones((24, 4, 175, 175), jnp.float32), jnp.ones((24, 4, 175, 64), jnp.float32)
    t_att = best_seconds(jax.jit(lambda p, v: jnp.einsum("bhqk,bhkd->bhqd", p, v)), probs, v)
    return matmul_peak(), 2 * 24 * 4 * 175 * 175 * 64 / t_att


def core_scaling() -> str:
    """How each matmul kind speeds up from one core to all of them (a subprocess pinned to
    one core against this process), or why it was not measured."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return "- one core against all: not measured (needs Linux and at least 2 cores)"
    one = subprocess.run(
        [sys.executable, "-c", ONE_CORE, REPO],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    one_big, one_att = (float(x) for x in one[-2:])
    big, att = core_rates()
    n = len(os.sched_getaffinity(0))
    return (
        f"- one core against all {n}: 2048^3 matmul {one_big / 1e9:.0f} -> {big / 1e9:.0f} "
        f"GFLOP/s ({big / one_big:.1f}x); batched attention matmul [96 x (175x175 @ 175x64)] "
        f"{one_att / 1e9:.0f} -> {att / 1e9:.0f} GFLOP/s ({att / one_att:.1f}x)"
    )


def measure(variant: str, overrides: list[str], steps: int) -> dict:
    config, mesh, model, opt, state, shard, (emb, tokens, batch) = build(variant, overrides)
    e, t = embedding.pad_index(emb, tokens, mesh)
    e, t = sharding.put_rows(e, mesh), sharding.put_rows(t, mesh)
    gb = sharding.global_batch(batch, mesh)
    fn = pretrain_step.compile_train_step(config, mesh, model, opt, shard, NUM_BLOCKS)
    t0 = time.perf_counter()
    state, m = fn(state, gb, e, t, jnp.int32(0))
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    # Each step is followed by a 2048^3 matmul, so every step has a peak measured moments
    # later on the same (shared, noisy) machine: the paired ratio follows the load.
    times, pair_peaks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = fn(state, gb, e, t, jnp.int32(0))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        # Best of 3 after a warm-up: the first matmul after a long step runs ~30% slow
        # (measured), which alone would make the step look better than it is.
        pair_peaks.append(matmul_peak(reps=3))
    step_s, median_s = float(np.min(times)), float(np.median(times))
    flops = realm_step_flops(config, NUM_BLOCKS)
    paired = [flops["total"] / s / pk for s, pk in zip(times, pair_peaks)]
    alone = matmuls_alone(step_matmuls(fn, state, gb, e, t, jnp.int32(0)))
    return {
        "matmuls": alone,
        "paired_mfu": float(np.median(paired)),
        "pair_peaks": pair_peaks,
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


def parts(variant: str, overrides: list[str], reps: int = 8) -> list[tuple[str, float, float]]:
    """Each part of the step alone, forward + backward, jitted on its own: (name, best
    seconds, FLOPs counted as in benchmarks/flops.py). Shows where a step's time goes without the
    overlap of a profile of the whole step."""
    from realm_jax.model.realm import RealmModel

    config, _, model, opt, state, _, (_, tokens, batch) = build(variant, overrides)
    params = state.params
    t = config.train
    b, k = t.batch_size, t.num_candidates
    q = jnp.asarray(batch["query_ids"])
    blocks = jnp.asarray(tokens[: b * (k - 1)])
    cands = jnp.concatenate([jnp.zeros_like(blocks[:b])[:, None], blocks.reshape(b, k - 1, -1)], 1)
    pos = jnp.asarray(batch["mlm_positions"])
    length = inputs.joint_len(config)

    def grad_of(f):
        return jax.jit(jax.grad(lambda p: (f(p) ** 2).sum()))

    def embed_query(p):  # as pretrain_step.retrieve embeds queries
        return model.apply(
            {"params": p},
            q,
            jnp.zeros_like(q),
            (q != 0).astype(jnp.int32),
            method=RealmModel.embed_query,
        )

    feats = pretrain_step.read_candidates(model, params, q, cands, pos, length)
    vocab_args = (jnp.zeros((b, k)), *feats, jnp.asarray(batch["mlm_targets"]))
    vocab = jax.jit(
        jax.grad(
            lambda r, f, tb, bi, tg: fused_softmax.fused_marginal_loss(
                r, f, tb, bi, tg, jnp.ones(tg.shape), t.mlm_vocab_chunk
            )[0],
            argnums=(0, 1, 2, 3),
        )
    )
    grads = jax.tree.map(lambda x: x * 1e-3, params)
    update = jax.jit(lambda g, s, p: optax.apply_updates(p, opt.update(g, s, p)[0]))
    fl = realm_step_flops(config, NUM_BLOCKS)
    rows = [
        ("query embedder", grad_of(embed_query), (params,), "query_embedder"),
        (
            "document embedder",
            grad_of(lambda p: embedding.embed_block_tokens(model, p, blocks)),
            (params,),
            "doc_embedder",
        ),
        (
            "reader (features at the masked positions)",
            grad_of(lambda p: pretrain_step.read_candidates(model, p, q, cands, pos, length)[0]),
            (params,),
            "reader",
        ),
        ("MLM vocabulary softmax + marginal (fused)", vocab, vocab_args, "mlm_head"),
        ("AdamW update", update, (grads, state.opt_state, params), None),
    ]
    return [
        (name, best_seconds(f, *a, reps=reps), fl[key] if key else 0.0) for name, f, a, key in rows
    ]


def dropout_masks(reps: int = 15) -> tuple[float, float]:
    """Best seconds for one [32, 4, 175, 175] attention-dropout mask (the 4x256 reader's):
    flax-style Bernoulli (a threefry word per element) and realm_jax's hashed mask."""
    from realm_jax.model.layers import dropout_keep

    shape = (32, 4, 175, 175)
    x = jnp.ones(shape, jnp.float32)
    fns = {
        "bernoulli": lambda k, x: jnp.where(jax.random.bernoulli(k, 0.9, shape), x / 0.9, 0),
        "hashed": lambda k, x: jnp.where(dropout_keep(k, shape, 0.1), x / 0.9, 0),
    }
    best = {
        name: best_seconds(jax.jit(fn), jax.random.key(0), x, reps=reps) for name, fn in fns.items()
    }
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
        r = results[-1][1]
        print(
            f"{name}: best {r['step_s'] * 1e3:.0f} ms/step; matmuls after the steps "
            f"{min(r['pair_peaks']) / 1e9:.0f}-{max(r['pair_peaks']) / 1e9:.0f} GFLOP/s "
            f"(median {np.median(r['pair_peaks']) / 1e9:.0f}); dedicated {peaks[-1] / 1e9:.0f}"
        )
    peaks += [x for _, r in results for x in r["pair_peaks"]]
    p = max(peaks)  # the fastest the machine ran a matmul in this run: the conservative peak
    rows, best, ceiling = [], {}, []
    for name, r in results:
        best[name] = r["step_s"]
        c = r["config"]
        f = r["flops"]
        share = {k: v / f["total"] for k, v in f.items() if k != "total"}
        rows.append(
            f"| {name} | {c.model.reader.num_layers}x{c.model.reader.hidden_size} | "
            f"{c.train.batch_size} | "
            f"{c.train.num_candidates} | {c.data.query_len}/{c.data.block_len} | "
            f"{r['step_s'] * 1e3:.0f} | {r['median_s'] * 1e3:.0f} | "
            f"{c.train.batch_size / r['step_s']:.1f} | "
            f"{f['total'] / 1e9:.1f} | {r['achieved'] / 1e9:.1f} | {p / 1e9:.1f} | "
            f"{100 * r['achieved'] / p:.0f}% | "
            f"{100 * f['total'] / r['median_s'] / p:.0f}% | {100 * r['paired_mfu']:.0f}% | "
            f"{r['compile_s']:.0f} |"
        )
        print(rows[-1])
        print("  FLOP share:", {k: f"{v:.0%}" for k, v in share.items()})
        (bt, bf), (pt, pf) = r["matmuls"]["batched"], r["matmuls"]["plain"]
        ceiling.append(
            f"| {name} | {(bf + pf) / 1e9:.1f} | {f['total'] / 1e9:.1f} | "
            f"{(bt + pt) * 1e3:.0f} ({bt * 1e3:.0f} + {pt * 1e3:.0f}) | "
            f"{bf / bt / 1e9:.0f} ({100 * bf / bt / p:.0f}%) | "
            f"{pf / pt / 1e9:.0f} ({100 * pf / pt / p:.0f}%) | "
            f"{100 * f['total'] / (bt + pt) / p:.0f}% | {100 * r['achieved'] / p:.0f}% |"
        )
        print(ceiling[-1])
    ratios = [
        f"- fused vocab-chunked MLM softmax vs materialised logits, {n}: "
        f"{best[n + '-dense-mlm'] / best[n]:.2f}x faster (best step against best step)"
        for n in ("smoke", "small")
        if n in best and n + "-dense-mlm" in best
    ]
    ratios.append(core_scaling())
    bern, hashed = dropout_masks()
    ratios.append(
        f"- one [32, 4, 175, 175] attention-dropout mask: threefry Bernoulli {bern * 1e3:.1f} ms, "
        f"hashed mask (model.layers.dropout_keep) {hashed * 1e3:.1f} ms: "
        f"{bern / hashed:.0f}x faster"
    )
    print("\n".join(ratios))
    breakdown = []
    for name in ("smoke", "small"):
        if name not in best:
            continue
        got = parts(*SIZES[name])
        breakdown.append(
            f"\n\n{name} ({best[name] * 1e3:.0f} ms per whole step above): each part alone, "
            "forward + backward, no dropout\n\n"
            "| part | ms | GFLOP | GFLOP/s | of the matmul peak |\n|---|---|---|---|---|"
        )
        for part, sec, flops in got:
            rate = f"{flops / sec / 1e9:.1f} | {100 * flops / sec / p:.0f}%" if flops else "- | -"
            breakdown.append(f"| {part} | {sec * 1e3:.1f} | {flops / 1e9:.2f} | {rate} |")
        breakdown.append(f"| sum of the parts | {sum(g[1] for g in got) * 1e3:.1f} | | | |")
        print("\n".join(breakdown[-len(got) - 2 :]))
    body = (
        f"Device: {jax.devices()[0].device_kind} x {jax.device_count()} (JAX {jax.__version__}); "
        f"{args.steps} steps timed one by one after compilation; synthetic batch and a "
        f"{NUM_BLOCKS}-block index. FLOPs counted from the config (benchmarks/flops.py: forward x3 "
        "for everything trained, retrieval scoring x1; the null document at the query's "
        "length, as the reader reads it); peak = the best float32 2048x2048 "
        f"matmul of {len(peaks)} measured in the same run (best of 10 before and after each "
        "size, and a best of 3 after every timed step: "
        f"{min(peaks) / 1e9:.0f} to {max(peaks) / 1e9:.0f} GFLOP/s; the machine is shared). "
        "Steps are timed singly: MFU is the best step against that best matmul (like for like), "
        "and the median step is shown too. Paired MFU: every step is followed by a 2048^3 "
        "matmul (a warm-up, then best of 3), each step's FLOP/s is divided by that matmul's, "
        "and the median of those ratios is shown (it follows the machine's load as it "
        "changes). `-dense-mlm` rows materialise the [B, K, P, vocab] "
        "logits (train.mlm_vocab_chunk=-1) instead of the fused chunked softmax.\n\n"
        "| size | layers x width | batch | K | Lq/Lb | best ms/step | median ms/step | "
        "queries/s | GFLOP/step | GFLOP/s | matmul peak GFLOP/s | MFU | MFU at median | "
        "paired MFU (median) | compile s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nThe step's matrix multiplies alone: every dot_general in the traced step, each "
        "jitted and timed on its own (best of 5) and counted as often as the step runs it. Their "
        "total is the step's time if everything else (softmax, LayerNorm, GELU, dropout, "
        "gathers, the optimizer) were free and nothing overlapped, so counted FLOPs over that "
        "time estimates the most MFU XLA's matmul kernels allow at this size. Batched = "
        "attention's per-head matmuls; "
        "plain = everything else. Matmul FLOPs run exceed the counted ones by what the "
        "step recomputes (the fused softmax forms the vocabulary logits twice).\n\n"
        "| size | matmul GFLOP run | model GFLOP counted | matmuls alone ms (batched + "
        "plain) | batched GFLOP/s | plain GFLOP/s | MFU ceiling | MFU measured |\n"
        "|---|---|---|---|---|---|---|---|\n"
        + "\n".join(ceiling)
        + "\n\nSide by side in the same run:\n\n"
        + "\n".join(ratios)
        + "\n\nWhere a step's time goes, from the same run:"
        + "\n".join(breakdown)
    )
    write_section("Train step throughput", body)


if __name__ == "__main__":
    main()
