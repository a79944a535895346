"""A second retriever's candidates on SQuAD's paragraphs (issue 46) -> this study's README.md.

    python experiments/second_retriever/squad.py [--root runs/second-retriever] [--arms ...]

Runs, as a user would (`python -m realm_jax ...` from the repository root, ../shared beside
it), into --root: the prepared data (`prepare`, configs/realm.py:squad), the ICT warm start
(`ict`, configs/ict.py:squad), then one run per arm (ARMS), each starting from the same ICT
checkpoint:

  realm      the squad recipe as it was (REALM, dense candidates only)
  bm25       the squad recipe with BM25's top BM25_M blocks joined to each masked sentence's
             candidates (train.bm25_candidates) and the world's lessons: a reading phase of
             READ steps (the embedders frozen, the reader reading the joined candidates), then
             the embedders at a tenth of the LR with their own warmup
  bm25_article  the bm25 arm with a copying curriculum for its first COPY steps: each
             sentence also reads a block of its own article holding the masked span
             (train.article_block_steps), as the world's curriculum reads the fact's document
  bm25_inbatch  the bm25 arm with in-batch negatives for REALM's retriever part
             (train.inbatch_negatives) and the embedders at the reader's LR
  imitation  the BM25-imitation control: the ICT embedders trained contrastively on
             (masked sentence, BM25's top block) pairs (`ict --config.ict.positives=bm25`) for
             as many steps as the bm25 arm trains its embedders; no reader
  bm25_imitation  the bm25 arm with the imitation term beside REALM's loss in the same step
             (train.imitation_weight), the embedders at the imitation control's LR
  bm25_imitation_alone  its control: the same step with REALM's gradient stopped at the
             retriever (train.realm_retriever_grad=False), the term alone training the embedders

Every arm's retriever (and ICT's) is then scored zero-shot on the held-out articles' questions
(configs/orqa.py:squad's dev split: `evaluate --checkpoint initial --retrieval_only`, recall@k
of answer-holding blocks over the whole corpus), densely and as the hybrid (DPR's: dense +
qa.hybrid_bm25_weight x BM25 over the union of both top lists), beside BM25 alone; and each
arm is compared with ICT's start and with the imitation control on the same questions (the
exact sign test on the questions one gains and the other loses: experiments/tools/
paired_retrieval.py); each hybrid is compared with BM25 alone. A finished stage is read, not
rerun (--rerun ARM to redo one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools import paired_retrieval as paired  # noqa: E402
from experiments.tools.cli_runs import chosen_arms, done, run  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
REALM, ICT, ORQA = "configs/realm.py:squad", "configs/ict.py:squad", "configs/orqa.py:squad"
BERT = "../shared/models/bert-tiny-mlm"
BM25_M = 4  # BM25 blocks joined to each masked sentence's dense candidates
STEPS = 400  # REALM steps (the squad recipe's)
READ = 100  # the bm25 arms' reading phase: the embedders frozen
COPY = 50  # the bm25_article arm's copying curriculum (within the reading phase)
ARMS = {
    "realm": [],
    "bm25": [
        f"--config.train.bm25_candidates={BM25_M}",
        f"--config.train.embedders_frozen_steps={READ}",
        "--config.train.embedders_warmup_steps=20",
    ],
    # ... and the world's copying curriculum carried to real text: for the first COPY steps
    # each sentence reads a block of its own article that holds the masked span
    "bm25_article": [
        f"--config.train.bm25_candidates={BM25_M}",
        f"--config.train.article_block_steps={COPY}",
        f"--config.train.embedders_frozen_steps={READ}",
        "--config.train.embedders_warmup_steps=20",
    ],
    # ... and in-batch negatives for REALM's retriever part (train.inbatch_negatives: each
    # prior normalised over the batch's other candidates too), the embedders at the reader's
    # LR (the release's single rate; the imitation control trains them at ICT's full LR)
    "bm25_inbatch": [
        f"--config.train.bm25_candidates={BM25_M}",
        f"--config.train.embedders_frozen_steps={READ}",
        "--config.train.embedders_warmup_steps=20",
        "--config.train.embedder_lr_scale=1",
        "--config.train.inbatch_negatives=True",
    ],
    "imitation": [f"--config.train.steps={STEPS - READ}", "--config.ict.positives=bm25"],
    # REALM's loss plus the imitation term in the same step (train.imitation_weight: BM25's top
    # block the positive of a softmax over the batch's candidates), the bm25 arm's reading
    # phase, the embedders at the imitation control's LR (ICT's 2e-4: 2 x the reader's)
    "bm25_imitation": [
        f"--config.train.bm25_candidates={BM25_M}",
        f"--config.train.embedders_frozen_steps={READ}",
        "--config.train.embedders_warmup_steps=20",
        "--config.train.embedder_lr_scale=2",
        "--config.train.imitation_weight=1.0",
    ],
    # ... its control: the same step, REALM's gradient stopped at the retriever's scores
    # (train.realm_retriever_grad=False): the embedders learn from the imitation term alone
    "bm25_imitation_alone": [
        f"--config.train.bm25_candidates={BM25_M}",
        f"--config.train.embedders_frozen_steps={READ}",
        "--config.train.embedders_warmup_steps=20",
        "--config.train.embedder_lr_scale=2",
        "--config.train.imitation_weight=1.0",
        "--config.train.realm_retriever_grad=False",
    ],
}
KS = (5, 20)


def zeroshot(root: str, arm: str, retriever_dir: str | None, retriever: str) -> str:
    data = os.path.join(root, "data")
    """`evaluate --retrieval_only` of one retriever on the held-out questions: the prefix of
    its predictions and metrics files (dense and hybrid: the warm start's embedders, before
    any fine-tuning; bm25: no model, in a workdir whose index a dense evaluation published)."""
    work = os.path.join(root, "zeroshot", arm)
    out = os.path.join(work, "eval", retriever)
    if not os.path.exists(out + ".metrics.json"):
        args = ["evaluate", "--config", ORQA, "--workdir", work, "--output", out]
        args += ["--retrieval_only", "--retriever", retriever]
        if retriever_dir is not None:
            args += ["--checkpoint", "initial"]
        args += [
            f"--config.data.data_dir={data}",
            "--config.model.init_from_realm=",
            f"--config.model.init_reader_from={BERT}",
            f"--config.model.init_embedders_from_ict={retriever_dir or ''}",
        ]
        run(args, out + ".log")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/second-retriever", help="folder of every run")
    p.add_argument("--arms", default="bm25,imitation", help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--rerun", default="", help="comma list of arms to run again")
    a = p.parse_args(argv)
    arms = chosen_arms(p, a.arms, ARMS)
    root = os.path.join(REPO, a.root) if not os.path.isabs(a.root) else a.root
    data = os.path.join(root, "data")
    paths = [f"--config.data.data_dir={data}"]
    times = {}
    if not os.path.exists(os.path.join(data, "summary.json")):
        times["prepare"] = run(
            ["prepare", "--config", REALM, "--workdir", root, *paths], f"{root}/prepare.log"
        )
    ict = os.path.join(root, "ict")
    if not done(ict):
        times["ict"] = run(["ict", "--config", ICT, "--workdir", ict, *paths], f"{root}/ict.log")
    for arm in arms:
        wd = os.path.join(root, arm)
        if arm in a.rerun.split(",") or not done(wd):
            subprocess.run(["rm", "-rf", wd, os.path.join(root, "zeroshot", arm)], check=True)
            start = [f"--config.model.init_embedders_from_ict={ict}"]
            task = ["ict", "--config", ICT] if arm == "imitation" else ["train", "--config", REALM]
            times[arm] = run([*task, "--workdir", wd, *paths, *start, *ARMS[arm]], f"{wd}.log")
    files = {}
    for arm in ["ict", *arms]:
        wd = os.path.join(root, arm)
        files[arm] = zeroshot(root, arm, wd, "dense")  # (publishes the arm's index first)
        files[f"{arm} hybrid"] = zeroshot(root, arm, wd, "hybrid")
    files["BM25"] = zeroshot(root, "ict", None, "bm25")  # over ICT's published index's blocks
    records = {name: paired.load(f + ".predictions.jsonl") for name, f in files.items()}
    metrics = {name: json.load(open(f + ".metrics.json")) for name, f in files.items()}
    rows = []
    for name, m in metrics.items():
        cells = [f"{100 * m[f'recall@{k}']:.1f}" for k in KS]
        rows.append(f"| {name} | {int(m['questions'])} | " + " | ".join(cells) + " |")
    table = "| retriever | questions | " + " | ".join(f"recall@{k}" for k in KS) + " |\n"
    table += "|---|---|" + "---|" * len(KS) + "\n" + "\n".join(rows)
    pairs = [(arm, "ict") for arm in arms] + [
        (arm, "imitation") for arm in arms if arm != "imitation" and "imitation" in arms
    ]
    pairs += [(f"{arm} hybrid", "BM25") for arm in ["ict", *arms]]
    lines = ["| retriever | against | k | gained | lost | difference | p (sign test) |"]
    lines.append("|---|---|---|---|---|---|---|")
    for arm, base in pairs:
        for k in KS:
            mine, theirs = paired.hits(records[arm], k), paired.hits(records[base], k)
            gained = sum(x and not y for x, y in zip(mine, theirs, strict=True))
            lost = sum(y and not x for x, y in zip(mine, theirs, strict=True))
            diff = 100 * (gained - lost) / len(mine)
            p_value = paired.sign_test(gained, lost)
            lines.append(
                f"| {arm} | {base} | {k} | {gained} | {lost} | {diff:+.1f} | {p_value:.2g} |"
            )
    body = (
        f"`python experiments/second_retriever/squad.py --root {a.root} --arms {a.arms}`: "
        "zero-shot recall@k of answer-holding blocks on the held-out articles' questions "
        f"({ORQA}'s dev split) over the whole corpus; every arm from the same ICT start "
        f"({ICT}); hybrid: dense + qa.hybrid_bm25_weight x BM25 over the union of both top "
        "lists.\n\n" + table + "\n\nPaired on the same questions:\n\n" + "\n".join(lines)
    )
    if times:
        body += "\n\nWall time of the stages run now (s): " + json.dumps(
            {k: round(v) for k, v in times.items()}
        )
    write_section(f"SQuAD: {a.arms}", body, doc=RESULTS)
    print(table)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
