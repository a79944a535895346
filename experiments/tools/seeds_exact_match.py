"""Exact match over fine-tuning seeds: starts compared with seeds as the units -> a README.

    python experiments/tools/seeds_exact_match.py --retrievers dense,hybrid \
        --base "ICT alone=runs/orqa-ict/eval/qa_train.{R}.predictions.jsonl,..." \
        "REALM=runs/recipe/qa/eval/qa_train.{R}.predictions.jsonl,..." \
        [--section TITLE --doc experiments/STUDY/README.md]

Each group is one start (a pre-trained model) fine-tuned with several seeds (only
`train.seed` differs); each path is an `evaluate` predictions file of one fine-tuned model, on
the same questions in the same order; `{R}` in a path stands for each of --retrievers.

experiments/tools/paired_retrieval.py's sign test treats the questions as the units: it asks
whether two *models* differ, and two fine-tuning seeds of one start already do (the bm25 arm's
two seeds: 9.7% and 5.0% exact match reading BM25's top 5, sign test p = 8e-36). Whether two
*starts* differ needs the fine-tuning seed as the unit. This script reports each start's exact match
per seed, their mean and standard deviation, the difference of each start's mean from the
base's with Welch's t-test over seeds (two-sided), and, within each start, the sign test
between its two most different seeds: how strongly one question-level test "finds" a
difference that is fine-tuning noise alone.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools.paired_retrieval import (  # noqa: E402
    EXACT_MATCH,
    add_section_args,
    command_line,
    compare,
    load,
    named_items,
)


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of Welch's unequal-variance t-test of mean(b) - mean(a); nan where
    a group has fewer than 2 values or both have no spread."""
    if len(a) < 2 or len(b) < 2:
        return float("nan"), float("nan")
    va, vb = statistics.variance(a), statistics.variance(b)
    se2 = va / len(a) + vb / len(b)
    if se2 == 0:
        return float("nan"), float("nan")
    t = (statistics.fmean(b) - statistics.fmean(a)) / math.sqrt(se2)
    # Welch-Satterthwaite degrees of freedom
    df = se2**2 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
    from scipy import stats  # a dependency of jax

    return t, float(2 * stats.t.sf(abs(t), df))


def exact_match(records: list[dict]) -> float:
    return 100 * sum(bool(r["correct"]) for r in records) / len(records)


def seed_noise(runs: list[list[dict]]) -> dict | None:
    """The pair of seeds of one start with the lowest question-level sign-test p."""
    worst = None
    for a, b in itertools.combinations(runs, 2):
        c = compare(a, b, EXACT_MATCH)
        if worst is None or c["p"] < worst["p"]:
            worst = c
    return worst


def table(groups: list[tuple[str, list[list[dict]]]]) -> str:
    base_name, base_runs = groups[0]
    n = {len(r) for _, runs in groups for r in runs}
    if len(n) != 1:
        raise ValueError(f"the predictions files hold different question counts: {sorted(n)}")
    for _, runs in groups:  # every file against the first: the same questions, in order
        for r in runs:
            compare(base_runs[0], r, EXACT_MATCH)
    base_em = [exact_match(r) for r in base_runs]
    lines = [
        "| start | seeds | exact match % per seed | mean (sd) | against "
        f"{base_name}: mean difference | Welch t-test p | two seeds of this start: "
        "gained / lost, sign test p |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in groups:
        em = [exact_match(r) for r in runs]
        sd = f"{statistics.stdev(em):.1f}" if len(em) > 1 else "-"
        if name == base_name:
            diff, p = "-", "-"
        else:
            _, pv = welch(base_em, em)
            diff = f"{statistics.fmean(em) - statistics.fmean(base_em):+.1f}"
            p = "-" if math.isnan(pv) else f"{pv:.2g}"
        w = seed_noise(runs)
        noise = "-" if w is None else f"{w['gained']} / {w['lost']}, {w['p']:.2g}"
        lines.append(
            f"| {name} | {len(em)} | {', '.join(f'{v:.1f}' for v in em)} "
            f"| {statistics.fmean(em):.1f} ({sd}) | {diff} | {p} | {noise} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="NAME=P1,P2,...: the reference start")
    ap.add_argument("others", nargs="+", help="NAME=P1,P2,...: the other starts")
    ap.add_argument(
        "--retrievers", default="dense", help="comma-separated values of {R} in the paths"
    )
    add_section_args(ap, "tables")
    args = ap.parse_args()
    specs = [(name, paths.split(",")) for name, paths in named_items(ap, args, "NAME=P1,P2,...")]
    bodies = []
    for retriever in args.retrievers.split(","):
        groups = []
        for name, paths in specs:
            runs = []
            for p in paths:
                path = p.replace("{R}", retriever)
                if not os.path.exists(path):
                    ap.error(f"{name}: no predictions file at {path}")
                runs.append(load(path))
            groups.append((name, runs))
        try:
            body = table(groups)
        except (KeyError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        bodies.append(f"Reading the {retriever} retriever's top 5:\n\n{body}")
    text = "\n\n".join(bodies)
    print(text)
    if args.section:
        command = command_line("experiments/tools/seeds_exact_match.py", sys.argv[1:])
        head = (args.note + "\n\n" if args.note else "") + f"`{command}`\n\n"
        write_section(args.section, head + text, doc=args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
