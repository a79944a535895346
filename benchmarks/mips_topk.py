"""The sharded exact search's local top-k (ops/mips.py, issue 58): a running top-k over row
chunks against one matmul over the whole shard, and lax.approx_max_k's recall against exact.

    python benchmarks/mips_topk.py [--n 65536] [--batch 512] [--devices 4] [--chunks 1024 4096]

N x 128 float32 vectors from 256 Gaussian clusters (benchmarks/scann_recall.clustered), one
batch of queries (512: REALM's), k = 10, on --devices fake CPU devices. For each chunk size:
the compiled program's temporary bytes per device (XLA's memory analysis) and the time per
batch as a ratio to the whole-shard search, every variant timed in turn in each round (the
machine is shared, so ratios within a round, then their median). approx_max_k at a few recall
targets: its recall@10 against the exact top 10. Writes the "MIPS local top-k: chunks and
approx_max_k" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

K, DIM = 10, 128
TARGETS = (0.8, 0.9, 0.95, 0.99)


def _devices_from_argv() -> int:
    argv = sys.argv
    return int(argv[argv.index("--devices") + 1]) if "--devices" in argv else 4


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={_devices_from_argv()}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._report import write_section  # noqa: E402
from benchmarks.scann_recall import clustered, recall  # noqa: E402
from realm_jax import sharding  # noqa: E402
from realm_jax.ops import mips  # noqa: E402


def searches(db, n_dev, batch, variants):
    """{name: (jitted ids-only search of q, temp bytes per device)} for each variant's kwargs."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_dev]).reshape(n_dev, 1), ("data", "model"))
    emb = sharding.put_rows(sharding.pad_rows(db, mesh), mesh)
    tokens = sharding.put_rows(sharding.pad_rows(np.zeros((len(db), 1), np.int32), mesh), mesh)
    none = jax.device_put(jnp.full((batch,), -1, jnp.int32), sharding.replicated(mesh))
    q0 = jax.device_put(jnp.zeros((batch, DIM), jnp.float32), sharding.replicated(mesh))
    out = {}
    for name, kw in variants.items():
        search = functools.partial(mips.search_and_fetch, mesh, k=K, num_valid=len(db), **kw)
        fn = jax.jit(lambda q, e, t, x, s=search: s(q, e, t, x)[1])
        compiled = fn.lower(q0, emb, tokens, none).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        out[name] = (
            lambda q, c=compiled: np.asarray(jax.block_until_ready(c(q, emb, tokens, none))),
            temp,
        )
    return out


def timed_rounds(fns, q, rounds):
    """Median over rounds of each variant's time divided by the first's (all run in each
    round), and the first's median ms."""
    for fn in fns.values():
        fn(q)  # warm-up
    names, ratios, base = list(fns), {n: [] for n in fns}, []
    for _ in range(rounds):
        ms = {}
        for n in names:
            t0 = time.perf_counter()
            fns[n](q)
            ms[n] = (time.perf_counter() - t0) * 1000
        base.append(ms[names[0]])
        for n in names:
            ratios[n].append(ms[n] / ms[names[0]])
    return {n: float(np.median(r)) for n, r in ratios.items()}, float(np.median(base))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65_536)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    db, qs = clustered(args.n, DIM, args.batch)
    variants = {"whole shard (chunk 0)": {"chunk": 0}}
    variants.update({f"chunk {c}": {"chunk": c} for c in args.chunks})
    approx = {f"approx_max_k {t}": {"chunk": 0, "recall_target": t} for t in TARGETS}
    fns = searches(db, args.devices, args.batch, {**variants, **approx})
    exact_ids = fns["whole shard (chunk 0)"][0](qs)
    ratios, base_ms = timed_rounds({n: fns[n][0] for n in variants}, qs, args.rounds)
    shard_mib = args.batch * (args.n // args.devices) * 4 / 2**20
    lines = [
        f"`python benchmarks/mips_topk.py --n {args.n} --batch {args.batch} --devices "
        f"{args.devices} --chunks "
        f"{' '.join(map(str, args.chunks))}`: {args.n:,} x {DIM} float32 vectors from 256 "
        f"Gaussian clusters, a batch of {args.batch} queries, k = {K}, {args.devices} fake CPU "
        f"devices ({args.n // args.devices:,} rows each: [B, N / devices] float32 scores are "
        f"{shard_mib:.1f} MiB). Temporary bytes: the compiled program's, per device (XLA memory "
        f"analysis; a chunk of c rows holds [B, c] scores and XLA:CPU's copy of its [c, {DIM}] "
        f"rows). Time: median over {args.rounds} rounds of each call's time over the "
        f"whole-shard call's in the same round (whole shard: {base_ms:.1f} ms median).",
        "",
        "| local search | temp MiB per device | time vs whole shard | ids equal to whole shard |",
        "|---|---|---|---|",
    ]
    for name in variants:
        fn, temp = fns[name]
        same = bool((fn(qs) == exact_ids).all())
        lines.append(f"| {name} | {temp / 2**20:.2f} | {ratios[name]:.2f}x | {same} |")
    lines += ["", "| lax.approx_max_k recall_target | recall@10 against exact |", "|---|---|"]
    for t in TARGETS:
        lines.append(f"| {t} | {recall(fns[f'approx_max_k {t}'][0](qs), exact_ids):.3f} |")
    lines += [
        "",
        f"Platform: {jax.devices()[0].platform}. lax.approx_max_k is approximate (optimised) "
        "on TPU only; on other platforms XLA computes it exactly, which the recall above "
        "shows when measured on a CPU. Its recall on a TPU is not measured here.",
    ]
    body = "\n".join(lines)
    print(body)
    write_section("MIPS local top-k: chunks and approx_max_k", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
