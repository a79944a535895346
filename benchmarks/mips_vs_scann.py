"""Exact MIPS on device (ops/mips.py, the sharded search the train step runs) against ScaNN's
brute force, ScaNN's tree (partitioning + asymmetric hashing + exact re-scoring) and numpy.

    python benchmarks/mips_vs_scann.py [--sizes 100000 1000000] [--devices 2]

For each corpus size: N x 128 float32 vectors from 256 Gaussian clusters, 64 queries per
batch, k = 10; time per batch (median of --repeats after a warm-up) and recall@10 against
numpy's exact top 10, all in one run. The device search runs on --devices fake CPU devices
(row-sharded index, shard_map local top-k, all-gather, global top-k), as the CPU smoke runs
do. Writes the "Exact MIPS against ScaNN" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

K, BATCH, DIM = 10, 64, 128


def _devices_from_argv() -> int:
    argv = sys.argv
    return int(argv[argv.index("--devices") + 1]) if "--devices" in argv else 2


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
from realm_jax.index import scann as scann_index  # noqa: E402
from realm_jax.ops import mips  # noqa: E402


def timed(fn, repeats: int) -> tuple[object, float]:
    """(first result, median ms of `repeats` calls after one warm-up call)."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return out, float(np.median(times))


def numpy_exact(db, qs):
    s = qs @ db.T
    top = np.argpartition(-s, K, axis=1)[:, :K]
    order = np.argsort(-np.take_along_axis(s, top, 1), axis=1)
    return np.take_along_axis(top, order, 1)


def device_search(db: np.ndarray, n_dev: int):
    """A jitted sharded exact search over db, as the train step runs it."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_dev]).reshape(n_dev, 1), ("data", "model"))
    emb = sharding.put_rows(sharding.pad_rows(db, mesh), mesh)
    tokens = sharding.put_rows(sharding.pad_rows(np.zeros((len(db), 1), np.int32), mesh), mesh)
    none = jnp.full((BATCH,), -1, jnp.int32)
    fn = jax.jit(
        lambda q: mips.search_and_fetch(mesh, q, emb, tokens, none, k=K, num_valid=len(db))[1]
    )

    def run(qs):
        return np.asarray(jax.block_until_ready(fn(jnp.asarray(qs))))

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        db, qs = clustered(n, DIM, BATCH)
        truth, np_ms = timed(lambda db=db, qs=qs: numpy_exact(db, qs), args.repeats)
        rows.append((n, "numpy exact (matmul + argpartition)", 1.0, np_ms, 0.0))
        search = device_search(db, args.devices)
        ids, dev_ms = timed(lambda qs=qs, search=search: search(qs), args.repeats)
        name = f"realm-jax exact on device ({args.devices} CPU devices, shard_map)"
        rows.append((n, name, recall(ids, truth), dev_ms, 0.0))
        for label, kw in (
            ("ScaNN brute force", {"brute_force": True}),
            ("ScaNN tree + AH + reorder 100 (default)", {}),
        ):
            t0 = time.perf_counter()
            searcher = scann_index.build_searcher(db, k=K, **kw)
            build = time.perf_counter() - t0
            (found, _), ms = timed(
                lambda s=searcher, qs=qs: scann_index.search(s, qs, K), args.repeats
            )
            rows.append((n, label, recall(found, truth), ms, build))
        for r in rows[-4:]:
            print(f"{r[0]:>9,} | {r[1]:<55} | recall@10 {r[2]:.3f} | {r[3]:8.1f} ms", flush=True)
    lines = [
        f"`python benchmarks/mips_vs_scann.py --sizes {' '.join(map(str, args.sizes))} --devices "
        f"{args.devices}`: N x {DIM} float32 vectors from 256 Gaussian clusters, one batch of "
        f"{BATCH} queries, k = {K}, median of {args.repeats} timed calls after a warm-up, "
        "recall@10 against numpy's exact top 10. ScaNN searches with `search_batched`.",
        "",
        "| N | method | recall@10 | ms / 64 queries | build (s) | vs ScaNN brute force |",
        "|---|---|---|---|---|---|",
    ]
    for n in args.sizes:
        group = [r for r in rows if r[0] == n]
        brute = next(r for r in group if r[1] == "ScaNN brute force")[3]
        for r in group:
            build = f"{r[4]:.1f}" if r[4] else "-"
            lines.append(
                f"| {n:,} | {r[1]} | {r[2]:.3f} | {r[3]:.1f} | {build} | {brute / r[3]:.2f}x |"
            )
    write_section("Exact MIPS against ScaNN", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
