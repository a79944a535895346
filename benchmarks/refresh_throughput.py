"""Refresh job throughput and checkpoint-to-swap latency on the SQuAD corpus (18,896 passages).

    python benchmarks/refresh_throughput.py [--corpus ../shared/data/squad/corpus_train.jsonl]

Prepares the corpus into blocks of 288 wordpieces (cached under runs/bench), then with a
2-layer x 64 (smoke) embedder: embeds every block (blocks/s and FLOPs utilisation against a
matmul peak measured in the same run), and measures the latency from a finished checkpoint
save to the trainer using the new index (refresher thread polling the checkpoints, trainer-side
IndexFeed polling the index, ScaNN searcher built as in production). Writes the "Index
refresh" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

import jax  # noqa: E402

from benchmarks._report import write_section  # noqa: E402
from benchmarks.flops import embedder_flops  # noqa: E402
from benchmarks.train_throughput import matmul_peak  # noqa: E402
from realm_jax import checkpoint, sharding  # noqa: E402
from realm_jax.config import load_config  # noqa: E402
from realm_jax.data import datasets, prepare  # noqa: E402
from realm_jax.index.feed import IndexFeed  # noqa: E402
from realm_jax.index.refresher import Refresher  # noqa: E402
from realm_jax.model.bert import ModelConfig  # noqa: E402
from realm_jax.pretrain import step as pretrain_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--corpus",
        default=os.path.join(REPO, "..", "shared", "data", "squad", "corpus_train.jsonl"),
    )
    ap.add_argument("--workdir", default=os.path.join(REPO, "runs", "bench", "refresh"))
    args = ap.parse_args()
    if not os.path.exists(args.corpus):
        sys.exit(f"corpus not found: {args.corpus}")
    data_dir = os.path.join(REPO, "runs", "bench", "squad_data")
    config = load_config(
        os.path.join(REPO, "configs/realm.py:smoke"),
        [
            f"data.corpus={os.path.abspath(args.corpus)}",
            "data.masking=random",
            "data.block_len=288",
            "data.query_len=96",
            "model.embedder.max_position_embeddings=512",
            "model.reader.max_position_embeddings=512",
            f"data.data_dir={data_dir}",
            "refresh.mode=external",
            "refresh.poll_seconds=0.2",
            "refresh.embed_batch_size=256",
        ],
    )
    prepare.prepare(config, data_dir)
    tokens = datasets.load_blocks(data_dir)[0]
    n = len(tokens)
    print(f"{n} blocks of {tokens.shape[1]} wordpieces")
    import shutil

    shutil.rmtree(args.workdir, ignore_errors=True)
    mesh = sharding.make_mesh(config.mesh)
    model, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    mgr = checkpoint.manager(args.workdir, with_data=False)
    refresher = Refresher(config, args.workdir, tokens)
    feed = IndexFeed(config, args.workdir, mesh, model, tokens)
    stop = threading.Event()

    # Embedding throughput (second call: compiled).
    params = {refresher.name: state.params[refresher.name]}
    refresher.embed(params, refresher.tokens).block_until_ready()
    t0 = time.perf_counter()
    refresher.embed(params, refresher.tokens).block_until_ready()
    embed_s = time.perf_counter() - t0
    peak = matmul_peak()
    flops = embedder_flops(ModelConfig.from_config(config.model, "embedder"), n, tokens.shape[1])

    thread = threading.Thread(target=refresher.run, args=(stop,), daemon=True)
    thread.start()
    latencies = []
    for step in (0, 10, 20):
        checkpoint.save(mgr, step, state)
        mgr.wait_until_finished()
        t0 = time.perf_counter()
        while feed.step != step:
            if feed.emb is None:
                try:
                    feed.start(state.params, 0)
                except TimeoutError:
                    pass
            else:
                feed.maybe_refresh(state.params, step)
            time.sleep(0.05)
        latencies.append(time.perf_counter() - t0)
        print(
            f"checkpoint {step} -> trainer swap: {latencies[-1]:.2f}s "
            f"(swap itself {feed.last_swap_seconds:.2f}s)"
        )
    stop.set()
    thread.join(timeout=60)
    body = (
        f"Device: {jax.devices()[0].device_kind} x {jax.device_count()}; SQuAD corpus "
        f"({n} blocks of <= {tokens.shape[1]} wordpieces); embedder 2 layers x 64 (smoke size), "
        f"{config.refresh.embed_batch_size} blocks per call.\n\n"
        "| measure | value |\n|---|---|\n"
        f"| corpus embedding | {embed_s:.1f} s = {n / embed_s:.0f} blocks/s |\n"
        f"| embedding FLOPs | {flops / 1e12:.2f} TFLOP, {flops / embed_s / 1e9:.1f} GFLOP/s |\n"
        f"| matmul peak (same run) | {peak / 1e9:.1f} GFLOP/s |\n"
        f"| FLOPs utilisation | {100 * flops / embed_s / peak:.0f}% |\n"
        f"| checkpoint saved -> trainer swapped (first refresh) | "
        f"{latencies[0]:.1f} s |\n"
        f"| checkpoint saved -> trainer swapped (next two, mean) | "
        f"{sum(latencies[1:]) / 2:.1f} s |\n"
        f"| of which the trainer's device swap | {feed.last_swap_seconds:.2f} s |\n\n"
        "The latency includes the refresher's poll interval (0.2 s here), the partial restore "
        "of the document embedder, embedding every block, building and serialising the ScaNN "
        "searcher, the atomic publish, and the trainer's verification (SHA-256) and load."
    )
    write_section("Index refresh", body)


if __name__ == "__main__":
    main()
