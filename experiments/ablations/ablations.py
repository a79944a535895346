"""REALM's ablations (Table 2 of Guu et al. 2020) at small scale -> this study's README.md.

    python experiments/ablations/ablations.py [--scale full|quick]        (or: make ablations)

SQuAD questions about held-out Wikipedia articles, answered over the full 18,896-passage
corpus, for six arms: BM25 + the reader; ICT only (ORQA's baseline, no REALM pre-training);
REALM with salient span masks; REALM with random span masks; REALM with random uniform masks;
REALM with a 30x stale index. Stages, each its own `python -m realm_jax` process from the
repository root (with ../shared beside it):

  1. prepare   configs/realm.py:squad (idempotent: prepare fingerprints its input)
  2. ict       configs/ict.py:squad -> PREFIX/ict: every dense arm's retriever warm start
  3. read      configs/orqa.py:squad_read -> PREFIX/read: bert-tiny's reader (and its span
               head) after a reading phase on the training articles' gold passages, every
               dense arm's reader for fine-tuning (a deviation from the paper: see that config)
  4. pretrain  `realm-jax sweep --config experiments/ablations/config.py:squad`: the four REALM
               arms, point by point (resumable), in PREFIX/pretrain/<point>, from the ICT embedders
               and bert-tiny's MLM reader. Not from the reading phase's reader: span
               extraction erases its fill-in-the-blank skill (held-out masked accuracy 0.0004,
               retrieval utility -0.89), and with it REALM's signal to the retriever
               (experiments/realm_signal/README.md)
  5. finetune  configs/orqa.py:squad for each dense arm: its retriever (the arm's query and
               document embedders: ICT's, or REALM's after pre-training) with the reading
               phase's reader and span head, the same steps and settings: the arms differ in
               their retrievers alone (the paper fine-tunes REALM's own reader: a deviation)
  5. evaluate  zero-shot retrieval of answer-holding blocks by the pre-trained retriever
               (`evaluate --checkpoint initial --retrieval_only`), exact match and retrieval
               after fine-tuning, the reader given the question's gold passage; for the
               salient arm also BM25's blocks read by its reader and BM25 alone

Every stage is reused only when its stamp (resolved config + code + upstream stamps,
experiments/tools/stage_stamp.py) matches, so an interrupted suite resumes where it stopped (across
sessions too, as long as the code is the same) and a change re-runs what it changes. The
section it writes has 95% bootstrap intervals over questions, the retrieval-utility curves
(ablations.png beside this file) and each stage's wall time; `--scale quick` is a short end-to-end
check with its own workdirs and its own section.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, ROOT)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools import stage_stamp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "README.md")  # this study's README: its result section
ABLATIONS = "experiments/ablations/config.py:squad"  # relative to ROOT (main() chdirs there)
ICT, ORQA = "configs/ict.py:squad", "configs/orqa.py:squad"
READ = "configs/orqa.py:squad_read"

# Overrides per scale (every stage's stamp includes them). full: the recipe's sizes, with
# fewer REALM and fine-tuning steps than `make squad-qa` so six arms fit about 3 hours on 2
# CPU cores; quick: a short end-to-end check of the suite (its table is printed, not written
# to the docs: its numbers are not findings).
SCALES = {
    "full": {
        "prefix": "runs/ablations",
        "ict": [],
        "read": [],
        "pretrain": ["train.steps=300"],
        "finetune": ["train.steps=400"],
        "limit": 0,
    },
    "quick": {  # every stage and evaluation for a few steps: a check, not a finding
        "prefix": "runs/ablations-quick",
        "ict": ["train.steps=20", "train.eval_every=0", "train.checkpoint_every=20"],
        "read": ["train.steps=10", "train.checkpoint_every=10", "train.batch_size=16"],
        "pretrain": [
            "train.steps=10",
            "train.eval_every=10",
            "train.checkpoint_every=10",
            "refresh.every=10",
            "train.eval_examples=64",
        ],
        "finetune": ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=10"],
        "limit": 100,
    },
}

# (key, label, index of its point in experiments/ablations/config.py's sweep(), or None). The
# paper's Table 2 (NQ dev, BERT-base, 200k steps) for reference: (exact match, zero-shot recall@5).
ARMS = [
    ("bm25", "BM25 + the salient arm's reader", None, None),
    ("ict", "ICT only (ORQA's baseline)", None, (31.3, 13.9)),
    ("salient", "REALM, salient span masks", 0, (38.2, 38.5)),
    ("random_span", "REALM, random span masks", 1, (35.3, 26.1)),
    ("uniform", "REALM, random uniform masks", 2, (32.3, 24.2)),
    ("stale", "REALM, 30x stale index", 3, (28.7, 15.1)),
]
ZEROSHOT = ["--checkpoint", "initial", "--retrieval_only"]
# the reading phase's reader, scored before any pre-training or fine-tuning: (name, evaluate
# arguments, overrides): given the gold passage, and reading BM25's top 5 blocks
READ_EVALS = [
    ("gold", ["--retriever", "gold"], []),
    ("bm25", ["--retriever", "bm25"], ["qa.reader_beam_size=5"]),
]
# evaluate runs after fine-tuning: (name, args); every dense arm gets the first three, the
# salient arm all. Exact match is the best dev checkpoint's (ORQA's model selection); the
# fine-tuned retriever is scored at the last checkpoint, since the best may be step 0 (it
# was, for every arm, in the 2026-11-24 run: fine-tuning lowered dev EM, raised dev recall)
EVALS = [
    ("dense", []),
    ("dense-retrieval", ["--retrieval_only", "--checkpoint", "latest"]),
    ("gold", ["--retriever", "gold"]),
    ("bm25", ["--retriever", "bm25"]),
    ("bm25-retrieval", ["--retriever", "bm25", "--retrieval_only"]),
]


run = stage_stamp.run


def _overrides(items: list[str]) -> list[str]:
    return [f"--config.{o}" for o in items]


class Suite:
    """The stages of one scale, their stamps and timings (PREFIX/timings.json)."""

    def __init__(self, scale: str):
        self.scale, self.s = scale, SCALES[scale]
        self.prefix = self.s["prefix"]  # relative to the repository root (main() cds there)
        self.timings_path = os.path.join(self.prefix, "timings.json")
        self.timings = {}
        if os.path.exists(self.timings_path):
            with open(self.timings_path) as f:
                self.timings = json.load(f)

    def _time(self, key: str, t: dict) -> None:
        self.timings[key] = t
        os.makedirs(self.prefix, exist_ok=True)
        with open(self.timings_path, "w") as f:
            json.dump(self.timings, f, indent=2)

    def workdir(self, *parts: str) -> str:
        return os.path.join(self.prefix, *parts)

    def pretrain_extra(self) -> list[str]:
        """The overrides every REALM arm's sweep point gets: the ICT embedders (the reader is
        the recipe's, bert-tiny's MLM: see the module docstring, stage 4)."""
        return self.s["pretrain"] + [f"model.init_embedders_from_ict={self.workdir('ict')}"]

    def point_workdir(self, arm: str) -> str:
        """The REALM arm's pre-training workdir (its sweep point's folder)."""
        from realm_jax.sweep.points import sweep_points

        index = next(i for key, _, i, _ in ARMS if key == arm)
        name, _ = sweep_points(ABLATIONS, self.pretrain_extra())[index]
        return self.workdir("pretrain", name)

    # ------------------------------------------------------------------ stages
    def prepare(self) -> str:
        """The prepared data (its own fingerprint is the upstream of ICT)."""
        run(["prepare", "--config", ICT, "--workdir", self.workdir("ict")])
        from realm_jax import workdir as paths
        from realm_jax.config import load_config
        from realm_jax.data import datasets

        cfg = load_config(ICT, [])
        ddir = paths.data_dir(cfg, self.workdir("ict"))
        return datasets.load_summary(ddir)["fingerprint"]

    def ict(self, data: str) -> str:
        work, over = self.workdir("ict"), self.s["ict"]
        want = stage_stamp.stamp(ICT, over, [data])
        if stage_stamp.begin("ict", work, want):
            self._time("ict", run(["ict", "--config", ICT, "--workdir", work, *_overrides(over)]))
            stage_stamp.write(work, want)
        return want

    def read(self, data: str) -> str:
        """The reading phase: every dense arm's reader warm start."""
        work, over = self.workdir("read"), self.s["read"]
        want = stage_stamp.stamp(READ, over, [data])
        if stage_stamp.begin("read", work, want):
            self._time(
                "read", run(["finetune", "--config", READ, "--workdir", work, *_overrides(over)])
            )
            stage_stamp.write(work, want)
        return want

    def pretrain(self, warm: str, indexes: list[int]) -> dict[int, tuple[str, str]]:
        """{sweep index: (point workdir, stamp)}: the REALM arms of these sweep indexes, each
        trained with `realm-jax local` in its sweep point's folder on one prepared folder (the
        points of config.py's sweep), and every other arm whose finished pre-training is on disk
        with a current stamp (reported, not run)."""
        from experiments.tools.cli_runs import done
        from realm_jax.sweep.points import sweep_points

        prefix, extra = self.workdir("pretrain"), self.pretrain_extra()
        data = [f"--config.data.data_dir={os.path.join(prefix, 'data')}"]
        points = sweep_points(ABLATIONS, extra)
        out, found, prepared = {}, {}, False
        for i, (name, own) in enumerate(points):
            work = os.path.join(prefix, name)
            want = stage_stamp.stamp(ABLATIONS, [*extra, *(o[9:] for o in own)], [warm])
            arm = next(key for key, _, index, _ in ARMS if index == i)
            if i not in indexes:
                if stage_stamp.current(work, want):
                    found[i] = (work, want)
                continue
            if stage_stamp.begin(f"pretrain {name}", work, want):
                if not prepared:  # the arms differ in read-time fields only: one folder
                    run(["prepare", "--config", ABLATIONS, "--workdir", prefix,
                         *_overrides(extra), *data])  # fmt: skip
                    prepared = True
                self._time(
                    f"pretrain {arm}",
                    run(
                        [
                            "local",
                            "--config",
                            ABLATIONS,
                            "--workdir",
                            work,
                            *_overrides(extra),
                            *own,
                            *data,
                        ]
                    ),  # fmt: skip
                )
            if not done(work):
                raise RuntimeError(f"{work}: the arm's pre-training did not finish")
            if not stage_stamp.current(work, want):
                stage_stamp.write(work, want)
            out[i] = (work, want)
        return out | found

    def finetune(self, arm: str, init: list[str], upstream: str, go: bool = True) -> str | None:
        """The arm's fine-tuning stamp, after running it if needed (go=False: only when it is
        on disk already, else None)."""
        work, over = self.workdir("finetune", arm), self.s["finetune"] + init
        want = stage_stamp.stamp(ORQA, over, [upstream])
        if not go:
            return want if stage_stamp.current(work, want) else None
        if stage_stamp.begin(f"finetune {arm}", work, want):
            t = run(["finetune", "--config", ORQA, "--workdir", work, *_overrides(over)])
            self._time(f"finetune {arm}", t)
            stage_stamp.write(work, want)
        return want

    def evaluate(
        self, workdir: str, init: list[str], upstream: str, name: str, extra, go=True, spec=ORQA
    ):
        """One evaluate run on `workdir` (reused when its upstream stage and the arguments are
        the same): its metrics and per-question records (go=False: only when on disk already,
        else None). spec/init: the config the workdir was made with (ORQA: plus the suite's
        fine-tuning overrides)."""
        out = os.path.join(workdir, "eval", name)
        limit = ["--limit", str(self.s["limit"])] if self.s["limit"] else []
        over = self.s["finetune"] + init if spec == ORQA else init
        args = ["evaluate", "--config", spec, "--workdir", workdir, "--output", out]
        args += [*extra, *limit, *_overrides(over)]
        key = json.dumps([upstream, args])
        stamp_path = out + ".stamp"
        fresh = os.path.exists(stamp_path) and open(stamp_path).read() == key
        if not fresh or not os.path.exists(out + ".metrics.json"):
            if not go:
                return None
            label = os.path.relpath(workdir, self.prefix).replace(os.sep, " ")
            self._time(f"evaluate {label} {name}", run(args))
            with open(stamp_path, "w") as f:
                f.write(key)
        with open(out + ".metrics.json") as f:
            metrics = json.load(f)
        with open(out + ".predictions.jsonl") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return metrics, records

    def zeroshot(self, arm: str, init: list[str], upstream: str, go: bool = True):
        """The pre-trained retriever before any fine-tuning, in its own workdir (evaluate
        embeds and publishes the warm start's index there): the paper's zero-shot recall."""
        work = self.workdir("zeroshot", arm)
        return self.evaluate(work, init, upstream, "zeroshot", ZEROSHOT, go)


def init_overrides(suite: Suite, arm: str) -> list[str]:
    """The fine-tuning (and zero-shot) warm start of an arm: the reading phase's reader and
    span head, then the arm's retriever: the ICT embedders, or the REALM arm's pre-trained
    ones (a REALM workdir's embedders load as an ICT run's: the same modules and names)."""
    retriever = suite.workdir("ict") if arm == "ict" else suite.point_workdir(arm)
    return [
        f"model.init_from_realm={suite.workdir('read')}",
        "model.init_span_head_from_realm=true",
        f"model.init_embedders_from_ict={retriever}",
    ]


# ---------------------------------------------------------------------- statistics, report


def per_question(records: list[dict], what: str) -> np.ndarray:
    """0/1 per question: "em" (the prediction is correct) or "recall@K" (some of the top K
    blocks holds an answer: the records' per-question hit flags)."""
    if what == "em":
        return np.asarray([bool(r["correct"]) for r in records], np.float64)
    k = what.split("@")[1]
    return np.asarray([bool(r["hits"][k]) for r in records], np.float64)


def bootstrap(values: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of `values` (questions resampled
    with replacement)."""
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for i in range(0, resamples, 100):  # 100 resamples at a time: bounded memory
        idx = rng.integers(0, len(values), size=(min(100, resamples - i), len(values)))
        means[i : i + len(idx)] = values[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def cell(records, what: str) -> str:
    if records is None:
        return "-"
    v = per_question(records, what)
    lo, hi = bootstrap(v)
    return f"{100 * v.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _minutes(t: dict | None) -> str:
    return f"{t['wall_seconds'] / 60:.1f}" if t and "wall_seconds" in t else "-"


def plot(curves: dict[str, dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, series in curves.items():
        steps = sorted(series)
        ax.plot(steps, [series[s] for s in steps], marker="o", label=label)
    ax.set_xlabel("REALM pre-training step")
    ax.set_ylabel("held-out retrieval utility")
    ax.set_title("Retrieval utility by arm (each on its own masks)")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(suite: Suite, results: dict, curves: dict, made: str, arms: list[str]):
    png = "ablations.png"
    if suite.scale == "full":
        plot(curves, os.path.join(HERE, png))
    t = suite.timings
    limit = suite.s["limit"]
    title = "Ablations: REALM's Table 2 at small scale" + (
        "" if suite.scale == "full" else f" ({suite.scale} scale)"
    )
    every = len(set(arms)) == len(ARMS)
    lines = [
        f"Produced by `python experiments/ablations/ablations.py --scale {suite.scale}` "
        "(`make ablations`; "
        "`--arms` runs some arms, `--stages zeroshot` stops before fine-tuning) from stages "
        f"made at commit {made}, each reused only when its config and code match."
        + (
            ""
            if every
            else " Cells of stages not run yet are `-`; arms marked *not run* have none."
        ),
        "SQuAD v1.0 questions about the held-out articles"
        + (f" (the first {limit})" if limit else "")
        + ", answered over the full corpus; exact match (EM) after ORQA's normalisation;",
        "recall@k: some of the top k blocks holds an answer's wordpieces. Zero-shot: the",
        "pre-trained retriever before fine-tuning (the paper's second number). Every dense arm",
        "is fine-tuned the same way (configs/orqa.py:squad with "
        + (", ".join(f"`{o}`" for o in suite.s["finetune"]) or "its own settings")
        + "). In brackets: 95% bootstrap intervals over questions (2,000 resamples).",
        "Paper: Table 2 of Guu et al. 2020 on NQ dev (BERT-base, 200k steps): EM / zero-shot",
        "recall@5, for the shape of the comparison, not the scale.",
        "",
        "| arm | zero-shot recall@5 | zero-shot recall@20 | EM | recall@20 after fine-tuning"
        " (last step) | EM given the gold passage | paper EM / R@5 | pre-training min"
        " | fine-tuning min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label, _, paper in ARMS:
        r = results.get(key, {})
        label = label if key in arms else f"{label} (*not run*)"
        lines.append(
            f"| {label} | {cell(r.get('zeroshot'), 'recall@5')} | "
            f"{cell(r.get('zeroshot'), 'recall@20')} | {cell(r.get('em'), 'em')} | "
            f"{cell(r.get('after'), 'recall@20')} | {cell(r.get('gold'), 'em')} | "
            f"{'-' if paper is None else f'{paper[0]} / {paper[1]}'} | "
            f"{_minutes(t.get(f'pretrain {key}'))} | {_minutes(t.get(f'finetune {key}'))} |"
        )
    lines += [
        "",
        "BM25's row: its zero-shot columns are BM25's own retrieval; its EM is the salient arm's",
        "fine-tuned reader reading BM25's top blocks. EM given the gold passage: the arm's",
        "fine-tuned reader on the question's own paragraph (its answer-holding blocks), no",
        "retrieval: the reader alone.",
        f"The ICT warm start, shared by every dense arm: {_minutes(t.get('ict'))} min. Times are",
        "wall minutes on this machine's 2 CPU cores (a stage found done is not re-timed).",
        "",
        "REALM pre-training starts from the ICT embedders and bert-tiny's MLM reader; every",
        "dense arm is then fine-tuned with its own retriever and one shared reader from a",
        f"reading phase (configs/orqa.py:squad_read, {_minutes(t.get('read'))} min; a deviation",
        "from the paper, whose BERT-base reader needs none and which fine-tunes REALM's own",
        "reader): bert-tiny's reader trained on the gold passages of the training articles'",
        "questions, so the arms differ in their retrievers alone. Right after the phase,",
        "before any fine-tuning, that reader scores"
        f" EM {cell(results.get('read', {}).get('gold'), 'em')} given the gold passage and",
        f"EM {cell(results.get('read', {}).get('bm25'), 'em')} reading BM25's top 5 blocks.",
        "",
        f"![retrieval utility by arm]({png})",
        "",
        "Retrieval utility (held-out, the paper's Figure 4): the masked span's log-likelihood",
        "with the retrieved blocks minus with the null document alone, on each arm's own masks.",
        "",
        "| step | " + " | ".join(curves) + " |",
        "|---" * (len(curves) + 1) + "|",
    ]
    steps = sorted(set().union(*(c.keys() for c in curves.values()))) if curves else []
    for s in steps:
        row = [f"{curves[k][s]:.4f}" if s in curves[k] else "" for k in curves]
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    return title, "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument(
        "--arms",
        default=",".join(key for key, _, _, _ in ARMS),
        help="comma-separated arms to run (default: all): "
        + ", ".join(key for key, _, _, _ in ARMS)
        + " (bm25 comes with salient, whose reader it uses)",
    )
    p.add_argument(
        "--stages",
        choices=("all", "zeroshot"),
        default="all",
        help="zeroshot: pre-train the arms and score their zero-shot retrieval, no fine-tuning",
    )
    p.add_argument("--no-doc", action="store_true", help="run the stages, leave the docs alone")
    args = p.parse_args()
    keys = [key for key, _, _, _ in ARMS]
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(keys):
        p.error(f"--arms: choose among {', '.join(keys)}, got {args.arms!r}")
    if "bm25" in arms:
        arms.append("salient")
    os.chdir(ROOT)  # the configs' relative paths (runs/, ../shared) and the stages' workdirs
    from realm_jax.train.metrics import read_scalars

    suite = Suite(args.scale)
    results: dict[str, dict] = {key: {} for key, _, _, _ in ARMS} | {"read": {}}
    data = suite.prepare()
    ict = suite.ict(data)
    # every dense arm's fine-tuning start: its retriever and the reading phase's reader
    read = suite.read(data)
    warm = ict + "+" + read
    read_work = suite.workdir("read")
    for name, extra, init in READ_EVALS:
        got = suite.evaluate(read_work, init, warm, name, extra, spec=READ)
        results["read"][name] = got and got[1]
    # every dense arm; those not asked for are reported from what is on disk (current stamps)
    dense = [(k, label, i) for k, label, i, _ in ARMS if k != "bm25"]
    inits = {key: init_overrides(suite, key) for key, _, _ in dense}
    # the sweep: the REALM arms asked for, point by point
    # REALM pre-training starts from the ICT embedders (and bert-tiny's reader)
    pretrained = suite.pretrain(ict, [i for k, _, i in dense if i is not None and k in arms])
    upstream = {key: warm for key, _, i in dense if i is None}
    for key, _, i in dense:
        if i is not None:
            stamp = pretrained.get(i, (None, None))[1]
            upstream[key] = stamp and stamp + "+" + read
    curves: dict[str, dict[int, float]] = {}
    for key, label, index in dense:  # the zero-shot table first: it needs no fine-tuning
        if upstream[key] is None:
            continue
        got = suite.zeroshot(key, inits[key], upstream[key], go=key in arms)
        results[key]["zeroshot"] = got and got[1]
        if index is not None:
            scalars = read_scalars(pretrained[index][0])
            curves[label] = scalars.get("eval/retrieval_utility", {})
    for key, _, _ in dense:
        go = key in arms and args.stages == "all"
        finetuned = upstream[key] and suite.finetune(key, inits[key], upstream[key], go)
        if not finetuned:
            continue
        work = suite.workdir("finetune", key)
        names = [n for n, _ in EVALS][: len(EVALS) if key == "salient" else 3]
        got = {n: suite.evaluate(work, inits[key], finetuned, n, dict(EVALS)[n], go) for n in names}
        got = {n: r and r[1] for n, r in got.items()}
        results[key] |= {"em": got["dense"], "after": got["dense-retrieval"], "gold": got["gold"]}
        if key == "salient":
            results["bm25"] = {"zeroshot": got["bm25-retrieval"], "em": got["bm25"], "after": None}
    done = [k for k, r in results.items() if k != "read" and any(v is not None for v in r.values())]
    made = stage_stamp.made_at(suite.workdir("ict"))
    title, body = report(suite, results, curves, made, done)
    if args.no_doc or args.scale != "full":
        print(f"## {title}\n\n{body}")
        return 0
    write_section(title, body, doc=RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
