"""REALM's retriever learns from the masked-LM signal alone (issue 39), in a generated world.

The chain a user runs (docs/tutorial.md), at a CI size: `world` (150 people the text tells
about, 150 distractors: 300 one-block documents), `prepare`, a short ICT warm start, then one
REALM run whose first CURRICULUM steps are the copying curriculum (the embedders frozen: the
retriever's held-out recall there is its start, the frozen control's) and whose steps after
it train the retriever by REALM's gradient alone. The held-out people's sentences are never
trained on; their own documents are in the corpus.

Fails when the retriever stops learning: recall@5 of the masked fact's own document at the
last step must beat the curriculum's end (the frozen control) by MARGIN. The system tier runs
the same chain with jax.lax.stop_gradient on the retrieval scores (nothing else changed) and
checks that the criterion then fails: that is what this test guards.
"""

import json
import os
import subprocess
import sys

import pytest

from realm_jax.train.metrics import read_scalars
from tests.conftest import REPO, shared_path

REALM, ICT = "configs/realm.py:world", "configs/ict.py:world"
CURRICULUM = 60  # steps of the copying curriculum (the embedders frozen)
STEPS = 160  # the whole REALM run
MARGIN = 0.05  # recall@5 the REALM steps must add over the frozen start
WORLD = ["--config.world.entities=150", "--config.world.distractors=150"]
RUN = [
    "--config.train.batch_size=8",
    f"--config.train.steps={STEPS}",
    f"--config.train.embedders_frozen_steps={CURRICULUM}",
    f"--config.train.own_block_steps={CURRICULUM}",
    f"--config.train.eval_every={CURRICULUM}",
    "--config.train.eval_examples=64",
    "--config.train.checkpoint_every=1000",
]
# The stop_gradient on the retrieval scores: REALM's only path to the retriever cut.
STOP_GRADIENT = """
import sys, jax
from realm_jax import cli
from realm_jax.pretrain import step
retrieve = step.retrieve
def cut(*a, **k):
    q, rel, cands, ids = retrieve(*a, **k)
    return q, jax.lax.stop_gradient(rel), cands, ids
step.retrieve = cut
sys.exit(cli.main(sys.argv[1:]))
"""


def _env() -> dict:
    """One CPU device, as a user's run has (the suite's 8 fake ones left out)."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    return env


def _run(args: list[str], log: str, patch: str | None = None) -> None:
    head = [sys.executable, "-c", patch] if patch else [sys.executable, "-m", "realm_jax"]
    with open(log, "w") as f:
        proc = subprocess.run(head + args, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:1])} failed ({proc.returncode}):\n" + open(log).read()[-3000:]
        )


def world_run(root, stop_gradient: bool = False) -> dict[int, float]:
    """The chain into `root`; returns the REALM run's held-out recall@5 by step."""
    bert = shared_path("models", "bert-tiny-mlm")
    world, data, ict, realm = (str(root / n) for n in ("world", "data", "ict", "realm"))
    paths = [
        f"--config.data.corpus={world}/corpus.jsonl",
        f"--config.data.sentences={world}/text",
        f"--config.data.data_dir={data}",
        f"--config.model.init_embedder_from={bert}",
        f"--config.model.init_reader_from={bert}",
    ]
    _run(["world", "--config", REALM, "--workdir", world, *WORLD], f"{root}/world.log")
    _run(["prepare", "--config", REALM, "--workdir", str(root), *paths], f"{root}/prepare.log")
    ict_args = ["--config.train.batch_size=32", "--config.train.steps=250"]
    ict_args += ["--config.train.eval_every=250", "--config.ict.bm25_baseline=false"]
    _run(["ict", "--config", ICT, "--workdir", ict, *paths, *ict_args], f"{root}/ict.log")
    args = ["train", "--config", REALM, "--workdir", realm, *paths, *RUN]
    args.append(f"--config.model.init_embedders_from_ict={ict}")
    _run(args, f"{root}/realm.log", STOP_GRADIENT if stop_gradient else None)
    assert json.load(open(os.path.join(realm, "metrics.json")))["complete"]
    return read_scalars(realm)["eval/title_recall_at_5"]


def learned(recall: dict[int, float]) -> bool:
    """The criterion: REALM's steps raised recall@5 over the frozen start by MARGIN."""
    return recall[STEPS] >= recall[CURRICULUM] + MARGIN


@pytest.fixture(scope="module")
def recall(tmp_path_factory):
    return world_run(tmp_path_factory.mktemp("world-learning"))


def test_realm_teaches_the_retriever_to_fetch_the_masked_facts_document(recall):
    start, end = recall[CURRICULUM], recall[STEPS]
    assert recall[0] == pytest.approx(start)  # frozen through the curriculum: the control
    assert learned(recall), f"held-out recall@5 {start:.3f} -> {end:.3f} (by step {STEPS})"


@pytest.mark.system
def test_the_criterion_fails_when_the_retrieval_scores_get_no_gradient(tmp_path):
    recall = world_run(tmp_path, stop_gradient=True)
    assert recall[STEPS] == pytest.approx(recall[CURRICULUM], abs=0.02)
    assert not learned(recall)
