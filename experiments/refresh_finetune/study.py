"""Fine-tuning that refreshes against the frozen index (issue 61, deliverable 6): ORQA
fine-tuning on SQuAD's training articles with the document embedder frozen (ORQA's default)
or trained with the index re-embedded every qa.refresh_every steps (qa.train_doc_embedder,
RAG-end2end's setting), over fine-tuning seeds, scored on the held-out articles' questions.

    python experiments/refresh_finetune/study.py [--root runs/refresh-ft] [--seeds 0,1,2]
        [--arms frozen,refresh] [--refresh_every 100] [--stages finetune,evaluate,report]
    python experiments/refresh_finetune/study.py --smoke   # the chain on the bundled sample

Both arms start from the ICT warm start (ORQA's start; configs/ict.py:squad in runs/squad-ict,
prepared data in runs/squad-data: `prepare --config configs/realm.py:squad --workdir
runs/squad` then `ict --config configs/ict.py:squad --workdir runs/squad-ict`) with bert-tiny's
reader, configs/orqa.py:squad otherwise (1,000 steps of 16 questions, gold_in_beam). Each
fine-tuning is `python -m realm_jax finetune` in ROOT/<arm>-s<seed> (train.seed = seed), then
`evaluate --retriever dense` on the held-out questions (qa.dev_holdout). The report: exact
match, recall@5 and recall@20 per seed, each arm's mean, Welch's t-test over seeds (the seed
is the unit: experiments/tools/seeds_exact_match.py), and the sign test on the questions
pooled over seeds, into experiments/refresh_finetune/README.md. Resumable: a finished run or
evaluation is skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools import cli_runs  # noqa: E402
from experiments.tools.paired_retrieval import hits, load, sign_test  # noqa: E402
from experiments.tools.seeds_exact_match import welch  # noqa: E402

DOC = os.path.join(REPO, "experiments", "refresh_finetune", "README.md")
ARMS = ("frozen", "refresh")
ICT_START = [
    "model.init_from_realm=",
    "model.init_embedders_from_ict=runs/squad-ict",
    "model.init_reader_from=google/bert_uncased_L-2_H-128_A-2",
]


def overrides(arm: str, seed: int, a) -> list[str]:
    over = [] if a.smoke else list(ICT_START)
    over.append(f"train.seed={seed}")
    if arm == "refresh":
        over += ["qa.train_doc_embedder=true", f"qa.refresh_every={a.refresh_every}"]
    if a.steps:
        over.append(f"train.steps={a.steps}")
    return over


def config(a) -> str:
    return "configs/orqa.py:smoke" if a.smoke else "configs/orqa.py:squad"


def finetune(arm: str, seed: int, a) -> None:
    work = os.path.join(a.root, f"{arm}-s{seed}")
    if cli_runs.done(work):
        return
    args = ["finetune", "--config", config(a), "--workdir", work]
    if a.smoke:
        args += ["--config.data.data_dir=runs/refresh-ft-smoke/data"]
    args += [f"--config.{o}" for o in overrides(arm, seed, a)]
    cli_runs.run(args, os.path.join(a.root, "logs", f"{arm}-s{seed}.log"))


def predictions(arm: str, seed: int, a) -> str:
    return os.path.join(a.root, f"{arm}-s{seed}", "eval", "heldout.dense")


def evaluate(arm: str, seed: int, a) -> None:
    out = predictions(arm, seed, a)
    if os.path.exists(out + ".predictions.jsonl"):
        return
    work = os.path.join(a.root, f"{arm}-s{seed}")
    args = ["evaluate", "--workdir", work, "--retriever", "dense", "--output", out]
    cli_runs.run(args, os.path.join(a.root, "logs", f"eval-{arm}-s{seed}.log"))


def scores(records: list[dict]) -> dict[str, list[bool]]:
    return {
        "exact match": [bool(r.get("correct")) for r in records],
        "recall@5": hits(records, 5),
        "recall@20": hits(records, 20),
    }


def collapse(a) -> list[str]:
    """Where the refresh arm's signal goes: per seed and index version, the mean cosine of a
    block's embedding to the mean embedding (1.0: every block in one direction)."""
    import numpy as np

    from realm_jax.index import store

    lines = []
    for s in a.seeds:
        d = os.path.join(a.root, f"refresh-s{s}", "index")
        if not os.path.isdir(d):
            continue
        cells = []
        for v in store.list_versions(d):
            e = np.asarray(store.load_embeddings(os.path.join(d, store.version_name(v))))
            m = e.mean(0)
            cos = (e @ m) / (np.linalg.norm(e, axis=1) * np.linalg.norm(m))
            cells.append(f"step {v}: {cos.mean():.3f}")
        lines.append(f"| {s} | " + ", ".join(cells) + " |")
    if not lines:
        return []
    return [
        "**The refresh arm's index** (mean cosine of a block to the mean block, per version)",
        "",
        "| seed | versions |",
        "|---|---|",
        *lines,
        "",
    ]


def report(a) -> str:
    got = {}
    for arm in a.arms:
        for s in a.seeds:
            path = predictions(arm, s, a) + ".predictions.jsonl"
            if os.path.exists(path):
                got[(arm, s)] = scores(load(path))
    if not got:
        return "Nothing measured yet."
    metrics = ("exact match", "recall@5", "recall@20")
    head = "| arm | " + " | ".join(f"seed {s}" for s in a.seeds) + " | mean |"
    lines = []
    for m in metrics:
        lines += [f"**{m}** (%, held-out questions)", "", head, "|---" * (len(a.seeds) + 2) + "|"]
        for arm in a.arms:
            vals = [100 * statistics.mean(got[(arm, s)][m]) for s in a.seeds if (arm, s) in got]
            cells = [
                f"{100 * statistics.mean(got[(arm, s)][m]):.1f}" if (arm, s) in got else "-"
                for s in a.seeds
            ]
            mean = f"{statistics.mean(vals):.2f}" if vals else "-"
            lines.append(f"| {arm} | " + " | ".join(cells) + f" | {mean} |")
        both = [s for s in a.seeds if ("frozen", s) in got and ("refresh", s) in got]
        if both:
            f0 = [100 * statistics.mean(got[("frozen", s)][m]) for s in both]
            f1 = [100 * statistics.mean(got[("refresh", s)][m]) for s in both]
            t, p = welch(f0, f1)
            gained = sum(
                b and not x
                for s in both
                for x, b in zip(got[("frozen", s)][m], got[("refresh", s)][m])
            )
            lost = sum(
                x and not b
                for s in both
                for x, b in zip(got[("frozen", s)][m], got[("refresh", s)][m])
            )
            lines += [
                "",
                f"refresh - frozen over seeds {both}: "
                f"{statistics.mean(f1) - statistics.mean(f0):+.2f} "
                f"points (Welch t = {t:.2f}, p = {p:.3g}); questions pooled over those seeds: "
                f"{gained} gained, {lost} lost (sign test p = {sign_test(gained, lost):.3g}).",
            ]
        lines.append("")
    if "refresh" in a.arms:
        lines += collapse(a)
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--refresh_every", type=int, default=100)
    p.add_argument("--steps", type=int, default=0, help="train.steps (0: the config's)")
    p.add_argument("--stages", default="finetune,evaluate,report")
    p.add_argument("--smoke", action="store_true", help="the bundled sample, 20 steps")
    a = p.parse_args()
    a.arms = cli_runs.chosen_arms(p, a.arms, ARMS)
    a.seeds = [int(s) for s in a.seeds.split(",") if s]
    if a.smoke:
        a.root = a.root or os.path.join(REPO, "runs", "refresh-ft-smoke")
        a.steps = a.steps or 20
        a.refresh_every = min(a.refresh_every, 10)
        if not os.path.exists(os.path.join(REPO, "runs/refresh-ft-smoke/data/summary.json")):
            cli_runs.run(
                [
                    "prepare",
                    "--config",
                    "configs/orqa.py:smoke",
                    "--workdir",
                    "runs/refresh-ft-smoke",
                ],
                os.path.join(a.root, "logs", "prepare.log"),
            )
    a.root = os.path.abspath(a.root or os.path.join(REPO, "runs", "refresh-ft"))
    stages = a.stages.split(",")
    for seed in a.seeds:
        for arm in a.arms:
            if "finetune" in stages:
                finetune(arm, seed, a)
            if "evaluate" in stages:
                evaluate(arm, seed, a)
    if "report" in stages:
        text = report(a)
        print(text)
        if not a.smoke:
            cmd = "python experiments/refresh_finetune/study.py " + " ".join(sys.argv[1:])
            write_section("Results", f"`{cmd.strip()}`\n\n{text}", doc=DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
