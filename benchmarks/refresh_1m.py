"""A 1M-block index on this machine: refreshed by the refresh job as 2 jax.distributed
processes, published, and swapped in by 2 trainer processes -> docs/benchmarks.md.

    python benchmarks/refresh_1m.py --data_dir runs/prepare_scale/1000000/data [--config SPEC]

The corpus is a prepared data dir (benchmarks/prepare_scale.py makes a synthetic 1M-passage one on
Beam's local runner). The document embedder is shrunk to 1 layer x 32 (--embedder) so that
embedding a million blocks takes minutes on 2 CPU cores: what is timed is the job around it
(restore, the parts and their progress file, the gather to process 0, the per-block SHA-256
publish, each trainer host reading and checking only its rows), at the paper's row count
order. `benchmarks/refresh_scale.py` extrapolates the embedding itself from FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402

MICRO = [
    "model.embedder.num_layers=1",
    "model.embedder.hidden_size=32",
    "model.embedder.intermediate_size=128",
    "model.embedder.num_heads=2",
]

SWAP = r"""
import os, sys, time, json
sys.path.insert(0, os.getcwd())
import jax
jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, spec, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from realm_jax import sharding
from realm_jax.config import load_config
from realm_jax.data import datasets
from realm_jax.index.feed import IndexFeed
from realm_jax.model.realm import realm_model
config = load_config(spec, sys.argv[5:])
mesh = sharding.make_mesh(config.mesh)
tokens = datasets.load_blocks(config.data.data_dir)[0]
feed = IndexFeed(config, workdir, mesh, realm_model(config.model), tokens)
t0 = time.time()
feed.start(None, 0)
print("SWAP", json.dumps({"pid": pid, "seconds": time.time() - t0,
      "bytes": feed.last_swap_bytes, "rows": int(tokens.shape[0])}), flush=True)
jax.distributed.shutdown()
"""


def _port() -> int:
    import portpicker

    return portpicker.pick_unused_port()


def _run_two(argv_for, log_prefix: str, timeout: int) -> tuple[list[str], float]:
    """Two processes (argv_for(i)), their outputs and the wall time of the pair."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    t0 = time.time()
    procs = [
        subprocess.Popen(
            argv_for(i),
            cwd=REPO,
            env=env,
            stdout=open(f"{log_prefix}.{i}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    for p in procs:
        p.wait(timeout=timeout)
    wall = time.time() - t0
    outs = [open(f"{log_prefix}.{i}.log").read() for i in range(2)]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"a process failed (exit {p.returncode}):\n{out[-3000:]}")
    return outs, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data_dir", required=True, help="a prepared data dir (benchmarks/prepare_scale.py)"
    )
    ap.add_argument("--config", default="configs/realm.py:smoke")
    ap.add_argument("--workdir", default=os.path.join(REPO, "runs", "refresh_1m"))
    ap.add_argument("--part_blocks", type=int, default=250_000, help="progress_every_blocks")
    ap.add_argument("overrides", nargs="*", help="config overrides the prepared data needs")
    args = ap.parse_args()

    import jax

    from realm_jax import checkpoint, sharding
    from realm_jax.config import load_config
    from realm_jax.data import datasets
    from realm_jax.index import store
    from realm_jax.pretrain import step as pretrain_step

    overrides = [
        f"data.data_dir={os.path.abspath(args.data_dir)}",
        "refresh.build_scann=false",
        f"refresh.progress_every_blocks={args.part_blocks}",
        *MICRO,
        *args.overrides,
    ]
    config = load_config(args.config, overrides)
    summary = datasets.read_summary(config.data.data_dir)
    if not summary:
        sys.exit(f"no prepared data in {config.data.data_dir}")
    n = int(summary["counts"]["blocks"])
    os.makedirs(args.workdir, exist_ok=True)
    if os.listdir(args.workdir):
        sys.exit(f"{args.workdir} is not empty: remove it first (a fresh job is timed)")
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    _, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    mgr = checkpoint.manager(args.workdir, with_data=False)
    checkpoint.save(mgr, 0, state)
    mgr.wait_until_finished()
    del state

    flags = [f"--config.{o}" for o in overrides]
    port = _port()
    log = os.path.join(args.workdir, "refresh")

    def refresh_argv(i):
        return [
            sys.executable, "-m", "realm_jax", "refresh", "--config", args.config,
            "--workdir", args.workdir, "--coordinator", f"127.0.0.1:{port}",
            "--num_processes", "2", "--process_id", str(i), "--cpu_devices", "1",
            "--max_versions", "1", *flags,
        ]  # fmt: skip

    outs, refresh_wall = _run_two(refresh_argv, log, timeout=6 * 3600)
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    m = re.search(
        r"published index 0 \((\d+) blocks, restore ([\d.]+)s, embed ([\d.]+)s = (\d+) "
        r"blocks/s, total ([\d.]+)s\)",
        outs[0],
    )
    if not m:
        sys.exit(f"no 'published index' line in process 0's log:\n{outs[0][-3000:]}")
    blocks, restore, embed, rate, total = int(m[1]), *map(float, m.group(2, 3, 4, 5))
    parts = -(-n // args.part_blocks)  # the refresher's parts (refresh.progress_every_blocks)

    port = _port()

    def swap_argv(i):
        return [
            sys.executable,
            "-c",
            SWAP,
            str(port),
            str(i),
            args.config,
            args.workdir,
            *overrides,
        ]

    souts, swap_wall = _run_two(swap_argv, os.path.join(args.workdir, "swap"), timeout=3600)
    swaps = [json.loads(line.split(" ", 1)[1]) for o in souts for line in o.splitlines()
             if line.startswith("SWAP ")]  # fmt: skip
    swaps.sort(key=lambda s: s["pid"])
    row_bytes = config.model.proj_size * 4
    lines = [
        f"`python benchmarks/refresh_1m.py --data_dir {args.data_dir} --config {args.config} "
        + " ".join(args.overrides)
        + f"` on the {n:,}-block corpus "
        f"prepared by benchmarks/prepare_scale.py; {args.config} with the document embedder shrunk "
        "to 1 layer x 32 (the embedding's own cost at base is benchmarks/refresh_scale.py's); "
        "2 jax.distributed processes of 1 CPU device each, on this 2-core machine.",
        "",
        "| stage | value |",
        "|---|---|",
        f"| refresh job (2 processes): wall, start to exit | {refresh_wall:.0f} s |",
        f"| of which: restore the document embedder | {restore:.1f} s |",
        f"| embed {blocks:,} blocks in {parts} parts (index/progress.json after each), "
        "gather to process 0 | "
        f"{embed:.0f} s = {rate:,.0f} blocks/s |",
        f"| publish (per-block SHA-256, atomic) | {total - restore - embed:.1f} s |",
        f"| peak RSS of one refresh process | {peak_rss / 2**30:.2f} GiB |",
        f"| swap: 2 trainer processes start on it, wall | {swap_wall:.0f} s |",
    ]
    for s in swaps:
        lines.append(
            f"| swap: process {s['pid']} read and verified | {s['bytes'] / 1e6:.0f} MB "
            f"({s['bytes'] // row_bytes:,} rows) in {s['seconds']:.1f} s, IndexFeed.start |"
        )
    lines += [
        "",
        "Each trainer process reads only the whole row blocks (of "
        f"{store.row_block_rows(n):,} rows) that hold its devices' rows, about half the "
        "matrix, and checks each block's SHA-256.",
    ]
    write_section("Refresh and swap of a 1M-block index", "\n".join(lines))


if __name__ == "__main__":
    main()
