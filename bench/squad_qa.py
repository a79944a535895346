"""The open-domain QA reference result (docs/results.md): SQuAD questions about held-out
Wikipedia articles, answered over the full 18,896-passage corpus.

    python bench/squad_qa.py            (or: make squad-qa)

Runs every stage that is not done yet, each as its own `python -m realm_jax` process, from
the repository root with ../shared beside it:
  1. prepare    configs/realm.py:squad -> runs/squad-data (articles held out by title hash)
  2. ict        configs/ict.py:squad   -> runs/squad-ict (the embedders' warm start)
  3. train      configs/realm.py:squad -> runs/squad (REALM pre-training, in-process refresh)
  4. finetune   configs/orqa.py:squad  -> runs/squad-qa (ORQA on the other articles' questions)
  5. evaluate   the held-out articles' questions: (a) the fine-tuned retriever and reader,
                (b) BM25's blocks read by the same reader, (c) BM25's retrieval alone
and writes the section "## Open-domain QA" of docs/results.md with EM, recall@k and the CPU
time of each stage. A stage counts as done when its workdir holds its final checkpoint (and
for evaluate, when its metrics file exists), so an interrupted run picks up where it stopped;
--force re-runs every evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench._report import write_section  # noqa: E402

RESULTS = os.path.join(ROOT, "docs", "results.md")
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


def _final_step(config: str) -> int:
    sys.path.insert(0, ROOT)
    from realm_jax.config import load_config

    return int(load_config(config, []).train.steps)


def _done(workdir: str, config: str) -> bool:
    ckpt = os.path.join(ROOT, workdir, "checkpoints", str(_final_step(config)))
    return os.path.isdir(ckpt)


def run(args: list[str]) -> dict:
    """Run `python -m realm_jax ARGS`; returns its wall and CPU seconds (children's rusage)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    print("+ python -m realm_jax " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "realm_jax", *args], cwd=ROOT, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_seconds": time.perf_counter() - t0, "cpu_seconds": cpu}


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true", help="re-run the evaluations")
    args = p.parse_args()
    timings_path = os.path.join(ROOT, "runs", "squad-qa-timings.json")
    timings = json.load(open(timings_path)) if os.path.exists(timings_path) else {}
    for name, command, config, workdir, final in STAGES:
        if final is not None and _done(workdir, config):
            print(f"{name}: done already ({workdir})")
            continue
        timings[name] = run([command, "--config", config, "--workdir", workdir])
        os.makedirs(os.path.dirname(timings_path), exist_ok=True)
        json.dump(timings, open(timings_path, "w"), indent=2)
    results = []
    for label, retriever, extra in EVALS:
        suffix = "-retrieval" if extra else ""
        out = os.path.join(ROOT, "runs", "squad-qa", "eval", f"qa_train.{retriever}{suffix}")
        if args.force or not os.path.exists(out + ".metrics.json"):
            run(
                ["evaluate", "--config", "configs/orqa.py:squad", "--workdir", "runs/squad-qa"]
                + ["--retriever", retriever, "--output", out, *extra]
            )
        results.append((label, json.load(open(out + ".metrics.json"))))
    write_section(*_section(results, timings), doc=RESULTS)
    return 0


def _section(results, timings) -> tuple[str, str]:
    ks = [k for k in results[0][1] if k.startswith("recall@")]
    lines = [
        "SQuAD v1.0 questions about the held-out articles (the titles `prepare` held out by",
        "hash: pre-training and fine-tuning never saw a question about them; pre-training did",
        "read every passage, as REALM reads all of Wikipedia), answered over the full corpus.",
        "Exact match after ORQA's answer normalisation; recall@k: some of the top k blocks",
        "holds an answer's wordpieces. Produced by `python bench/squad_qa.py` (`make squad-qa`).",
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
