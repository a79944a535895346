"""Paired comparison of retrievers on the same questions -> a study's README (or stdout).

    python experiments/tools/paired_retrieval.py --base "ICT only=P0" "REALM salient=P1" ...
        [--k 5 | --exact_match] [--section TITLE --doc experiments/STUDY/README.md]

Each P is an `evaluate` predictions file (NAME.predictions.jsonl: one record per question,
in the same question order, with its `hits` flags and `top_blocks`), e.g. the ablation
suite's zero-shot evaluations (runs/ablations/zeroshot/ARM/eval/zeroshot.predictions.jsonl).

Two retrievers scored on the same questions differ on few of them: unpaired 95% intervals
of each recall (experiments/ablations/ablations.py's table) overlap long before the difference is
noise. This script counts, for each retriever against the base, the questions it gains (an
answer-holding block in its top k, none in the base's) and loses (the reverse), and the exact
two-sided sign test (McNemar's exact test) on those discordant questions: under "no difference" a
gain and a loss are equally likely. It also counts the distinct blocks in all top-k lists, and the
share of all retrievals taken by the 1% most retrieved blocks: a retriever drawn towards a few hub
blocks retrieves fewer distinct ones. --exact_match compares fine-tuned evaluations' exact match
(each record's `correct`) the same way.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402


def sign_test(gained: int, lost: int) -> float:
    """Exact two-sided p-value of `gained` successes in `gained + lost` fair coin flips
    (the binomial sign test): the probability, under p = 1/2, of an outcome as far from
    the middle as the one seen or further."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    # P(X <= k) for X ~ Binomial(n, 1/2), summed in log space (n can be thousands)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(k + 1)]
    top = max(logs)
    tail = math.exp(top + math.log(sum(math.exp(v - top) for v in logs)) - n * math.log(2))
    return min(1.0, 2 * tail)


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


EXACT_MATCH = 0  # the k that compares exact match (the records' `correct`) instead of recall


def hits(records: list[dict], k: int) -> list[bool]:
    if k == EXACT_MATCH:
        return [bool(r["correct"]) for r in records]
    return [bool(r["hits"][str(k)]) for r in records]


def metric(k: int) -> str:
    return "exact match" if k == EXACT_MATCH else f"recall@{k}"


def listed(records: list[dict], k: int) -> int:
    """How many of the top k blocks the records list (`evaluate` keeps the top 5)."""
    return max((len(r["top_blocks"][:k]) for r in records), default=0)


def spread(records: list[dict], k: int) -> tuple[int, float]:
    """(distinct blocks in the listed top-k, share of retrievals of the 1% most retrieved)."""
    counts = collections.Counter(b["id"] for r in records for b in r["top_blocks"][:k])
    total = sum(counts.values())
    if not total:
        return 0, float("nan")
    top = max(1, len(counts) // 100)
    return len(counts), sum(n for _, n in counts.most_common(top)) / total


def compare(base: list[dict], other: list[dict], k: int) -> dict:
    """Recall@k of both and the paired counts; the records must be the same questions."""
    if len(base) != len(other):
        raise ValueError(f"different question counts: {len(base)} against {len(other)}")
    for i, (a, b) in enumerate(zip(base, other)):
        if a["question"] != b["question"]:
            raise ValueError(f"question {i} differs: {a['question']!r} / {b['question']!r}")
    h0, h1 = hits(base, k), hits(other, k)
    gained = sum(b and not a for a, b in zip(h0, h1))
    lost = sum(a and not b for a, b in zip(h0, h1))
    return {
        "recall": sum(h1) / len(h1),
        "base_recall": sum(h0) / len(h0),
        "gained": gained,
        "lost": lost,
        "p": sign_test(gained, lost),
    }


def table(named: list[tuple[str, list[dict]]], k: int) -> str:
    (base_name, base), rest = named[0], named[1:]
    n = listed(base, k) if k != EXACT_MATCH else listed(base, 5)
    lines = [
        f"| retriever | {metric(k)} | against {base_name}: gained / lost | sign test p "
        f"| distinct blocks in the top {n} | share of the 1% most retrieved |",
        "|---|---|---|---|---|---|",
    ]
    k_top = n if k == EXACT_MATCH else k
    distinct, share = spread(base, k_top)
    lines.append(
        f"| {base_name} | {100 * sum(hits(base, k)) / len(base):.1f} | - | - "
        f"| {distinct:,} | {share:.3f} |"
    )
    for name, records in rest:
        c = compare(base, records, k)
        distinct, share = spread(records, k_top)
        lines.append(
            f"| {name} | {100 * c['recall']:.1f} | {c['gained']} / {c['lost']} "
            f"| {c['p']:.2g} | {distinct:,} | {share:.3f} |"
        )
    return "\n".join(lines)


def command_line(script: str, argv: list[str]) -> str:
    """The command that wrote a section, as a reader would retype it: the arguments quoted
    where they hold a space, without --note (its text is printed above the command)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            kept.append(f'"{a}"' if " " in a else a)
    return " ".join([f"python {script}"] + kept)


def add_section_args(ap: argparse.ArgumentParser, what: str = "table") -> None:
    """--section, --doc and --note: where a tool writes its `what` (a study's README)."""
    ap.add_argument("--section", default="", help=f"write the {what} as this section of --doc")
    ap.add_argument("--doc", default="", help="the study's README.md that --section goes to")
    ap.add_argument("--note", default="", help=f"text written above the {what} in the section")


def named_items(ap: argparse.ArgumentParser, args, form: str) -> list[tuple[str, str]]:
    """[(NAME, VALUE)] from --base and the positional items (each NAME=VALUE, `form` in the
    error), after checking that --section comes with --doc."""
    if args.section and not args.doc:
        ap.error("--section needs --doc (the study's README.md)")
    named = []
    for item in [args.base] + args.others:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            ap.error(f"expected {form}, got {item!r}")
        named.append((name, value))
    return named


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="NAME=PREDICTIONS.jsonl: the reference")
    ap.add_argument("others", nargs="+", help="NAME=PREDICTIONS.jsonl, compared with the base")
    ap.add_argument("--k", type=int, default=5, help="recall@k (a key of the records' hits)")
    ap.add_argument(
        "--exact_match",
        action="store_true",
        help="compare exact match (the records' `correct`: fine-tuned evaluations) instead",
    )
    add_section_args(ap)
    args = ap.parse_args()
    named = []
    for name, path in named_items(ap, args, "NAME=PREDICTIONS.jsonl"):
        if not os.path.exists(path):
            ap.error(f"{name}: no predictions file at {path}")
        named.append((name, load(path)))
    try:
        body = table(named, EXACT_MATCH if args.exact_match else args.k)
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(body)
    if args.section:
        command = command_line("experiments/tools/paired_retrieval.py", sys.argv[1:])
        text = (args.note + "\n\n" if args.note else "") + f"`{command}`\n\n{body}"
        write_section(args.section, text, doc=args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
