"""Preparing the release's block records (ORQA's blocks.tfr + titles.tfr) at two sizes, streamed
(what `prepare` does, data/release_prepare.py) beside the in-memory build it replaced
(release_blocks.release_blocks + local_prepare.build_examples), to show that the streamed
path's peak memory stays flat in the number of blocks while the in-memory one grows with it.

    python benchmarks/prepare_release.py [--sizes 10000,40000]

Inputs, generated here (seeded): block i is 10-14 sentences of 8-20 words drawn from the
WordPiece vocab's whole words (~200-290 wordpieces, near ORQA's 288-wordpiece blocks), titled
"Article <i // 4>"; written as TFRecords by realm_jax's writer (byte-equal to TensorFlow's,
tests/unit/test_block_records.py). Each (size, path) is one fresh process: `streamed` is
`python -m realm_jax prepare --config configs/realm.py:base --config.data.corpus=<blocks.tfr>
--config.data.masking=random`; `in memory` builds the same records in one list in a Python
process (what prepare did before the streamed path; nothing is written). Peak RSS: the largest
RSS of the process (sampled every 0.2 s). Writes the section "Preparing the release's block
records" of docs/benchmarks.md, with the extrapolation to the release's 13,353,718 blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from benchmarks.prepare_scale import _sentence, _words  # noqa: E402
from realm_jax.interop import tfrecord  # noqa: E402

RELEASE_BLOCKS = 13_353_718
IN_MEMORY = """
import collections, sys
sys.path.insert(0, {repo!r})
from realm_jax.config import load_config
from realm_jax.data import local_prepare, release_blocks
cfg = load_config({config!r}, ["data.corpus={corpus}", "data.masking=random"])
stats = collections.Counter()
blocks = release_blocks.release_blocks(cfg.data, stats)
records, held, _ = local_prepare.build_examples(cfg.data, blocks, stats)
print("blocks", len(blocks), "examples", len(records) + len(held))
"""


def make_inputs(n: int, folder: str) -> str:
    rng, words = random.Random(n), _words()
    texts = [" ".join(_sentence(rng, words) for _ in range(rng.randint(10, 14))) for _ in range(n)]
    tfrecord.write_records(
        os.path.join(folder, "titles.tfr"), [f"Article {i // 4}" for i in range(n)]
    )
    corpus = os.path.join(folder, "blocks.tfr")
    tfrecord.write_records(corpus, texts)
    return corpus


def measure(cmd: list[str], log_path: str) -> tuple[float, float]:
    """(wall s, peak RSS GiB) of one process."""
    start, peak = time.time(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}): see {log_path}")
    return time.time() - start, peak / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,40000")
    a = p.parse_args()
    config = os.path.join(REPO, "configs/realm.py:base")
    root = tempfile.mkdtemp(prefix="release-prepare-")
    rows = []
    try:
        for n in [int(x) for x in a.sizes.split(",")]:
            folder = os.path.join(root, f"n{n}")
            os.makedirs(folder)
            corpus = make_inputs(n, folder)
            mib = os.path.getsize(corpus) / 2**20
            work = os.path.join(folder, "work")
            streamed = [
                sys.executable, "-m", "realm_jax", "prepare", "--config", config,
                "--workdir", work, f"--config.data.corpus={corpus}",
                "--config.data.masking=random",
            ]  # fmt: skip
            wall_s, peak_s = measure(streamed, os.path.join(folder, "streamed.log"))
            with open(os.path.join(work, "data", "summary.json")) as f:
                counts = json.load(f)["counts"]
            script = IN_MEMORY.format(repo=REPO, config=config, corpus=corpus)
            wall_m, peak_m = measure(
                [sys.executable, "-c", script], os.path.join(folder, "memory.log")
            )
            row = {
                "n": n,
                "mib": mib,
                "examples": counts["examples"] + counts["eval_examples"],
                "streamed": (wall_s, peak_s),
                "memory": (wall_m, peak_m),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lo, hi = rows[0], rows[-1]
    scale = (hi["n"] - lo["n"]) / (RELEASE_BLOCKS - lo["n"])

    def at_release(key: str) -> float:  # linear in the blocks, through the two sizes
        return lo[key][1] + (hi[key][1] - lo[key][1]) / scale

    def hours(key: str) -> float:
        return hi[key][0] / hi["n"] * RELEASE_BLOCKS / 3600

    lines = [
        "ORQA's block records (`blocks.tfr` + `titles.tfr`, synthetic: 10-14 sentences of 8-20 "
        "vocab words a block, titles shared by 4 blocks) prepared by `prepare` (config `base`, "
        "random masks), which streams them in chunks of `data.release_chunk_blocks` (4,096) "
        "into its own shard writer (realm_jax/data/release_prepare.py, "
        "realm_jax/data/shards.py), beside the "
        "in-memory build it replaced (every block and example in one list, the path of any "
        "other corpus in process; built, not written, so its wall time leaves out the writing "
        "the streamed column includes). One fresh process per cell; peak RSS of that process. "
        f"Command: `python benchmarks/prepare_release.py --sizes {a.sizes}`.",
        "",
        "| blocks | blocks.tfr (MiB) | examples | streamed: wall (s) | streamed: peak RSS (GiB) "
        "| in memory: wall (s) | in memory: peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {r['mib']:.0f} | {r['examples']:,} | {r['streamed'][0]:.0f} | "
            f"{r['streamed'][1]:.2f} | {r['memory'][0]:.0f} | {r['memory'][1]:.2f} |"
        )
    lines += [
        "",
        f"From {lo['n']:,} to {hi['n']:,} blocks the streamed path's peak RSS went "
        f"{lo['streamed'][1]:.2f} -> {hi['streamed'][1]:.2f} GiB and the in-memory build's "
        f"{lo['memory'][1]:.2f} -> {hi['memory'][1]:.2f} GiB. Extrapolated linearly to the "
        f"release's {RELEASE_BLOCKS:,} blocks: streamed {at_release('streamed'):.1f} GiB, "
        f"in memory {at_release('memory'):.0f} GiB; the streamed prepare would take about "
        f"{hours('streamed'):.0f} h on these 2 CPU cores at the larger size's rate (one "
        "process: the tokeniser and the masking are single-threaded Python here).",
    ]
    write_section("Preparing the release's block records", "\n".join(lines))


if __name__ == "__main__":
    main()
