"""The open-domain QA reference result (this study's README.md): SQuAD questions about held-out
Wikipedia articles, answered over the full 18,896-passage corpus.

    python experiments/squad_qa/squad_qa.py            (or: make squad-qa)

Runs every stage that is not done yet, each as its own `python -m realm_jax` process, from
the repository root with ../shared beside it:
  1. prepare    configs/realm.py:squad -> runs/squad-data (articles held out by title hash)
  2. ict        configs/ict.py:squad   -> runs/squad-ict (the embedders' warm start)
  3. train      configs/realm.py:squad -> runs/squad (REALM pre-training, in-process refresh)
  4. finetune   configs/orqa.py:squad  -> runs/squad-qa (ORQA on the other articles' questions)
  5. evaluate   the held-out articles' questions: (a) the fine-tuned retriever and reader,
                (b) BM25's blocks read by the same reader, (c) BM25's retrieval alone
and writes the section "## Open-domain QA" of experiments/squad_qa/README.md with EM, recall@k and
the CPU time of each stage. A stage is reused only when its workdir holds the stamp of a finished
run with the same resolved config, the same code and the same upstream stages
(experiments/tools/stage_stamp.py); otherwise its workdir is moved aside (never deleted) and the
stage runs again, so every figure comes from the code as it stands. --force re-runs every
evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, ROOT)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools import stage_stamp  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")  # this study's
STAGES = [  # (name, command, config, workdir, final step or None)
    ("prepare", "prepare", "configs/realm.py:squad", "runs/squad", None),
    ("ict", "ict", "configs/ict.py:squad", "runs/squad-ict", "ict"),
    ("train", "train", "configs/realm.py:squad", "runs/squad", "realm"),
    ("finetune", "finetune", "configs/orqa.py:squad", "runs/squad-qa", "qa"),
]
EVALS = [  # (label, retriever, extra args)
    ("(a) realm-jax retriever + reader", "dense", []),
    ("(b) BM25 blocks + the same reader", "bm25", []),
    ("(c) BM25 retrieval alone", "bm25", ["--retrieval_only"]),
]


run = stage_stamp.run


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min"


def _data_stamp(config: str) -> str:
    """The prepared data's identity (prepare's own fingerprint of its input and settings)."""
    from realm_jax import workdir as paths
    from realm_jax.config import load_config
    from realm_jax.data import datasets

    cfg = load_config(config, [])
    return datasets.load_summary(paths.data_dir(cfg, os.path.join(ROOT, "runs/squad")))[
        "fingerprint"
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true", help="re-run the evaluations")
    args = p.parse_args()
    timings_path = os.path.join(ROOT, "runs", "squad-qa-timings.json")
    timings = json.load(open(timings_path)) if os.path.exists(timings_path) else {}
    upstream: list[str] = []
    for name, command, config, workdir, final in STAGES:
        work = os.path.join(ROOT, workdir)
        want = None
        if final is not None:  # prepare is idempotent itself (it fingerprints its input)
            want = stage_stamp.stamp(config, [], upstream)
            if not stage_stamp.begin(name, work, want):  # an interrupted run of it resumes
                upstream.append(want)
                continue
        timings[name] = run([command, "--config", config, "--workdir", workdir])
        os.makedirs(os.path.dirname(timings_path), exist_ok=True)
        json.dump(timings, open(timings_path, "w"), indent=2)
        if want is None:
            upstream.append(_data_stamp(config))
        else:
            stage_stamp.write(work, want)
            upstream.append(want)
    results = []
    for label, retriever, extra in EVALS:
        suffix = "-retrieval" if extra else ""
        out = os.path.join(ROOT, "runs", "squad-qa", "eval", f"qa_train.{retriever}{suffix}")
        stamp_path = out + ".stamp"  # the fine-tuning stage it scored
        fresh = os.path.exists(stamp_path) and open(stamp_path).read() == upstream[-1]
        if args.force or not fresh or not os.path.exists(out + ".metrics.json"):
            run(
                ["evaluate", "--config", "configs/orqa.py:squad", "--workdir", "runs/squad-qa"]
                + ["--retriever", retriever, "--output", out, *extra]
            )
            with open(stamp_path, "w") as f:
                f.write(upstream[-1])
        results.append((label, json.load(open(out + ".metrics.json"))))
    made = stage_stamp.made_at(os.path.join(ROOT, "runs", "squad-qa"))
    write_section(*_section(results, timings, made), doc=RESULTS)
    return 0


def _section(results, timings, made: str) -> tuple[str, str]:
    ks = [k for k in results[0][1] if k.startswith("recall@")]
    lines = [
        "SQuAD v1.0 questions about the held-out articles (the titles `prepare` held out by",
        "hash: pre-training and fine-tuning never saw a question about them; pre-training did",
        "read every passage, as REALM reads all of Wikipedia), answered over the full corpus.",
        "Exact match after ORQA's answer normalisation; recall@k: some of the top k blocks",
        "holds an answer's wordpieces. Produced by `python experiments/squad_qa/squad_qa.py`",
        "(`make squad-qa`)",
        f"from stages made at commit {made} (each stage reused only when its config and code",
        "match: experiments/tools/stage_stamp.py).",
        "",
        f"| system | questions | EM | {' | '.join(ks)} | CPU time | wall time |",
        "|---|---|---|" + "---|" * len(ks) + "---|---|",
    ]
    for label, m in results:
        em = f"{m['exact_match']:.4f}" if "exact_match" in m else "-"
        rec = " | ".join(f"{m[k]:.4f}" for k in ks)
        lines.append(
            f"| {label} | {int(m['questions'])} | {em} | {rec} | "
            f"{_minutes(m['cpu_seconds'])} | {_minutes(m['wall_seconds'])} |"
        )
    lines += [
        "",
        "Stages this script ran before the evaluations (CPU time counts both cores; a stage",
        "found done is not re-run or timed: the pre-training stages' times are in the",
        "learning recipe above):",
        "",
        "| stage | CPU time | wall time |",
        "|---|---|---|",
    ]
    for name, t in timings.items():
        if t["wall_seconds"] > 5:  # a no-op (prepare finding its data) is not a stage timing
            lines.append(
                f"| {name} | {_minutes(t['cpu_seconds'])} | {_minutes(t['wall_seconds'])} |"
            )
    return "Open-domain QA on held-out SQuAD articles", "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
