"""Shared test helpers: the tiny runs' configs and prepared data, and checks several tiers use.

Helpers only (no tests): test modules import from here, never from each other."""

import json
import os

import numpy as np

from realm_jax import fs
from realm_jax import workdir as paths
from realm_jax.config import load_config
from realm_jax.data import datasets, prepare
from tests.conftest import REPO
from tests.support.realm_fixtures import TINY_NETWORKS

SAMPLE = os.path.join(REPO, "data", "sample", "corpus.jsonl")

# ---------------------------------------------------------------- a tiny REALM run (the trainer's)
REALM_OVERRIDES = TINY_NETWORKS + [
    "data.block_len=64",
    "data.query_len=32",
    "data.max_predictions=5",
    "data.masking=random",
    "train.batch_size=8",
    "train.num_candidates=4",
    "train.steps=24",
    "train.warmup_steps=2",
    "train.lr=1e-3",
    "train.log_every=1",
    "train.checkpoint_every=4",
    "refresh.mode=inprocess",
    "refresh.every=4",
    "train.eval_every=0",  # the tiny corpus holds out no title; evaluation is tested apart
]


def realm_config(*extra):
    """configs/realm.py:smoke with the tiny run's overrides (REALM_OVERRIDES) and `extra`."""
    return load_config(
        os.path.join(REPO, "configs", "realm.py") + ":smoke", REALM_OVERRIDES + list(extra)
    )


# ------------------------------------------------------- ORQA fine-tuning on two sample articles
QA_TITLES = ("Materialism", "Political philosophy")  # two small articles of data/sample
QA_OVERRIDES = TINY_NETWORKS + [
    "model.span_hidden_size=16",
    "data.block_len=64",
    "data.query_len=24",
    "data.max_predictions=5",
    "data.masking=random",
    "data.eval_fraction=0.0",
    "qa.train_holdout=none",
    "qa.dev_holdout=none",
    "qa.retriever_beam_size=16",
    "qa.reader_beam_size=3",
    "qa.recall_ks=(1,2,4)",
    "train.batch_size=8",
    # the query embedder takes no step (the step differentiates the reader alone, qa/step.py
    # reads_alone): retrieval stays as it is, so
    # ORQA's loss (which counts only questions whose answer was retrieved) counts the same
    # questions before and after (a random document embedder gives it nothing to learn from)
    "train.embedder_lr_scale=0",
    "model.proj_dropout=0",
    "train.steps=60",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "train.log_every=1",
    "train.checkpoint_every=30",
    "train.keep_checkpoints=5",
    "train.eval_every=30",
    "train.eval_batch_size=8",
    "train.eval_examples=16",
    "refresh.build_scann=False",
]


def qa_config(root, ddir, *extra):
    """configs/orqa.py:smoke on the QA articles prepared in `ddir` (qa_files)."""
    return load_config(
        os.path.join(REPO, "configs", "orqa.py") + ":smoke",
        QA_OVERRIDES
        + [
            f"data.corpus={root / 'corpus.jsonl'}",
            f"data.data_dir={ddir}",
            f"qa.train_file={root / 'qa.jsonl'}",
            f"qa.dev_file={root / 'qa.jsonl'}",
        ]
        + list(extra),
    )


def prepare_qa_files(tmp_path_factory):
    """The two articles' passages, prepared, and their questions."""
    root = tmp_path_factory.mktemp("qa")
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        docs = [line for line in f if json.loads(line)["title"] in QA_TITLES]
    with open(os.path.join(REPO, "data", "sample", "qa.jsonl")) as f:
        qs = [line for line in f if json.loads(line)["title"] in QA_TITLES]
    (root / "corpus.jsonl").write_text("".join(docs))
    short = [q for q in qs if len(json.loads(q)["answers"][0].split()) <= 2]
    (root / "qa.jsonl").write_text("".join(short[:16]))  # learnable by heart in a few steps
    ddir = str(root / "prepared")
    cfg = qa_config(root, ddir)
    prepare.prepare(cfg, ddir)
    return root, ddir


# ------------------------------------------------------------------------------ prepare
def data_config(corpus_path, *overrides):
    """configs/realm.py:smoke reading `corpus_path`."""
    return load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"), [f"data.corpus={corpus_path}", *overrides]
    )


def prepared_records(d):
    """Every record of the three datasets, by dataset name (eval_examples may be absent)."""
    out = {"blocks": [datasets.blocks_source(d)[i] for i in range(len(datasets.blocks_source(d)))]}
    for split, name in (("train", "examples"), ("eval", "eval_examples")):
        if fs.isdir(fs.join(d, name)):  # d may be gs:// (tests/test_gcs.py)
            src = datasets.examples_source(d, split)
            out[name] = [src[i] for i in range(len(src))]
    return out


def assert_same_prepared(local_dir, beam_dir):
    """The in-process and the Beam build of the same input hold the same records."""
    a, b = prepared_records(local_dir), prepared_records(beam_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name]) > 0, name
        for i, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            assert x.keys() == y.keys()
            for field in x:  # ids, doc ids, text, token ids, sentence starts, spans, labels
                same = np.array_equal(np.asarray(x[field]), np.asarray(y[field]))
                assert same, f"{name}[{i}].{field}: {x[field]!r} != {y[field]!r}"
    for i, rec in enumerate(b["blocks"]):
        assert rec["block_id"] == i  # record i is block i: what the index and trainer use
    sa, sb = (datasets.load_summary(d) for d in (local_dir, beam_dir))
    assert sa["counts"] == sb["counts"] and sa["fingerprint"] == sb["fingerprint"]
    assert (sa["engine"], sb["engine"]) == ("local", "beam")
    assert sa["masking"] == sb["masking"]


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_data_files(work: str, step: int) -> list[str]:
    state_dir = os.path.join(paths.checkpoint_dir(work), str(step), "state")
    files = [os.path.join(r, f) for r, _, fs in os.walk(state_dir) for f in fs]
    return sorted(
        (p for p in files if f"{os.sep}d{os.sep}" in p), key=os.path.getsize, reverse=True
    )


def damage(work: str, step: int, how: str, every: bool = False) -> None:
    """Damage checkpoint `step`'s largest data file (or every one): truncate it to half,
    zero-fill it or delete it."""
    files = checkpoint_data_files(work, step)
    for path in files if every else files[:1]:
        size = os.path.getsize(path)
        if how == "truncated":
            with open(path, "r+b") as f:
                f.truncate(size // 2)
        elif how == "zero-filled":
            with open(path, "r+b") as f:
                f.write(bytes(size))
        else:
            os.remove(path)
