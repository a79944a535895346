"""A reader on BM25's top blocks: how its span scores and BM25's scores combine -> README.md.

    python experiments/bm25_reader/bm25_reader.py --workdir runs/ablations/read \
        --config configs/orqa.py:squad_read

ORQA picks the best span of all blocks read by span score + the block's retrieval logit. BM25
is not ORQA's retriever, so `evaluate --retriever bm25` adds BM25's score times
`qa.bm25_weight` (0: the span scores alone), an interpolation as in BERTserini. This script
evaluates the reader once on BM25's top `--beam` blocks of the held-out questions (each
record carries every block's own best span, span score and BM25 score), then scores each
weight of a grid from that file: the weight is chosen on the dev questions (`--dev` held-out
ones spread through the file, the set `finetune` picks its best checkpoint on) and reported on
the others, with 95% bootstrap intervals, beside two bounds: BM25's first block alone and an
oracle that picks a block whose span is right whenever one is.

`--retriever dense` scores the same way a reader on the dense retriever's top blocks, the
weight scaling the dense relevance that ORQA adds as it is (weight 1): a check of how well
fine-tuning calibrated the two scores against each other, not a setting of realm-jax.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, ROOT)

from benchmarks._report import write_section  # noqa: E402
from experiments.ablations.ablations import bootstrap  # noqa: E402
from realm_jax.qa import answers as qa_answers  # noqa: E402
from realm_jax.qa import data as qa_data  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")  # this study's
GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
TOP1 = float("inf")  # BM25's first block alone (its own best span)


def evaluate(args) -> str:
    """Run (or reuse, --reuse) `evaluate --retriever bm25` -> the predictions file."""
    out = os.path.join(args.workdir, "eval", f"{args.retriever}-beam{args.beam}-blocks")
    preds = out + ".predictions.jsonl"
    if args.reuse and os.path.exists(preds):
        print(f"reusing {preds}")
        return preds
    cmd = [
        sys.executable, "-m", "realm_jax", "evaluate", "--config", args.config,
        "--workdir", args.workdir, "--retriever", args.retriever, "--output", out,
        f"--config.qa.reader_beam_size={args.beam}", "--config.qa.bm25_weight=0",
        *[f"--config.{o}" for o in args.override],
    ]  # fmt: skip
    print("+", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"evaluated in {time.perf_counter() - t0:.0f} s")
    return preds


def choose(record: dict, weight: float, field: str = "bm25") -> dict:
    """The block a weight picks: best span score + weight x its retrieval score (field: bm25,
    or score for the dense relevance; inf: the retriever's first block)."""
    top = record["top_blocks"]
    if weight == TOP1:
        return top[0]
    return max(top, key=lambda b: b["span_score"] + weight * b[field])


def correct(record: dict, block: dict) -> bool:
    return bool(record["gold"]) and qa_answers.is_correct(record["gold"], block["span"], False)


def cell(values: np.ndarray) -> str:
    lo, hi = bootstrap(values)
    return f"{100 * values.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="the reader's workdir (its latest/best)")
    ap.add_argument("--config", default="configs/orqa.py:squad_read")
    ap.add_argument("--override", action="append", default=[], help="extra config overrides")
    ap.add_argument("--retriever", choices=("bm25", "dense"), default="bm25")
    ap.add_argument("--beam", type=int, default=5, help="blocks read per question")
    ap.add_argument("--dev", type=int, default=500, help="dev questions (spread out)")
    ap.add_argument("--label", default="the reading phase's reader (the suite's `read` stage)")
    ap.add_argument("--reuse", action="store_true", help="reuse an earlier predictions file")
    ap.add_argument("--no-doc", action="store_true", help="print, do not write the README")
    args = ap.parse_args()

    records = [json.loads(line) for line in open(evaluate(args))]
    if len(records) <= args.dev:
        raise SystemExit(f"{len(records)} questions: need more than --dev {args.dev}")
    picks = set(qa_data.spread(args.dev, len(records)))  # finetune's dev questions
    dev = [r for i, r in enumerate(records) if i in picks]
    test = [r for i, r in enumerate(records) if i not in picks]

    field = "bm25" if args.retriever == "bm25" else "score"
    who = "BM25" if args.retriever == "bm25" else "the dense retriever"

    def em(recs, w) -> np.ndarray:
        return np.array([correct(r, choose(r, w, field)) for r in recs], np.float64)

    rows, best_w, best_dev = [], None, -1.0
    for w in GRID + (TOP1,):
        d, t = em(dev, w), em(test, w)
        rows.append((w, d.mean(), t))
        if w != TOP1 and d.mean() > best_dev + 1e-12:  # ties keep the smaller weight
            best_w, best_dev = w, d.mean()
    oracle = np.array([any(correct(r, b) for b in r["top_blocks"]) for r in test], np.float64)
    recall = np.array([any(b["has_answer"] for b in r["top_blocks"]) for r in test], np.float64)
    everything = em(records, best_w)

    def name(w):
        return f"{who}'s first block alone" if w == TOP1 else f"{w:g}"

    lines = [
        "`python experiments/bm25_reader/bm25_reader.py "
        f"--retriever {args.retriever} --workdir {args.workdir} "
        f"--config {args.config}"
        + "".join(f" --override {o}" for o in args.override)
        + f"`: {args.label} on {who}'s top {args.beam} blocks of the {len(records):,} "
        f"held-out SQuAD questions, evaluated once; each weight picks, per question, the block "
        f"whose own best span has the best span score + weight x {who}'s score. The weight is "
        f"chosen on {args.dev} questions spread through the file (dev, the set `finetune` "
        f"picks its checkpoint on) and reported on the other {len(test):,} (test).",
        "",
        f"| {'qa.bm25_weight' if field == 'bm25' else 'weight on the dense relevance'} "
        "| dev EM | test EM [95% CI] |",
        "|---|---|---|",
    ]
    for w, d, t in rows:
        mark = " (chosen)" if w == best_w else ""
        lines.append(f"| {name(w)}{mark} | {100 * d:.1f} | {cell(t)} |")
    lines += [
        f"| oracle: a block with a right span whenever there is one | - | {cell(oracle)} |",
        "",
        f"{who}'s recall@{args.beam} on the test questions: {100 * recall.mean():.1f}%. With the "
        f"chosen weight ({best_w:g}), EM on all {len(records):,} held-out questions: "
        f"{cell(everything)} (the span scores alone: {cell(em(records, 0.0))}"
        + (f"; weight 1, ORQA's: {cell(em(records, 1.0))})." if field == "score" else ")."),
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_doc:
        title = {
            "bm25": "A reader on BM25's blocks: span scores and BM25's scores",
            "dense": "A reader on the dense retriever's blocks: span scores and relevance",
        }[args.retriever]
        write_section(title, body, RESULTS)


if __name__ == "__main__":
    main()
