"""Refresh at the paper's scale: one refresh of 13,353,718 blocks at `base`, the trainer's lost
time and the index's staleness in each refresh mode -> docs/benchmarks.md.

    python benchmarks/refresh_scale.py [--mfu 0.5] [--plan_python .venv-plan/bin/python]

What is measured here (this machine): the base document embedder's throughput on CPU (blocks/s
and its share of the CPU's own matmul peak, a sanity check of the FLOP count), and a published
1M-block index published by row ranges as a 2-host job does it (store.publish_rows: one host
writing its half with per-block checksums, and the whole publish on one process), then one of
two hosts reading its half of the rows with per-block checksums: the swap's host-side cost,
bytes counted. A refresh's time below includes its publish: each refresh host writes its share
of the rows at the write rate measured here. What is compiled (`realm-jax plan
--programs refresh` through libtpu in .venv-plan, when present): the refresh program's memory
per device on each slice at 13.35M blocks. What is computed: FLOPs by hand (benchmarks/flops.py,
which test_plan checks against XLA's cost analysis), times at one assumed share of the chips' bf16
peak (--mfu, the same for trainer and refresh job, so the ratios below do not depend on it: only the
minutes do).

The paper (Guu et al. 2020, section 3.4 and appendix): 64 TPUs train (batch 512, BERT-base),
16 TPUs re-embed the corpus asynchronously, the index is refreshed about every 500 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._report import write_section  # noqa: E402
from benchmarks.flops import embedder_flops, realm_step_flops  # noqa: E402
from benchmarks.train_throughput import matmul_peak  # noqa: E402
from realm_jax import sharding  # noqa: E402
from realm_jax.config import load_config  # noqa: E402
from realm_jax.index import store  # noqa: E402
from realm_jax.index.embedding import abstract_params, embed_blocks_fn  # noqa: E402
from realm_jax.model.bert import ModelConfig  # noqa: E402
from realm_jax.model.realm import doc_embedder_name  # noqa: E402
from realm_jax.plan import WIKIPEDIA_BLOCKS  # noqa: E402

# Cloud TPU's published bf16 peak per chip (TFLOP/s) and how a slice name counts chips.
PEAK_TFLOPS = {"v3": 123.0, "v4": 275.0, "v5e": 197.0}
CORES_IN_NAME = {"v3": True, "v4": True, "v5e": False}  # v3-8 / v4-8: 4 chips; v5e-8: 8
HOSTS_PER_CHIPS = {"v3": 4, "v4": 4, "v5e": 4}  # chips per host VM (v5e-8: 2 hosts of 4 here)
TRAINER = "v3-64"  # the paper's 64 TPUs (v3 TensorCores assumed) and the Pod plan's slice
REFRESH_SLICES = ["v3-8", "v4-8", "v5e-8", "v3-32", "v4-32", "v5e-32", "v4-64", "v5e-64"]
PLANNED = ["v3-8", "v4-8", "v5e-8"]  # compiled through libtpu (the three)


def chips(slice_name: str) -> tuple[str, int]:
    family, n = slice_name.split("-")
    n = int(n)
    return family, n // 2 if CORES_IN_NAME[family] else n


def peak(slice_name: str) -> float:
    family, c = chips(slice_name)
    return c * PEAK_TFLOPS[family] * 1e12


def hosts(slice_name: str) -> int:
    family, c = chips(slice_name)
    return max(1, c // HOSTS_PER_CHIPS[family])


def executed_train_flops(config, num_blocks: int) -> float:
    """FLOPs one REALM step executes: benchmarks/flops.py's count (3x forward) plus the forward
    that rematerialisation recomputes for every encoder (model.remat, base's setting)."""
    parts = realm_step_flops(config, num_blocks)
    total = parts["total"]
    if config.model.remat:
        enc = parts["query_embedder"] + parts["doc_embedder"] + parts["reader"]
        total += enc / 3
    return total


def cpu_embedding(blocks: int) -> dict:
    """The base document embedder on this machine's CPU, float32 (bf16 is emulated on CPU):
    blocks/s, FLOP/s against a matmul peak measured in the same run."""
    config = load_config("configs/realm.py:base", ["model.dtype=float32"])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    e = ModelConfig.from_config(config.model, "embedder")
    name = doc_embedder_name(e)
    model, abstract = abstract_params(config, mesh, name)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: jax.device_put((rng.normal(size=s.shape) * 0.02).astype(s.dtype), s.sharding),
        abstract,
    )
    L = config.data.block_len
    tokens = np.zeros((blocks, L), np.int32)
    tokens[:, 0], tokens[:, 1:-1], tokens[:, -1] = (
        101,
        rng.integers(1000, 30000, (blocks, L - 2)),
        102,
    )
    tokens = jax.device_put(tokens, sharding.rows_sharding(mesh))
    fn = embed_blocks_fn(model, mesh, blocks)
    jax.block_until_ready(fn({name: params}, tokens))  # compile
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(fn({name: params}, tokens))
        best = min(best, time.perf_counter() - t0)
    flops = embedder_flops(e, blocks, L)
    return {
        "blocks": blocks,
        "seconds": best,
        "blocks_per_s": blocks / best,
        "flops_per_s": flops / best,
        "matmul_peak": matmul_peak(),
    }


def swap_cost(rows: int, dim: int) -> dict:
    """Publish a rows x dim index by row ranges (store.publish_rows, as the refresh job does:
    one host's half alone, then the whole publish with its commit), then read one of two
    hosts' halves (per-block checksums): seconds and bytes, the host-side costs of a refresh's
    publish and of a swap."""
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((rows, dim), dtype=np.float32)
    half = rows // 2
    block_rows = store.row_block_rows(rows)
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "runs")) as d:
        t0 = time.perf_counter()
        store.write_part(os.path.join(d, "one-host"), half, emb[half:], block_rows)
        write_half = time.perf_counter() - t0
        t0 = time.perf_counter()
        path = store.publish_rows(d, 1, [(0, emb[:half]), (half, emb[half:])], rows, dim)
        publish = time.perf_counter() - t0
        t0 = time.perf_counter()
        got, nbytes = store.load_rows(path, [(0, half)])
        read = time.perf_counter() - t0
        assert np.array_equal(got[(0, half)], emb[:half])
    return {
        "rows": rows,
        "publish_s": publish,
        "write_half_s": write_half,
        "write_bytes": (rows - half) * dim * 4,
        "read_half_s": read,
        "read_bytes": nbytes,
    }


def plan_refresh(plan_python: str, slice_name: str, out_dir: str) -> dict | None:
    """`realm-jax plan --programs refresh` for base at 13.35M blocks on a slice (libtpu)."""
    path = os.path.join(out_dir, f"refresh-{slice_name}.json")
    if not os.path.exists(path):
        cmd = [plan_python, "-m", "realm_jax", "plan", "--config", "configs/realm.py:base"]
        cmd += ["--topology", slice_name, "--programs", "refresh", "--json", path]
        print("$", " ".join(cmd), flush=True)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        subprocess.run(cmd, cwd=REPO, env=env)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mfu", type=float, default=0.5, help="assumed share of bf16 peak")
    ap.add_argument("--cpu_blocks", type=int, default=8, help="blocks embedded on CPU")
    ap.add_argument("--swap_rows", type=int, default=1_000_000)
    ap.add_argument("--plan_python", default=os.path.join(REPO, ".venv-plan", "bin", "python"))
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "refresh_scale"))
    ap.add_argument("--checkpoint_every", type=int, default=100, help="the documented config's")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    config = load_config("configs/realm.py:base")
    N = WIKIPEDIA_BLOCKS
    e = ModelConfig.from_config(config.model, "embedder")
    R = embedder_flops(e, N, config.data.block_len)
    T = executed_train_flops(config, N)
    ratio = R / T  # one refresh in train steps' worth of FLOPs

    cpu = cpu_embedding(args.cpu_blocks)
    swap = swap_cost(args.swap_rows, config.model.proj_size)
    plans = {}
    if os.path.exists(args.plan_python):
        for s in PLANNED:
            plans[s] = plan_refresh(args.plan_python, s, args.out)

    u = args.mfu
    step_s = T / (peak(TRAINER) * u)
    # a swap: each trainer host reads its share of the rows (measured rate here), verified
    read_rate = swap["read_bytes"] / swap["read_half_s"]
    write_rate = swap["write_bytes"] / swap["write_half_s"]

    def publish_s(slice_name: str) -> float:
        """A refresh's publish: each of the slice's hosts writes its share of the rows."""
        return N * config.model.proj_size * 4 / hosts(slice_name) / write_rate

    host_bytes = N * config.model.proj_size * 4 / hosts(TRAINER)
    swap_s = host_bytes / read_rate
    every = int(config.refresh.every)
    check = int(config.refresh.check_every)
    rows = []

    def row(mode, where, refresh_s, interval, max_age, lost, inline=None):
        rows.append((mode, where, refresh_s, interval, max_age, lost, inline))

    # in-process: the whole corpus on the trainer's devices between two steps, every E steps
    refresh_s = R / (peak(TRAINER) * u) + publish_s(TRAINER)  # inprocess keeps each index
    row("inprocess", f"trainer ({TRAINER})", refresh_s, every, every, ratio / (ratio + every))
    # amortized: 1/E of a pass before each step; a row is 1 .. 2E-1 steps old
    row(
        "amortized",
        f"trainer ({TRAINER})",
        refresh_s,
        every,
        2 * every - 1,
        (ratio / every) / (1 + ratio / every),
    )
    e5 = math.ceil(ratio * 0.95 / 0.05)  # per-step share r/E <= 5% of the step+share
    row("amortized, 5% budget", f"trainer ({TRAINER})", refresh_s, e5, 2 * e5 - 1, 0.05)
    # own slice: the refresh job embeds while the trainer runs; the served index was embedded
    # from a checkpoint up to checkpoint_every old when the job started, arrives a refresh
    # later, is looked for every check_every steps and served until the next one arrives.
    # With refresh.background_reads (the default) a host reads its rows beside the steps and
    # the trainer waits only for the device copy; read inline, each swap stalls it for the read.
    goal = None
    read_steps = swap_s / step_s
    for s in REFRESH_SLICES:
        r_s = R / (peak(s) * u) + publish_s(s)
        interval = r_s / step_s
        max_age = args.checkpoint_every + 2 * interval + check + read_steps
        inline = swap_s / (max(interval, check) * step_s + swap_s)
        row("external", f"own slice {s}", r_s, interval, max_age, 0.0, inline)
        if goal is None and max_age <= 500:
            goal = (s, r_s, interval, max_age)

    def fmt_steps(x):
        return f"{x:,.0f}"

    lines = [
        "`python benchmarks/refresh_scale.py` (needs `make plan`'s .venv-plan for the memory "
        "column). base: BERT-base document embedder, 13,353,718 blocks of 288 wordpieces; "
        f"trainer on a {TRAINER} (the paper's 64 TPUs), batch 512, 8 candidates.",
        "",
        "Measured here:",
        f"- the base document embedder on this CPU (float32, {cpu['blocks']} blocks a call): "
        f"{cpu['blocks_per_s']:.2f} blocks/s, {cpu['flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"{cpu['flops_per_s'] / cpu['matmul_peak']:.0%} of this CPU's matmul peak "
        f"({cpu['matmul_peak'] / 1e9:.1f} GFLOP/s): at that rate one refresh would take "
        f"{N / cpu['blocks_per_s'] / 86400:,.0f} days on this machine;",
        f"- a {swap['rows']:,}-row index published by row ranges: one of two hosts writes its "
        f"half in {swap['write_half_s']:.2f} s ({write_rate / 1e6:.0f} MB/s with per-block "
        f"SHA-256), the whole publish on one process {swap['publish_s']:.1f} s; one of two "
        "hosts reading and verifying its half: "
        f"{swap['read_half_s']:.2f} s for {swap['read_bytes'] / 1e6:.0f} MB "
        f"({read_rate / 1e6:.0f} MB/s, local disk).",
        "",
        "Computed (FLOPs by hand, benchmarks/flops.py, checked against XLA's cost analysis in "
        "tests/integration/test_plan.py):",
        f"- one refresh: {R:.3g} FLOP ({R / N / 1e9:.1f} GFLOP a block); one train step as "
        f"executed (3x forward + the rematerialised forward): {T:.3g} FLOP; so one refresh "
        f"costs as much as **{ratio:.0f} train steps**. Every ratio below follows from this "
        "and the slices' peaks, whatever the utilisation, if trainer and refresh job reach "
        "the same share of peak;",
        f"- minutes assume {u:.0%} of bf16 peak (v3 {PEAK_TFLOPS['v3']:.0f}, v4 "
        f"{PEAK_TFLOPS['v4']:.0f}, v5e {PEAK_TFLOPS['v5e']:.0f} TFLOP/s a chip, Cloud TPU's "
        f"published figures): a {TRAINER} step {step_s:.2f} s;",
        f"- a swap in external mode: each of the trainer's {hosts(TRAINER)} hosts reads "
        f"{host_bytes / 1e9:.2f} GB at the rate measured above: {swap_s:.1f} s (from gs:// "
        "the rate is the bucket's, not this disk's);",
        f"- a publish (in every refresh's time below): each refresh host writes its share of "
        f"the {N * config.model.proj_size * 4 / 1e9:.1f} GB at the write rate above, "
        f"{publish_s(TRAINER):.1f} s on the {hosts(TRAINER)} hosts of a {TRAINER}, "
        f"{publish_s(REFRESH_SLICES[0]):.1f} s on a {REFRESH_SLICES[0]}; no device or host holds "
        "the whole matrix to publish it.",
        "",
        "| mode | refresh runs on | one refresh with its publish (min) | "
        "refresh interval (steps) | oldest index row served (steps) | "
        "trainer time lost to refresh | the same with refresh.background_reads=false |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, where, r_s, interval, max_age, lost, inline in rows:
        lost_words = f"{lost:.1%}" if inline is None else "device copy only"
        lines.append(
            f"| {mode} | {where} | {r_s / 60:.1f} | {fmt_steps(interval)} | "
            f"{fmt_steps(max_age)} | {lost_words} | "
            f"{'-' if inline is None else f'{inline:.1%}'} |"
        )
    lines += [
        "",
        "Rows: `inprocess` stops the trainer for a whole pass every refresh.every (500) steps; "
        "`amortized` re-embeds 1/refresh.every of the corpus before each step (index/feed.py), "
        "and `amortized, 5% budget` is the refresh.every that keeps its cost at 5% of a step; "
        "`external` runs the refresh job on its own slice (tpu/refresh_slice.sh), the trainer "
        "only swaps: each host reads its rows beside the training steps "
        "(refresh.background_reads, index/feed.py) and the step that swaps waits for the copy "
        "to its devices alone (0.85 GB a host: not measured on a TPU here); read inline instead, "
        "each swap would stall the trainer for the read measured above (last column). Oldest "
        f"row served in external mode: checkpoint_every ({args.checkpoint_every}) + 2 "
        f"refreshes + check_every ({check}) + the read ({read_steps:.0f}) steps.",
    ]
    if plans:
        lines += [
            "",
            "The refresh program compiled for each slice by libtpu (`realm-jax plan --config "
            "configs/realm.py:base --topology SLICE --programs refresh`), per device:",
            "",
            "| slice | devices | token table shard (GiB) | total (GiB) | of HBM |",
            "|---|---|---|---|---|",
        ]
        for s, fig in plans.items():
            if not fig:
                lines.append(f"| {s} | - | - | - | plan failed |")
                continue
            head, (prog,) = fig["header"], fig["programs"]
            hbm = head["hbm_bytes"]
            total = prog.get("total")
            share = "-" if not (total and hbm) else f"{total / hbm:.0%}"
            lines.append(
                f"| {s} | {head['devices']} | "
                f"{prog['groups']['token table shard'] / 2**30:.2f} | "
                f"{'-' if total is None else f'{total / 2**30:.2f}'} | {share} |"
            )
    lines += [""]
    if goal:
        s, r_s, interval, max_age = goal
        budget = 500 - args.checkpoint_every - check - read_steps
        lines.append(
            f"**The goal (index rows at most 500 steps old, at most 5% of the trainer's time "
            f"lost):** a refresh slice of {s} beside the {TRAINER} trainer "
            f"(`tpu/refresh_slice.sh`), with `--config.train.checkpoint_every="
            f"{args.checkpoint_every}` and the default background reads: a refresh every "
            f"{interval:.0f} steps ({r_s / 60:.1f} min), rows at most {max_age:.0f} steps old, "
            "the trainer losing only the device copy of each swap. The arithmetic: a refresh is "
            f"{ratio:.0f} steps' FLOPs, so rows <= 500 steps old need 2 refreshes <= "
            f"{budget:.0f} steps (500 less checkpoint_every, check_every and the read), i.e. a "
            f"refresh slice with at least {2 * ratio / budget:.2f}x the trainer's peak. The "
            "paper's 16 TPUs against 64 (a quarter of the trainer) refresh about every "
            f"{ratio * 4:,.0f} steps by this count; its 'about every 500 steps' needs the refresh "
            "job to run faster per FLOP than the trainer (forward only, no rematerialisation, "
            "large batches), which this table does not assume."
        )
    else:
        lines.append("No slice in the table meets rows <= 500 steps old at <= 5% lost time.")
    lines.append(
        "In-trainer modes cannot meet both: the amortized refresh at 5% of the step leaves rows "
        f"up to {2 * e5 - 1:,} steps old, and at refresh.every=500 it costs "
        f"{(ratio / every) / (1 + ratio / every):.0%} of the trainer's time."
    )
    write_section("Refresh at the paper's scale", "\n".join(lines))


if __name__ == "__main__":
    main()
