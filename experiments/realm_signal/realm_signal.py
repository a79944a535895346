"""REALM's signal to the retriever, measured on held-out sentences -> this study's README.md.

    python experiments/realm_signal/realm_signal.py --data_dir D --ict W_ICT --read W_READ \
        [--realm W_REALM ...]

REALM's gradient on the retriever's score of candidate z is p(z|x,y) - p(z|x): the posterior
(the prior re-weighted by how well the reader fills the masks given z) minus the prior. Where
the posterior puts more mass than the prior on blocks of the sentence's own article, REALM
pulls the retriever towards them; where it puts less, REALM pulls it away; where the two
agree, the reader gives the retriever nothing to learn. This script scores that, with the
held-out evaluation of `train` (realm_jax/pretrain/evaluation.py: same_title_prior,
same_title_posterior), for a retriever + reader pair at the start of REALM pre-training and
after it: each is one `realm-jax train` of a single step in a scratch workdir whose step-0
evaluation is read (the step itself is not used).

The pairs (every one with the ICT embedders, salient masks, configs/realm.py:squad):
  ICT + bert-tiny            the reader REALM pre-training started from before the reading phase
  ICT + the reading phase    the ablation suite's start (experiments/ablations/ablations.py)
  after REALM (--realm)      a pre-trained REALM workdir's own networks
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")  # this study's
CONFIG = "configs/realm.py:squad"
KEYS = [
    ("same_title_fraction", "same title (top-k)"),
    ("same_title_prior", "prior mass, same title"),
    ("same_title_posterior", "posterior mass, same title"),
    ("retrieval_utility", "retrieval utility"),
    ("accuracy", "accuracy (marginal)"),
    ("null_only_accuracy", "accuracy (null doc only)"),
]
DEFAULT_SECTION = "REALM's signal to the retriever"
COPY_KEYS = [  # does the reader read its block (realm_jax/pretrain/evaluation.py)
    ("span_in_candidates", "a retrieved block holds the masks"),
    ("accuracy_block_holds", "accuracy given such a block"),
    ("accuracy_block_lacks", "accuracy given a block without them"),
    ("copy_gain", "copy gain (nats per mask)"),
]


def evaluate(label: str, overrides: list[str], work: str, examples: int) -> dict:
    """The step-0 held-out evaluation of one retriever + reader pair (cached in `work`)."""
    from realm_jax.train.metrics import read_scalars

    if not os.path.exists(os.path.join(work, "metrics.json")):
        cmd = [sys.executable, "-m", "realm_jax", "train", "--config", CONFIG, "--workdir", work]
        cmd += ["--config.train.steps=1", "--config.train.eval_every=1"]
        cmd += [f"--config.train.eval_examples={examples}", "--config.refresh.mode=inprocess"]
        cmd += [f"--config.{o}" for o in overrides]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    scalars = read_scalars(work)  # the TensorBoard events: every evaluation, step 0 first
    missing = [k for k, _ in KEYS + COPY_KEYS if f"eval/{k}" not in scalars]
    if missing:
        raise SystemExit(f"{work}: made by older code, no {missing}: delete it or pick --out")
    return {k: scalars[f"eval/{k}"][0] for k, _ in KEYS + COPY_KEYS} | {"label": label}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data_dir", required=True, help="the prepared squad data (ablations)")
    ap.add_argument("--ict", required=True, help="the ICT workdir")
    ap.add_argument("--read", required=True, help="the reading phase's workdir")
    ap.add_argument("--realm", action="append", default=[], help="LABEL=WORKDIR, repeatable")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "realm_signal"))
    ap.add_argument("--examples", type=int, default=1024)
    ap.add_argument("--section", default=DEFAULT_SECTION, help="the section of the README")
    args = ap.parse_args()
    base = [f"data.data_dir={os.path.abspath(args.data_dir)}", "data.mask_mode=salient"]
    ict = [f"model.init_embedders_from_ict={os.path.abspath(args.ict)}"]
    pairs = [
        ("ICT + bert-tiny's reader", base + ict),
        (
            "ICT + the reading phase's reader",
            base
            + ict
            + [
                f"model.init_from_realm={os.path.abspath(args.read)}",
                "model.init_span_head_from_realm=true",
                "model.init_reader_from=",
            ],
        ),
    ]
    for spec in args.realm:
        label, work = spec.split("=", 1)
        pairs.append(
            (
                label,
                base
                + [
                    f"model.init_from_realm={os.path.abspath(work)}",
                    "model.init_span_head_from_realm=true",
                    "model.init_reader_from=",
                    # the REALM run's own embedders: no HF folder or ICT run may replace them
                    # (before 2026-11-26 the recipe's bert-tiny folder did, in these rows)
                    "model.init_embedder_from=",
                    "model.init_embedders_from_ict=",
                ],
            )
        )
    rows = []
    for i, (label, over) in enumerate(pairs):
        rows.append(evaluate(label, over, os.path.join(args.out, f"pair{i}"), args.examples))
    lines = [
        "`python experiments/realm_signal/realm_signal.py "
        f"--data_dir {args.data_dir} --ict {args.ict} --read "
        f"{args.read}"
        + "".join(f" --realm '{r}'" for r in args.realm)
        + (f" --section '{args.section}'" if args.section != DEFAULT_SECTION else "")
        + f" --out {args.out}`: "
        f"{args.examples} held-out salient-span sentences (articles never trained on), the "
        "8 candidates of the corpus-wide search (the null document and the top 7, the "
        "sentence's own block excluded). REALM's gradient on a candidate's retrieval score is "
        "p(z|x,y) - p(z|x); the posterior's mass on the article's blocks minus the prior's is "
        "the direction and size of REALM's pull towards them.",
        "",
        "| retriever + reader | " + " | ".join(name for _, name in KEYS) + " | posterior - prior |",
        "|---|" + "---|" * (len(KEYS) + 1),
    ]
    for r in rows:
        gap = r["same_title_posterior"] - r["same_title_prior"]
        lines.append(
            f"| {r['label']} | " + " | ".join(f"{r[k]:.4f}" for k, _ in KEYS) + f" | {gap:+.4f} |"
        )
    lines += [
        "",
        "Does the reader read its blocks? On the same sentences, the retrieved blocks (the null "
        "document aside) that hold every masked wordpiece (as a bag of wordpieces, title "
        "included) against those that do not: the reader's accuracy given one block alone, and "
        "the copy gain, log p(y|x,z) per mask with a block that holds the masks minus with one "
        "that lacks them, averaged over the sentences that retrieved both kinds. A reader that "
        "ignores its block scores 0 there, and REALM's posterior then cannot favour the blocks "
        "that hold the answer.",
        "",
        "| retriever + reader | " + " | ".join(name for _, name in COPY_KEYS) + " |",
        "|---|" + "---|" * len(COPY_KEYS),
    ]
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(f"{r[k]:.4f}" for k, _ in COPY_KEYS) + " |")
    lines += [
        "",
        "Read with it: `accuracy` is the masked wordpieces the reader fills right with the "
        "candidates, `retrieval utility` how much the retrieved blocks raise the masks' "
        "log-likelihood over the null document alone. A reader that cannot fill the masks "
        "(accuracy near 0) leaves the posterior equal to the prior, and REALM's gradient on "
        "the retriever is then noise around zero, whatever the retriever.",
    ]
    write_section(args.section, "\n".join(lines), doc=RESULTS)


if __name__ == "__main__":
    main()
