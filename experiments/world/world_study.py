"""Watch REALM learn in a generated world (issue 39) -> this study's README.md and the
tutorial's plot (docs/tutorial_world.png).

    python experiments/world/world_study.py [--root runs/world-study] [--arms realm,frozen]

Runs, as a user would (`python -m realm_jax ...` with configs/realm.py:world and
configs/ict.py:world), into --root: the world (`world`), its prepared data (`prepare`), the
ICT warm start (`ict`), then one REALM pre-training run (`train`) per arm, each evaluated every
50 steps on the held-out people's sentences. An arm that already finished is read, not rerun
(--rerun to redo). Arms (ARMS): realm (the recipe), frozen (the same run, the embedders never
train: the control), random_span / uniform (data.mask_mode), stale (refresh.every 30 x the
recipe's: the index never refreshed in the run). Then the table (title_recall@1 and @5 of
the masked fact's own document, accuracy, null-only accuracy, top1_share) at the end of the
copying curriculum and at the last step, and the plot of recall and accuracy against steps.

Arms for issue 46 (BM25's candidates): bm25, bm25_lr, bm25_copy, bm25_copy_lr,
bm25_copy_inbatch (in-batch negatives for REALM's retriever part) and
bm25_copy_inbatch_ict_lr (the same at the imitation control's LR), bm25_copy_inbatch_b64
(and its batch and steps), and the
BM25-imitation controls imitation, imitation_long (5x its steps), imitation_x2 (2x) and
imitation_b16 (REALM's batch of 16); realm_from_imitation (REALM's recipe from the imitation
control's embedders, not ICT's) and realm_from_imitation_lr (at the imitation's LR);
bm25_imitation (REALM's loss plus the imitation term in one step, train.imitation_weight), its
controls bm25_imitation_alone (the term alone: REALM's gradient stopped at the retriever) and
bm25_ict_lr (REALM alone at the same LR); bm25_imitation_pos and bm25_imitation_pos_alone,
the same against the batch's BM25 blocks alone (train.imitation_negatives=positives), and
both at the imitation control's total LR (bm25_imitation_pos_lr, bm25_imitation_pos_alone_lr)
and at its batch of 64 (bm25_imitation_pos_b64, bm25_imitation_pos_alone_b64); see ARMS.

--seed N: another world, data order and initialisation (its own README section);
--summarise_seeds 0,1,2 then writes their mean and range for --arms, running nothing.

--mention attributes: the world whose sentences name their person only by other attributes
(world.mention), with its own section in the README and no plot.

--qa: open-domain QA on the world's questions (configs/orqa.py:world), ORQA's fine-tuning
from ICT alone (its embedders with bert-tiny's reader: ORQA's own start) and from each arm's
run (its three networks). Each start is scored on the held-out
people's questions before fine-tuning (zero-shot retrieval, `evaluate --checkpoint initial
--retrieval_only`) and after it (`evaluate --checkpoint latest`): exact match, and recall of
the question's own document (its gold_passage) in the top 1 and 5 blocks.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools.cli_runs import chosen_arms, done, run  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
PLOT = os.path.join(REPO, "docs", "tutorial_world.png")
REALM, ICT = "configs/realm.py:world", "configs/ict.py:world"
BM25_M = 4  # BM25 candidates a masked sentence in the bm25 arms
# bm25_imitation_pos at the imitation control's summed LR, and at its batch of 64 (ARMS)
POS_LR = [
    f"--config.train.bm25_candidates={BM25_M}",
    "--config.train.embedder_lr_scale=1.25",
    "--config.train.imitation_weight=1.0",
    "--config.train.imitation_negatives=positives",
]
POS_B64 = [
    f"--config.train.bm25_candidates={BM25_M}",
    "--config.train.batch_size=64",
    "--config.train.steps=250",
    "--config.train.own_block_steps=50",
    "--config.train.embedders_frozen_steps=50",
    "--config.train.embedder_lr_scale=0.77",
    "--config.train.imitation_weight=1.0",
    "--config.train.imitation_negatives=positives",
    "--config.train.stall_floor_s=1800",
]
ARMS = {
    "realm": [],
    "frozen": ["--config.train.embedders_frozen_steps=400"],
    # trained on other masks, scored on the same salient masks as the others (the fact masked)
    "random_span": ["--config.data.mask_mode=random_span", "--config.data.eval_mask_mode=salient"],
    "uniform": ["--config.data.mask_mode=uniform", "--config.data.eval_mask_mode=salient"],
    "stale": ["--config.refresh.every=600"],
    # BM25's top 4 blocks for each masked sentence join the dense candidates (issue 46)
    "bm25": [f"--config.train.bm25_candidates={BM25_M}"],
    # ... with the embedders at the reader's learning rate (the recipe's tenth was chosen
    # against a collapse with dense candidates only)
    "bm25_lr": [f"--config.train.bm25_candidates={BM25_M}", "--config.train.embedder_lr_scale=1"],
    # ... with the copying curriculum twice as long and no reading phase after it (the reader
    # unlearnt copying while reading chance-level candidates: REALM's signal on the own
    # document then stays near 0)
    "bm25_copy": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.own_block_steps=200",
        "--config.train.embedders_frozen_steps=200",
    ],
    # ... and with the embedders at the reader's learning rate (the release's): with a reader
    # that copies, REALM's pull on the own document is signal, not only noise
    "bm25_copy_lr": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.own_block_steps=200",
        "--config.train.embedders_frozen_steps=200",
        "--config.train.embedder_lr_scale=1",
    ],
    # ... and with in-batch negatives for REALM's retriever part (train.inbatch_negatives: the
    # prior normalised over the batch's other candidates too, the reader reading its own): the
    # own document ranked against the other sentences' BM25 blocks, as imitation ranks it
    "bm25_copy_inbatch": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.own_block_steps=200",
        "--config.train.embedders_frozen_steps=200",
        "--config.train.embedder_lr_scale=1",
        "--config.train.inbatch_negatives=True",
    ],
    # ... with the embedders at the imitation control's LR (ICT's 3e-4: 0.6 x the reader's 5e-4)
    "bm25_copy_inbatch_ict_lr": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.own_block_steps=200",
        "--config.train.embedders_frozen_steps=200",
        "--config.train.embedder_lr_scale=0.6",
        "--config.train.inbatch_negatives=True",
    ],
    # ... at the imitation control's batch (64), LR (3e-4) and embedder steps (200): the
    # curriculum and the reading phase shortened to 50 steps (as many sentences as 200 of 16)
    "bm25_copy_inbatch_b64": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.batch_size=64",
        "--config.train.steps=250",
        "--config.train.own_block_steps=50",
        "--config.train.embedders_frozen_steps=50",
        "--config.train.embedder_lr_scale=0.6",
        "--config.train.inbatch_negatives=True",
        # 4x the step's work on 2 shared cores: a step took over the watchdog's 300 s floor
        "--config.train.stall_floor_s=1800",
    ],
    # the BM25-imitation control: the ICT start's embedders trained contrastively on BM25's
    # top block for the same masked sentences (`ict --config.ict.positives=bm25`) for as many
    # steps as REALM trains them, then scored as every arm is (a REALM run of one step with
    # the embedders frozen: its step-0 evaluation is the imitation's retriever)
    "imitation": ["--config.train.embedders_frozen_steps=400", "--config.train.steps=1"],
    # the same with 5x the steps (IMITATION_LONG): whether this retriever can learn the world's
    # retrieval at all when told the right document every step
    "imitation_long": ["--config.train.embedders_frozen_steps=400", "--config.train.steps=1"],
    # ... at REALM's batch of 16 (ICT's is 64): as many (sentence, block) pairs as REALM sees
    "imitation_b16": ["--config.train.embedders_frozen_steps=400", "--config.train.steps=1"],
    # ... with twice its steps: the control for realm_from_imitation (the imitation's steps
    # plus as many again as REALM then trains the embedders)
    "imitation_x2": ["--config.train.embedders_frozen_steps=400", "--config.train.steps=1"],
    # REALM's loss plus the BM25-imitation term in the same step (train.imitation_weight: BM25's
    # top block the positive of a softmax over the batch's candidates), BM25's top 4 joined,
    # the embedders at the imitation control's LR (3e-4, 0.6 x the reader's)
    "bm25_imitation": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.embedder_lr_scale=0.6",
        "--config.train.imitation_weight=1.0",
    ],
    # ... its control: the same step with REALM's gradient stopped at the retriever's scores
    # (train.realm_retriever_grad=False), the embedders learning from the imitation term alone
    "bm25_imitation_alone": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.embedder_lr_scale=0.6",
        "--config.train.imitation_weight=1.0",
        "--config.train.realm_retriever_grad=False",
    ],
    # bm25_imitation with the imitation control's negatives: the batch's BM25 top blocks alone
    # (train.imitation_negatives=positives), not its dense hits; imitation_b16 (the control's
    # loss at this batch, LR and steps, no reader) and bm25_imitation_pos_alone beside it
    "bm25_imitation_pos": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.embedder_lr_scale=0.6",
        "--config.train.imitation_weight=1.0",
        "--config.train.imitation_negatives=positives",
    ],
    "bm25_imitation_pos_alone": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.embedder_lr_scale=0.6",
        "--config.train.imitation_weight=1.0",
        "--config.train.imitation_negatives=positives",
        "--config.train.realm_retriever_grad=False",
    ],
    # the same two at the imitation control's total LR: REALM's embedders train over its
    # decaying second half (about 0.024 x the scale, summed over steps 200-400), the control
    # over its own warmup and decay (0.03 summed): 1.25 x the reader's LR matches them, its
    # peak (3.3e-4 at step 200) near the control's 3e-4
    "bm25_imitation_pos_lr": POS_LR,
    "bm25_imitation_pos_alone_lr": [*POS_LR, "--config.train.realm_retriever_grad=False"],
    # bm25_imitation_pos and its _alone control at the imitation control's batch (64) and
    # embedder steps (200; the curriculum and the reading phase 50 steps, as
    # bm25_copy_inbatch_b64), the embedders' LR summed over their steps the control's (0.77 x
    # the reader's: 0.039 x the scale against 0.03): whether REALM's gradient adds to the term
    # where the term alone learns (the imitation arm: 41.4% recall@5)
    "bm25_imitation_pos_b64": POS_B64,
    "bm25_imitation_pos_alone_b64": [*POS_B64, "--config.train.realm_retriever_grad=False"],
    # ... and REALM alone: the same candidates and LR, no imitation term
    "bm25_ict_lr": [
        f"--config.train.bm25_candidates={BM25_M}",
        "--config.train.embedder_lr_scale=0.6",
    ],
    # REALM's recipe (the realm arm, dense candidates only) from the imitation control's
    # embedders instead of ICT's: where ICT leaves the own document outside the dense top-k,
    # BM25's imitation puts it there, and REALM's pull can start. Not the release's start
    # (REALM warm-starts from ICT): a second retriever's lesson distilled first, on purpose.
    # Its step 200 (the embedders frozen until then) is the imitation start; imitation_x2
    # is its control
    "realm_from_imitation": [],
    # ... with the embedders at the imitation control's LR (3e-4, 0.6 x the reader's) rather
    # than the recipe's tenth
    "realm_from_imitation_lr": ["--config.train.embedder_lr_scale=0.6"],
}
# arms whose embedders start from an imitation arm's ICT run instead of ICT's
FROM_IMITATION = {"realm_from_imitation": "imitation", "realm_from_imitation_lr": "imitation"}
IMITATION_LONG = 5
# the imitation arms' ICT runs: (multiple of REALM's embedder steps, extra ICT flags)
IMITATIONS = {
    "imitation": (1, []),
    "imitation_long": (IMITATION_LONG, []),
    "imitation_b16": (1, ["--config.train.batch_size=16"]),
    "imitation_x2": (2, []),
}
IMITATION_ICT = ["--config.ict.positives=bm25"]
KEYS = (
    ("title_recall@1", "recall@1"),
    ("title_recall@5", "recall@5"),
    ("accuracy", "accuracy"),
    ("null_only_accuracy", "null-only accuracy"),
    ("top1_share", "top-1 share"),
)


QA_CONFIG = "configs/orqa.py:world"


def history(workdir: str) -> dict[str, dict[int, float]]:
    from realm_jax.train.metrics import read_scalars

    tags = read_scalars(workdir)
    return {k: tags[f"eval/{k.replace('@', '_at_')}"] for k, _ in KEYS}


def plot(runs: dict[str, dict], curriculum: int, out: str, frozen: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, style in (("realm", "-o"), ("frozen", "--s")):
        if arm not in runs:
            continue
        h = runs[arm]
        label = "REALM" if arm == "realm" else "control: retriever frozen"
        for ax, key in zip(axes, ("title_recall@5", "accuracy"), strict=True):
            steps = sorted(h[key])
            ax.plot(steps, [h[key][s] for s in steps], style, label=label, markersize=4)
    h = runs.get("realm") or next(iter(runs.values()))
    steps = sorted(h["null_only_accuracy"])
    axes[1].plot(
        steps, [h["null_only_accuracy"][s] for s in steps], ":", label="null document only"
    )
    for ax, title in zip(
        axes, ("recall@5 of the masked fact's own document", "masked-span accuracy"), strict=True
    ):
        ax.axvspan(0, curriculum, color="0.85")
        ax.axvspan(curriculum, max(frozen, curriculum), color="0.94")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(
            "step (dark: copying curriculum; light: reading; the retriever frozen in both)",
            fontsize=8,
        )
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Held-out people of the generated world (configs/realm.py:world)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


def own_document_recall(predictions: str, qa_file: str, ks=(1, 5)) -> dict[str, float]:
    """Recall@k of each question's own document (gold_passage) among the blocks a predictions
    file lists for it (`evaluate`'s top_blocks, in rank order), matched by title."""
    import json

    title = {}
    for line in open(qa_file):
        q = json.loads(line)
        title[q["question"]] = q["title"]
    hits = {k: [] for k in ks}
    for line in open(predictions):
        r = json.loads(line)
        got = [b["title"] for b in r["top_blocks"]]
        for k in ks:
            hits[k].append(title[r["question"]] in got[:k])
    return {f"own_recall@{k}": sum(v) / max(len(v), 1) for k, v in hits.items()}


def qa(root: str, paths: list[str], arms: list[str], rerun: bool) -> str:
    """Fine-tune and evaluate from ICT alone (ORQA's start) and from each arm's run; returns
    the section's table."""
    import json

    from realm_jax.config import load_config

    world = os.path.join(root, "world")
    qa_file = os.path.join(world, "qa.jsonl")
    bert = load_config(os.path.join(REPO, REALM)).model.init_reader_from
    starts = {
        "ict": [
            "--config.model.init_from_realm=",
            f"--config.model.init_embedders_from_ict={root}/ict",
            f"--config.model.init_reader_from={bert}",
        ]
    }
    for arm in arms:
        starts[arm] = [f"--config.model.init_from_realm={root}/{arm}"]
    files = [f"--config.qa.train_file={qa_file}", f"--config.qa.dev_file={qa_file}"]
    rows = []
    for start in starts:
        wd = os.path.join(root, f"qa_{start}")
        args = ["--config", QA_CONFIG, "--workdir", wd, *paths, *files, *starts[start]]
        if rerun or not done(wd):
            if os.path.exists(wd):
                subprocess.run(["rm", "-rf", wd], check=True)
            run(["finetune", *args], f"{wd}.log")
        cells = {}
        for when, extra in (
            ("before", ["--checkpoint", "initial", "--retrieval_only"]),
            ("after", ["--checkpoint", "latest"]),
        ):
            out = os.path.join(wd, "eval", when)
            if rerun or not os.path.exists(out + ".metrics.json"):
                run(["evaluate", *args, "--output", out, *extra], f"{wd}.eval-{when}.log")
            m = json.load(open(out + ".metrics.json"))
            m.update(own_document_recall(out + ".predictions.jsonl", qa_file))
            cells[when] = m
        b, a = cells["before"], cells["after"]
        rows.append(
            f"| {start} | {int(a['questions'])} | {b['own_recall@1']:.3f} | "
            f"{b['own_recall@5']:.3f} | {a['own_recall@1']:.3f} | {a['own_recall@5']:.3f} | "
            f"{a['exact_match']:.3f} |"
        )
    head = (
        "| start | held-out questions | zero-shot own-doc recall@1 | zero-shot recall@5 | "
        "fine-tuned recall@1 | fine-tuned recall@5 | exact match |"
    )
    return "\n".join([head, "|" + "---|" * 7, *rows])


def imitation(
    root: str,
    ict: str,
    paths: list[str],
    steps: int,
    rerun: bool,
    arm: str = "imitation",
    flags: tuple[str, ...] | list[str] = (),
) -> str:
    """The BM25-imitation control's embedders: `steps` of ICT's loss on (masked sentence,
    BM25's top block) pairs from the ICT start (with `flags`, more ICT overrides); returns
    its workdir (`<arm>-ict`)."""
    wd = os.path.join(root, f"{arm}-ict")
    if rerun or not done(wd):
        if os.path.exists(wd):
            subprocess.run(["rm", "-rf", wd], check=True)
        extra = [f"--config.model.init_embedders_from_ict={ict}", f"--config.train.steps={steps}"]
        args = ["ict", "--config", ICT, "--workdir", wd, *paths, *IMITATION_ICT, *extra, *flags]
        run(args, f"{wd}.log")
    return wd


def section_rows(text: str, title: str) -> dict[tuple[str, int], dict[str, float]]:
    """The arms' table of the README section `## title`: (arm, step) -> {column: value};
    {} when the section is absent."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not m:
        return {}
    lines = [x for x in m.group(1).splitlines() if x.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0], int(cells[1]))] = {k: float(v) for k, v in zip(head[2:], cells[2:])}
    return rows


def seed_title(arms: str, seed: int, kind: tuple[str, ...] = ()) -> str:
    """The section title a run of `arms` with `seed` writes (as main does)."""
    kind = (*kind, f"seed {seed}") if seed else kind
    return f"Arms: {arms}" + (f" ({', '.join(kind)} world)" if kind else "")


def seeds_summary(text: str, arms: str, seeds: list[int], kind: tuple[str, ...] = ()) -> str:
    """Mean and range over `seeds` of each arm's row at each step its sections share, read from
    the per-seed sections of the README `text`; then, per seed, whether the first arm's last
    recall@5 is above each other arm's, and the mean and range of the first arm's last recall@1
    and @5 minus each other's. Raises naming a seed whose section is missing."""
    per_seed = {}
    for seed in seeds:
        rows = section_rows(text, seed_title(arms, seed, kind))
        if not rows:
            raise SystemExit(f"no section {seed_title(arms, seed, kind)!r} in {RESULTS}: run it")
        per_seed[seed] = rows
    keys = sorted(set.intersection(*(set(r) for r in per_seed.values())))
    order = {a: i for i, a in enumerate(arms.split(","))}
    keys.sort(key=lambda k: (order.get(k[0], 99), k[1]))
    cols = [n for _, n in KEYS]
    lines = [
        "| arm | step | " + " | ".join(cols) + " |",
        "|" + "---|" * (len(cols) + 2),
    ]
    for key in keys:
        cells = []
        for c in cols:
            v = [per_seed[s][key][c] for s in seeds]
            cells.append(f"{sum(v) / len(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    first, *others = arms.split(",")
    last = max(step for arm, step in keys if arm == first)
    for other in others:
        o_last = max((step for arm, step in keys if arm == other), default=None)
        if o_last is None:
            continue
        wins = sum(
            per_seed[s][(first, last)]["recall@5"] > per_seed[s][(other, o_last)]["recall@5"]
            for s in seeds
        )
        lines.append(
            f"\n{first} above {other} in recall@5 at its last step: {wins} of {len(seeds)} seeds."
        )
        for col in ("recall@1", "recall@5"):
            d = [per_seed[s][(first, last)][col] - per_seed[s][(other, o_last)][col] for s in seeds]
            lines.append(
                f"{first} - {other}, {col}: {100 * sum(d) / len(d):+.1f} points "
                f"[{100 * min(d):+.1f}, {100 * max(d):+.1f}]."
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/world-study", help="folder of every run (from the repo)")
    p.add_argument("--arms", default="realm,frozen", help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--rerun", action="store_true", help="run finished arms again")
    p.add_argument("--no_plot", action="store_true", help="do not write docs/tutorial_world.png")
    p.add_argument(
        "--mention",
        default="name",
        choices=("name", "attributes"),
        help="how the text names its people (world.mention); attributes: no plot, its own section",
    )
    p.add_argument(
        "--names",
        default="words",
        choices=("words", "made_up"),
        help="the people's names (world.names); made_up: several shared wordpieces a name",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the world's, the data's and the models' seed (world.seed, data.seed, train.seed)",
    )
    p.add_argument(
        "--qa",
        action="store_true",
        help=f"then fine-tune ({QA_CONFIG}) from ICT alone and from each arm; score QA",
    )
    p.add_argument(
        "--summarise_seeds",
        default="",
        help="a comma list of seeds already run (e.g. 0,1,2): write the mean and range of "
        "their README sections for --arms (and --mention/--names) as one section; runs nothing",
    )
    a = p.parse_args(argv)
    arms = chosen_arms(p, a.arms, ARMS)
    kinds = (a.mention != "name" and a.mention, a.names != "words" and a.names)
    kind = tuple(x for x in kinds if x)
    if a.summarise_seeds:
        try:
            seeds = [int(x) for x in a.summarise_seeds.split(",")]
        except ValueError:
            p.error(
                f"--summarise_seeds {a.summarise_seeds!r}: a comma list of integers, e.g. 0,1,2"
            )
        table = seeds_summary(open(RESULTS).read(), a.arms, seeds, kind)
        flag = "".join(f" --{k} {v}" for k, v in (("mention", a.mention), ("names", a.names)))
        flag = flag.replace(" --mention name", "").replace(" --names words", "")
        body = (
            f"Seeds {a.summarise_seeds}: the mean [min, max] over the sections above, each from "
            f"`python experiments/world/world_study.py --root <root> --arms {a.arms}{flag} "
            f"--seed <seed>` (a seed draws its own world, data order and initialisation; seed 0 "
            f"is the default). Written by `world_study.py --arms {a.arms}{flag} "
            f"--summarise_seeds {a.summarise_seeds}`.\n\n" + table
        )
        suffix = f" ({', '.join(kind)} world)" if kind else ""
        write_section(f"Seeds {a.summarise_seeds}: {a.arms}{suffix}", body, doc=RESULTS)
        print(table)
        return 0
    root = os.path.join(REPO, a.root) if not os.path.isabs(a.root) else a.root
    os.makedirs(root, exist_ok=True)
    world, data, ict = (os.path.join(root, n) for n in ("world", "data", "ict"))
    paths = [
        f"--config.data.corpus={world}/corpus.jsonl",
        f"--config.data.sentences={world}/text",
        f"--config.data.data_dir={data}",
    ]
    seeds = [f"--config.data.seed={a.seed}", f"--config.train.seed={a.seed}"] if a.seed else []
    paths += seeds
    if not os.path.exists(os.path.join(world, "world.json")):
        shape = [f"--config.world.mention={a.mention}", f"--config.world.names={a.names}"]
        shape += [f"--config.world.seed={a.seed}"]
        run(["world", "--config", REALM, "--workdir", world, *shape], f"{root}/world.log")
    if not os.path.exists(os.path.join(data, "summary.json")):
        run(["prepare", "--config", REALM, "--workdir", root, *paths], f"{root}/prepare.log")
    if not done(ict):
        run(["ict", "--config", ICT, "--workdir", ict, *paths], os.path.join(root, "ict.log"))
    from realm_jax.config import load_config

    tc = load_config(os.path.join(REPO, REALM)).train
    curriculum, frozen = int(tc.own_block_steps), int(tc.embedders_frozen_steps)
    runs = {}
    for arm in arms:
        wd = os.path.join(root, arm)
        if a.rerun or not done(wd):
            if os.path.exists(wd):
                subprocess.run(["rm", "-rf", wd], check=True)
            start = ict
            base = arm if arm in IMITATIONS else FROM_IMITATION.get(arm)
            if base:  # an imitation arm, or an arm started from one: its ICT run first
                times, flags = IMITATIONS[base]
                steps = times * (tc.steps - frozen)
                start = imitation(root, ict, paths, steps, a.rerun, base, flags)
            extra = [f"--config.model.init_embedders_from_ict={start}", *ARMS[arm]]
            run(["train", "--config", REALM, "--workdir", wd, *paths, *extra], f"{wd}.log")
        runs[arm] = history(wd)
    last = max(max(h["title_recall@5"]) for h in runs.values())
    rows = []
    for arm, h in runs.items():
        for step in [0] if arm.startswith("imitation") else sorted({curriculum, frozen, last}):
            cells = [f"{h[k].get(step, float('nan')):.3f}" for k, _ in KEYS]
            rows.append(f"| {arm} | {step} | " + " | ".join(cells) + " |")
    head = "| arm | step | " + " | ".join(n for _, n in KEYS) + " |"
    table = "\n".join([head, "|" + "---|" * (len(KEYS) + 2), *rows])
    flag = "" if a.mention == "name" else f" --mention {a.mention}"
    flag += "" if a.names == "words" else f" --names {a.names}"
    flag += f" --seed {a.seed}" if a.seed else ""
    body = (
        f"`python experiments/world/world_study.py --root {a.root} --arms {a.arms}{flag}`: "
        f"the world of `{REALM}` (its held-out people's sentences, 256 evaluated), the ICT "
        f"warm start of `{ICT}`; step {curriculum} is the end of the copying curriculum, "
        f"step {frozen} the end of the reading steps (the embedders frozen until then: the "
        "retriever's recall there is its ICT start; the frozen arm's embedders never train)."
        "\n\n" + table
    )
    write_section(seed_title(a.arms, a.seed, kind), body, doc=RESULTS)
    if not a.no_plot and not kind and not a.seed and "realm" in runs:
        plot(runs, curriculum, PLOT, frozen)
    print(table)
    if a.qa:
        table = qa(root, paths, arms, a.rerun)
        body = (
            f"`python experiments/world/world_study.py --root {a.root} --arms {a.arms} --qa`: "
            f"`{QA_CONFIG}` fine-tuned on the training people's questions from ICT alone "
            "(its embedders, bert-tiny's reader: ORQA's start) and from each arm's run (all "
            "three networks), scored on the held-out people's questions: zero-shot (the start's "
            "retriever, before fine-tuning) and fine-tuned (the last checkpoint). Own-doc "
            "recall@k: the question's own document among the top k blocks; exact match after "
            "ORQA's normalisation.\n\n" + table
        )
        write_section(f"QA: ICT alone and {a.arms}", body, doc=RESULTS)
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
