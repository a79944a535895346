"""Prepare throughput on the SQuAD-derived corpus (18,896 passages): NER vs random masking.

    python benchmarks/prepare_throughput.py [--corpus ../shared/data/squad/corpus_train.jsonl]
        [--variant base] [--ner-processes 2]

Writes the "Prepare throughput" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from realm_jax.config import load_config  # noqa: E402
from realm_jax.data import datasets, prepare  # noqa: E402


def run_once(corpus: str, variant: str, masking: str, ner_processes: int) -> dict:
    config = load_config(
        os.path.join(REPO, f"configs/realm.py:{variant}"),
        [f"data.corpus={corpus}", f"data.masking={masking}", f"data.ner_processes={ner_processes}"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        s = prepare.prepare(config, os.path.join(tmp, "data"))
        t0 = time.time()
        ids, _, _ = datasets.load_blocks(os.path.join(tmp, "data"))
        load_s = time.time() - t0
        total = time.time() - start - load_s
    c = s["counts"]
    return {
        "masking": s["masking"],
        "docs": c["documents"],
        "blocks": c["blocks"],
        "sentences": c["sentences"],
        "examples": c["examples"],
        "total_s": total,
        "load_s": load_s,
        "block_len": ids.shape[1],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--corpus",
        default=os.path.join(
            os.path.dirname(REPO), "shared", "data", "squad", "corpus_train.jsonl"
        ),
    )
    p.add_argument("--variant", default="base")
    p.add_argument("--ner-processes", type=int, default=2)
    a = p.parse_args()
    rows = [run_once(a.corpus, a.variant, m, a.ner_processes) for m in ("salient", "random")]
    lines = [
        f"`prepare` on `{os.path.basename(a.corpus)}` (config `{a.variant}`: block_len "
        f"{rows[0]['block_len']}; NER with {a.ner_processes} spaCy process(es), "
        "en_core_web_sm). Total = read + tokenise + sentence split + masking + TFDS "
        "array_record writing; `load_blocks` = reading every block back as a padded int32 "
        "matrix.",
        "",
        "| masking | passages | blocks | sentences | masked examples | total (s) | passages/s "
        "| blocks/s | load_blocks (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['masking']} | {r['docs']} | {r['blocks']} | {r['sentences']} | "
            f"{r['examples']} | {r['total_s']:.1f} | {r['docs'] / r['total_s']:.0f} | "
            f"{r['blocks'] / r['total_s']:.0f} | {r['load_s']:.2f} |"
        )
        print(lines[-1])
    write_section("Prepare throughput", "\n".join(lines))


if __name__ == "__main__":
    main()
