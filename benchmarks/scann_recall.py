"""ScaNN host-side retrieval: recall@10 and latency vs exact numpy MIPS on clustered vectors.

    python benchmarks/scann_recall.py [--n 100000] [--dim 128] [--queries 640]

Writes the "ScaNN host-side retrieval" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from realm_jax.index import scann as scann_index  # noqa: E402

K, BATCH = 10, 64


def clustered(n: int, d: int, q: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mixture of 256 Gaussian clusters: closer to real embeddings than isotropic noise."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((256, d), dtype=np.float32)
    db = centers[rng.integers(0, 256, n)] + 0.5 * rng.standard_normal((n, d), dtype=np.float32)
    qs = centers[rng.integers(0, 256, q)] + 0.5 * rng.standard_normal((q, d), dtype=np.float32)
    return db, qs


def exact(db: np.ndarray, qs: np.ndarray) -> tuple[np.ndarray, float]:
    """Exact top-k by numpy (matmul + argpartition); returns ids and ms per 64 queries."""
    ids, start = [], time.perf_counter()
    for i in range(0, len(qs), BATCH):
        s = qs[i : i + BATCH] @ db.T
        top = np.argpartition(-s, K, axis=1)[:, :K]
        order = np.argsort(-np.take_along_axis(s, top, 1), axis=1)
        ids.append(np.take_along_axis(top, order, 1))
    ms = (time.perf_counter() - start) * 1000 / (len(qs) / BATCH)
    return np.concatenate(ids), ms


def scann_run(searcher, qs: np.ndarray, **kw) -> tuple[np.ndarray, float]:
    scann_index.search(searcher, qs[:BATCH], K, **kw)  # warm up
    ids, start = [], time.perf_counter()
    for i in range(0, len(qs), BATCH):
        ids.append(scann_index.search(searcher, qs[i : i + BATCH], K, **kw)[0])
    ms = (time.perf_counter() - start) * 1000 / (len(qs) / BATCH)
    return np.concatenate(ids), ms


def recall(ids: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / K for a, b in zip(ids, truth, strict=True)]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=640)
    args = ap.parse_args()
    db, qs = clustered(args.n, args.dim, args.queries)
    truth, exact_ms = exact(db, qs)
    params = scann_index.scann_params(args.n)
    start = time.perf_counter()
    searcher = scann_index.build_searcher(db, k=K)
    build_s = time.perf_counter() - start
    rows = [f"| numpy exact (matmul + argpartition) | - | 1.000 | {exact_ms:.1f} |"]
    for leaves in sorted({params["leaves_to_search"], 2 * params["leaves_to_search"]}):
        ids, ms = scann_run(searcher, qs, leaves_to_search=leaves)
        rows.append(
            f"| ScaNN tree+AH+reorder {params['reorder']} | {leaves} | "
            f"{recall(ids, truth):.3f} | {ms:.1f} |"
        )
        print(rows[-1])
    body = (
        f"`python benchmarks/scann_recall.py --n {args.n}`: {args.n:,} x {args.dim} float32 "
        "vectors "
        f"from 256 Gaussian clusters, {args.queries} queries in batches of {BATCH}, dot product, "
        f"k={K}. Default parameters from `scann_params`: {params['num_leaves']} leaves, "
        f"reorder {params['reorder']}; build took {build_s:.1f} s. Single-threaded search "
        f"(`search_batched`).\n\n"
        "| method | leaves searched | recall@10 | ms / 64 queries |\n|---|---|---|---|\n"
        + "\n".join(rows)
    )
    print(body)
    write_section("ScaNN host-side retrieval", body)


if __name__ == "__main__":
    main()
