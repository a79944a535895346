"""The own-corpus recipe (README "On your own corpus"), stage by stage, timed: each stage's wall
time and peak resident memory (its process's ru_maxrss, from os.wait4) -> docs/recipe.md.

    python benchmarks/recipe_stages.py [--root runs/recipe] [--corpus FILE] [--questions FILE]

The README's default: `prepare` (configs/realm.py:own), the reading phase with all-MiniLM-L6-v2
retrieving (`finetune --config configs/orqa.py:own_read`: bert-tiny's reader on the questions'
passages, MiniLM frozen, its index embedded once), `evaluate` (its qa.retriever: the hybrid,
then dense and BM25 to compare) and `ask`. Defaults: the squad recipe's data
(config.squad_files(): SQuAD's paragraphs and questions), so the figures are on SQuAD. Every
stage is the README's command as a user types it; a finished stage is not run again (its
figures are kept in ROOT/stages.json), so an interrupted run resumes where it stopped (a
stopped `finetune` from its last checkpoint). The evaluation stages also give the held-out
exact match of the recipe's model reading the hybrid, dense and BM25 top 5.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

OUT = os.path.join(REPO, "docs", "recipe.md")


def stages(root: str, corpus: str, questions: str) -> list[tuple[str, list[str]]]:
    from realm_jax.config import squad_files

    corpus, questions = corpus or squad_files()[0], questions or squad_files()[1]
    c = [f"--config.data.data_dir={root}/data", f"--config.data.corpus={corpus}"]
    q = [f"--config.qa.train_file={questions}", f"--config.qa.dev_file={questions}"]
    realm, qa = f"{root}/realm", f"{root}/qa"
    return [
        ("prepare", ["prepare", "--config", "configs/realm.py:own", "--workdir", realm, *c]),
        ("finetune (reading phase)",
         ["finetune", "--config", "configs/orqa.py:own_read", "--workdir", qa, *c, *q]),
        # evaluate and ask: the workdir's recorded config (README: no --config); the README's
        # `evaluate --workdir` (own_read's qa.retriever: hybrid), then the other two
        ("evaluate (hybrid)", ["evaluate", "--workdir", qa]),
        *[
            (f"evaluate --retriever {r}", ["evaluate", "--workdir", qa, "--retriever", r])
            for r in ("dense", "bm25")
        ],
        ("ask", ["ask", "--workdir", qa, "Who founded the University of Notre Dame?"]),
    ]  # fmt: skip


def run(cmd: list[str], log: str, append: bool = False) -> dict:
    """Run `python -m realm_jax CMD` to the end: {seconds, peak_rss_mb, rc, load} (load: the
    1-minute load average at its start and end, to tell a quiet machine from a shared one)."""
    t0, load0 = time.time(), os.getloadavg()[0]
    with open(log, "a" if append else "w") as f:  # a resumed stage's log keeps its first runs
        p = subprocess.Popen(
            [sys.executable, "-m", "realm_jax", *cmd], cwd=REPO, stdout=f, stderr=f
        )
        _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return {
        "seconds": round(time.time() - t0, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 0),  # KiB on Linux
        "rc": p.returncode,
        "log": os.path.relpath(log, REPO),
        "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
    }


def metrics(root: str, retriever: str) -> dict:
    """evaluate's metrics file for `retriever` (its default prefix: <questions stem>.<name>)."""
    import glob

    found = sorted(glob.glob(os.path.join(root, "qa", "eval", f"*.{retriever}.metrics.json")))
    return json.load(open(found[0])) if found else {}


def predictions(root: str, retriever: str) -> str:
    """evaluate's predictions file for `retriever` ("" before it ran)."""
    import glob

    found = sorted(glob.glob(os.path.join(root, "qa", "eval", f"*.{retriever}.predictions.jsonl")))
    return found[0] if found else ""


def against_bm25(root: str, retriever: str) -> str:
    """Exact match of `retriever` against BM25's on the same questions: gained, lost, p."""
    from experiments.tools import paired_retrieval as paired

    if retriever == "bm25" or not predictions(root, "bm25") or not predictions(root, retriever):
        return ""
    c = paired.compare(
        paired.load(predictions(root, "bm25")),
        paired.load(predictions(root, retriever)),
        paired.EXACT_MATCH,
    )
    return f"{c['gained']} gained, {c['lost']} lost, p = {c['p']:.2g}"


def index_seconds(log: str) -> float | None:
    """The reading phase's frozen index time, from its log's `embedded N blocks in S s`."""
    import re

    if not os.path.exists(log):
        return None
    found = re.findall(r"embedded \d+ blocks in ([\d.]+) s \(the frozen index\)", open(log).read())
    return float(found[-1]) if found else None


def write(root: str, done: dict, argv: list[str]) -> None:
    rows = [
        f"| `{name}` | {r['seconds'] / 60:.1f}"
        + (f" ({len(r['attempts'])} runs, resumed)" if len(r.get("attempts", [])) > 1 else "")
        + f" | {r['peak_rss_mb']:.0f} | {r['rc']} |"
        for name, r in done.items()
    ]
    stopped = [
        f"- `{name}` did not finish ({r['rc']}): {r.get('note', 'see ' + r['log'])}; the next "
        "`python benchmarks/recipe_stages.py` resumes it."
        for name, r in done.items()
        if r["rc"] != 0
    ]
    loads = {name: r.get("load") for name, r in done.items() if r.get("load")}
    load_note = (
        "the 1-minute load average at each stage's start and end: "
        + ", ".join(f"{name} {a:g} -> {b:g}" for name, (a, b) in loads.items())
        + f" ({os.cpu_count()} cores; above that, other jobs ran beside it)"
    )
    ems = []
    for r in ("dense", "bm25", "hybrid"):
        m = metrics(root, r)
        if m:
            ems.append(
                f"| {r} | {100 * m.get('exact_match', 0):.1f} | {100 * m.get('recall@5', 0):.1f} | "
                f"{100 * m.get('recall@20', 0):.1f} | {int(m.get('questions', 0))} | "
                f"{against_bm25(root, r)} |"
            )
    index_s = index_seconds(os.path.join(root, "finetune.log"))
    index_note = (
        f" Of the reading phase, {index_s / 60:.1f} min embedded the corpus with all-MiniLM-L6-v2 "
        "(its frozen index, once); the rest is its training steps and held-out evaluation."
        if index_s
        else ""
    )
    text = f"""# The own-corpus recipe, stage by stage

What each stage of the README's own-corpus recipe costs on this project's machine
({platform.machine()}, {os.cpu_count()} cores, CPU only), run as a user types it: `prepare`
(configs/realm.py:own), the reading phase (`finetune --config configs/orqa.py:own_read`:
bert-tiny's reader on the training questions' passages, all-MiniLM-L6-v2 retrieving, frozen, its
index of the corpus embedded once), `evaluate` with the hybrid retriever (then dense and BM25 to
compare), `ask`:

    python benchmarks/recipe_stages.py {" ".join(argv)}

Each stage is the README's command: `evaluate` and `ask` name only the workdir, whose recorded
config they start from (`run_config.json`,
[reference](reference.md#a-workdir-remembers-its-config)).

| stage | minutes | peak memory (MB) | exit |
|---|---|---|---|
{chr(10).join(rows)}
{(chr(10) + chr(10).join(stopped) + chr(10)) if stopped else ""}
Peak memory is the stage's process's maximum resident set (ru_maxrss).{index_note} The machine
is shared: {load_note}. On a GPU: not measured (no device was lent to this session).

Held-out exact match of the recipe's model (configs/orqa.py:own_read's dev split: the held-out
articles' questions), reading each retriever's top 5; against BM25: the questions it answers and
BM25 does not (gained), the reverse (lost), and the exact two-sided sign test on them
(experiments/tools/paired_retrieval.py):

| retriever | exact match % | recall@5 % | recall@20 % | questions | exact match against BM25 |
|---|---|---|---|---|---|
{chr(10).join(ems) or "| (not yet run) | | | | | |"}

REALM's adaptation stage (README: `train`, then `finetune --config configs/orqa.py:own`) is not
part of these figures: on SQuAD it re-embeds the corpus with MiniLM every 50 steps, not timed.
"""
    with open(OUT, "w") as f:
        f.write(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="runs/recipe")
    ap.add_argument("--corpus", default="", help="default: configs/realm.py:squad's")
    ap.add_argument("--questions", default="", help="default: configs/orqa.py:squad's")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    os.makedirs(root, exist_ok=True)
    state_path = os.path.join(root, "stages.json")
    done = json.load(open(state_path)) if os.path.exists(state_path) else {}
    for name, cmd in stages(root, args.corpus, args.questions):
        if name in done and done[name]["rc"] == 0:
            continue
        print(f"$ realm-jax {' '.join(cmd)}", flush=True)
        slug = name.replace("evaluate --retriever ", "evaluate-").replace(" (hybrid)", "-hybrid")
        slug = slug.split()[0]
        log = os.path.join(root, slug + ".log")
        earlier = done.get(name, {}).get("attempts", [])
        result = run(cmd, log, append=bool(earlier))
        if result["rc"] == 0 and not finished(cmd):  # a trainer stopped by a signal exits 0
            result["rc"] = "stopped"
        # a resumed stage's time is the sum of its runs (each run's figures kept)
        done[name] = dict(result, attempts=[*earlier, result])
        done[name]["seconds"] = round(sum(a["seconds"] for a in done[name]["attempts"]), 1)
        done[name]["peak_rss_mb"] = max(a["peak_rss_mb"] for a in done[name]["attempts"])
        print(f"  {result}", flush=True)
        json.dump(done, open(state_path, "w"), indent=1)
        write(root, done, sys.argv[1:])
        if done[name]["rc"] != 0:
            print(f"stage {name} did not finish ({result['rc']}): see {log}", file=sys.stderr)
            return 1
    write(root, done, sys.argv[1:])  # every stage done: the page from what they measured
    return 0


def finished(cmd: list[str]) -> bool:
    """Whether a training stage (`finetune`, `train`) ran to its last step: its workdir's
    metrics.json says complete (SIGTERM stops a trainer with a checkpoint and exit code 0; the
    next run of this script resumes it). Other stages: True."""
    if cmd[0] not in ("finetune", "train"):
        return True
    path = os.path.join(cmd[cmd.index("--workdir") + 1], "metrics.json")
    return os.path.exists(path) and bool(json.load(open(path)).get("complete"))


if __name__ == "__main__":
    raise SystemExit(main())
