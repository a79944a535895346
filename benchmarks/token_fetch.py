"""On-device token table vs host fetch for the retrieved blocks' tokens (the choice in
realm_jax/ops/mips.py).

    python benchmarks/token_fetch.py [--devices 8] [--blocks 19706] [--batch 64]

(a) one jitted call: shard_map MIPS + gather of the hits' rows from the row-sharded token
    table (psum), the tokens stay on device for the reader;
(b) two steps: jitted MIPS returning ids -> device_get -> numpy gather from a host table ->
    device_put of [B, k, Lb] tokens sharded on 'data', ready for a second jitted call.
Writes the "Retrieved-token fetch" section of docs/benchmarks.md.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=19706)
    ap.add_argument("--block_len", type=int, default=288)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import ml_collections
    import numpy as np

    from benchmarks._report import write_section
    from realm_jax import sharding
    from realm_jax.ops import mips as retrieval

    mesh = sharding.make_mesh(
        ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (-1, 1)})
    )
    rng = np.random.default_rng(0)
    n, lb, b, k = args.blocks, args.block_len, args.batch, args.k
    tokens = rng.integers(1, 30000, (n, lb)).astype(np.int32)
    emb = rng.normal(size=(n, 128)).astype(np.float32)
    e = sharding.put_rows(sharding.pad_rows(emb, mesh), mesh)
    t = sharding.put_rows(sharding.pad_rows(tokens, mesh), mesh)
    q = jax.device_put(rng.normal(size=(b, 128)).astype(np.float32), sharding.replicated(mesh))
    ex = jax.device_put(np.full((b,), -1, np.int32), sharding.replicated(mesh))

    on_device = jax.jit(functools.partial(retrieval.search_and_fetch, mesh, k=k, num_valid=n))
    ids_only = jax.jit(lambda *a: on_device(*a)[1])  # XLA drops the unused token gather
    batch_sharding = sharding.batch_sharding(mesh)

    def host_fetch():
        ids = np.asarray(jax.device_get(ids_only(q, e, t, ex)))
        return jax.device_put(tokens[ids], batch_sharding)  # [B, k, Lb] for the next call

    def timed(fn):
        jax.block_until_ready(fn())
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best = min(best, time.perf_counter() - t0)
        return best

    a = timed(lambda: on_device(q, e, t, ex)[2])
    s = timed(lambda: ids_only(q, e, t, ex))
    h = timed(host_fetch)
    check = np.asarray(on_device(q, e, t, ex)[2])
    assert (check == np.asarray(host_fetch())).all()
    per_dev_mb = sharding.padded_rows(n, mesh) * lb * 4 / mesh.devices.size / 2**20
    body = (
        f"{mesh.devices.size} fake CPU devices, {n} blocks x {lb} token ids (int32), batch {b}, "
        f"top-{k}; best of {args.reps} calls.\n\n"
        "| path | ms per batch |\n|---|---|\n"
        f"| (a) on-device table: search + token gather in one jitted call | {a * 1e3:.2f} |\n"
        f"| search alone (ids) | {s * 1e3:.2f} |\n"
        f"| (b) host fetch: search, device_get ids, numpy gather, device_put | {h * 1e3:.2f} |\n"
        f"\nToken table memory per device: {per_dev_mb:.1f} MiB. Besides the time, (b) needs "
        "the step split into two compiled programs with a host round trip between them, and on "
        "a pod every host would need the whole token table (or a cross-host fetch); (a) keeps "
        "one program and each device holds only its rows."
    )
    print(body)
    write_section("Retrieved-token fetch", body)


if __name__ == "__main__":
    main()
