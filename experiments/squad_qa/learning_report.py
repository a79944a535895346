"""Learning curves of the squad recipe -> this study's README.md (the sections "The recipe",
"ICT warm start: ..." and "REALM pre-training: ...") + learning_curves.png beside it.

Reads the TensorBoard event files the runs wrote (WORKDIR/tb), so the numbers in the README are
the ones the runs logged, never typed by hand:

    python experiments/squad_qa/learning_report.py --ict runs/squad-ict --realm runs/squad
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from realm_jax.train.metrics import read_scalars  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "README.md")  # this study's README: the sections below
RECIPE = "The recipe"
ICT_SECTION = "ICT warm start: recall of a held-out sentence's own block over the whole corpus"
REALM_SECTION = "REALM pre-training: held-out sentences (whole articles never trained on)"


def _table(scalars, tags: list[tuple[str, str]]) -> list[str]:
    steps = sorted(set().union(*(scalars.get(t, {}).keys() for t, _ in tags)))
    lines = ["| step | " + " | ".join(h for _, h in tags) + " |"]
    lines.append("|---" * (len(tags) + 1) + "|")
    for s in steps:
        cells = [f"{scalars[t][s]:.4f}" if s in scalars.get(t, {}) else "" for t, _ in tags]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


ICT_TAGS = [
    ("eval/recall_at_1", "recall@1"),
    ("eval/recall_at_5", "recall@5"),
    ("eval/recall_at_20", "recall@20"),
    ("eval/bm25_recall_at_1", "BM25 recall@1"),
    ("eval/bm25_recall_at_5", "BM25 recall@5"),
    ("eval/bm25_recall_at_20", "BM25 recall@20"),
]
REALM_TAGS = [
    ("eval/retrieval_utility", "retrieval utility"),
    ("eval/accuracy", "accuracy (marginal)"),
    ("eval/null_only_accuracy", "accuracy (null doc only)"),
    ("eval/retrieval_entropy", "retrieval entropy"),
    ("eval/null_doc_prob", "p(null)"),
    ("eval/same_title_fraction", "same title (top-k)"),
    ("eval/same_title_random", "same title (random)"),
]


def plot(ict, realm, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = [
        (axes[0], ict, ["eval/recall_at_5", "eval/bm25_recall_at_5"], "ICT held-out recall@5"),
        (axes[1], realm, ["eval/retrieval_utility"], "REALM held-out retrieval utility"),
        (
            axes[2],
            realm,
            ["eval/accuracy", "eval/null_only_accuracy"],
            "REALM held-out masked accuracy",
        ),
        (
            axes[3],
            realm,
            ["eval/same_title_fraction", "eval/same_title_random", "eval/retrieval_entropy"],
            "REALM retrieval",
        ),
    ]
    for ax, data, tags, title in panels:
        for t in tags:
            if t in data:
                xs = sorted(data[t])
                ax.plot(xs, [data[t][x] for x in xs], marker="o", label=t.removeprefix("eval/"))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ict", required=True, help="the ICT workdir")
    p.add_argument("--realm", required=True, help="the REALM workdir")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=WORKDIR",
        help="another REALM run to tabulate (e.g. share_embedders=true=runs/squad-shared)",
    )
    p.add_argument("--timings", default="", help="a paragraph on wall/CPU time to include")
    args = p.parse_args(argv)
    ict, realm = read_scalars(args.ict), read_scalars(args.realm)
    png = os.path.join(HERE, "learning_curves.png")
    plot(ict, realm, png)
    recipe = [
        "Written by `experiments/squad_qa/learning_report.py` from the runs' TensorBoard events.",
        "The recipe, from the repository root with ../shared beside it:",
        "",
        "```",
        "python -m realm_jax prepare --config configs/realm.py:squad --workdir runs/squad",
        "python -m realm_jax ict     --config configs/ict.py:squad   --workdir runs/squad-ict",
        "python -m realm_jax train   --config configs/realm.py:squad --workdir runs/squad",
        *(
            [
                "# a comparison run: the same train command with another workdir and overrides,",
                "# e.g. --workdir runs/squad-onelr --config.train.embedder_lr_scale=1",
            ]
            if args.compare
            else []
        ),
        "python experiments/squad_qa/learning_report.py --ict "
        + shlex.quote(args.ict)
        + " --realm "
        + shlex.quote(args.realm)
        + "".join(f" --compare {shlex.quote(c)}" for c in args.compare),
        "```",
        "",
    ]
    if args.timings:
        recipe += [args.timings, ""]
    recipe += ["![learning curves](learning_curves.png)"]
    ict_lines = [
        "Each held-out sentence is cut out of its own block in the searched corpus (for both",
        "retrievers), so neither can find the block by the sentence itself.",
        "",
        *_table(ict, ICT_TAGS),
    ]
    realm_lines = [
        "Retrieval is evaluated against an index embedded at the step shown (the in-process",
        "refresh runs before each evaluation). `accuracy` counts masked wordpieces predicted",
        "by the marginal over the 8 candidates; `accuracy (null doc only)` is the same reader",
        "reading only the null document.",
        "",
        *_table(realm, REALM_TAGS),
        "",
    ]
    for item in args.compare:
        label, _, path = item.rpartition("=")
        realm_lines += [
            f"### The same recipe with {label}",
            "",
            *_table(read_scalars(path), REALM_TAGS),
            "",
        ]
    # each its own section of the README (the others, e.g. squad_qa.py's QA results, stay)
    for title, lines in (
        (RECIPE, recipe),
        (ICT_SECTION, ict_lines),
        (REALM_SECTION, realm_lines),
    ):
        body = "\n".join(lines)
        print(f"## {title}\n\n{body}\n")
        write_section(title, body, doc=README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
