"""The ablation suite (experiments/ablations/: ablations.py, config.py): every REALM arm's config
runs, the stale-index arm serves an index as old as it says, and the bootstrap intervals are
right."""

import importlib
import os

import numpy as np
import pytest

from realm_jax import checkpoint, sharding
from realm_jax import config as config_lib
from realm_jax.config import load_config, validate
from realm_jax.data import datasets
from realm_jax.index import embedding
from realm_jax.index.feed import IndexFeed
from realm_jax.pretrain import commands as pretrain_commands
from realm_jax.sweep.points import sweep_points
from tests.conftest import REPO, prepare_sample_head
from tests.support.realm_fixtures import TINY_NETWORKS

ABLATIONS = os.path.join(REPO, "experiments", "ablations", "config.py")
OVERRIDES = TINY_NETWORKS + [
    "data.block_len=64",
    "data.query_len=32",
    "data.max_predictions=5",
    "data.masking=random",
    "train.batch_size=8",
    "train.num_candidates=4",
    "train.warmup_steps=2",
    "train.lr=1e-3",
    "train.log_every=1",
    "train.eval_every=0",
    "refresh.mode=inprocess",
    "model.init_embedders_from_ict=",
    "model.init_embedder_from=",
    "model.init_reader_from=",
]


def _study(name):
    """The study script experiments/<name>/<name>.py, imported as a package module."""
    return importlib.import_module(f"experiments.{name}.{name}")


def config(*extra):
    return load_config(f"{ABLATIONS}:smoke", OVERRIDES + list(extra))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_sample_head(tmp_path_factory, config, 60)


def test_the_sweep_has_the_papers_four_realm_arms():
    points = dict(sweep_points(f"{ABLATIONS}:squad"))
    assert set(points) == {
        "mask_mode=salient",
        "mask_mode=random_span",
        "mask_mode=uniform",
        "mask_mode=salient,every=3000",
    }
    stale = load_config(f"{ABLATIONS}:squad", ["data.mask_mode=salient", "refresh.every=3000"])
    recipe = load_config(os.path.join(REPO, "configs", "realm.py") + ":squad")
    assert stale.refresh.every == 30 * recipe.refresh.every  # the paper's "30x stale"
    study = _study("ablations")
    indexes = sorted(i for _, _, i, _ in study.ARMS if i is not None)
    assert indexes == list(range(len(points)))


def _record_reembeds(monkeypatch):
    """Every in-process re-embedding: (step, host copy of the embeddings)."""
    seen = []
    real = IndexFeed.reembed

    def reembed(self, params, step):
        real(self, params, step)
        seen.append((step, np.asarray(sharding.to_host(self.emb))[: self.num_blocks]))

    monkeypatch.setattr(IndexFeed, "reembed", reembed)
    return seen


@pytest.mark.parametrize("point", range(3))
def test_every_masking_arm_runs_a_few_steps(point, data_dir, tmp_path):
    name, own = sweep_points(f"{ABLATIONS}:smoke")[point]
    cfg = config(f"data.data_dir={data_dir}", "train.steps=3", *(o[9:] for o in own))
    validate(cfg)
    history = pretrain_commands._train(cfg, str(tmp_path / name))
    assert max(h["step"] for h in history) == 3
    assert all(np.isfinite(h["loss"]) for h in history if "loss" in h)


def test_the_stale_arm_serves_an_index_as_old_as_it_says(data_dir, tmp_path, monkeypatch):
    """refresh.every=N: the index read at step s was embedded from the parameters of step
    N*floor(s/N) (compared with the checkpoint of that step re-embedded here), and the
    staleness the step reports is s mod N. The suite's stale arm (N=3000) never refreshes."""
    seen = _record_reembeds(monkeypatch)
    every, steps = 4, 10
    cfg = config(
        f"data.data_dir={data_dir}",
        f"train.steps={steps}",
        f"refresh.every={every}",
        f"train.checkpoint_every={every}",
        "train.keep_checkpoints=10",
    )
    workdir = str(tmp_path / "every4")
    history = pretrain_commands._train(cfg, workdir)
    assert [s for s, _ in seen] == [0, 4, 8]
    mesh = sharding.make_mesh(cfg.mesh)
    tokens, _, _ = datasets.load_blocks(data_dir)
    mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
    from realm_jax.index.embedding import abstract_params

    for step, emb in seen[1:]:  # re-embed checkpoint `step` independently of the trainer
        model, target = abstract_params(cfg, mesh, "doc_embedder")
        params = {
            "doc_embedder": checkpoint.restore_params_subtree(mgr, step, "doc_embedder", target)
        }
        _, padded = embedding.pad_index(None, tokens, mesh)
        ref = embedding.embed_blocks_fn(model, mesh, cfg.refresh.embed_batch_size)(
            params, sharding.put_rows(padded, mesh)
        )
        ref = np.asarray(sharding.to_host(ref))[: len(tokens)]
        np.testing.assert_allclose(emb, ref, rtol=1e-5, atol=1e-6)
        other = seen[0][1]  # and not the index of another step
        assert np.abs(other - ref).max() > 1e-4
    stale = {h["step"]: h["staleness"] for h in history if "staleness" in h}
    assert stale and all(v == (s - 1) % every for s, v in stale.items()), stale

    seen.clear()  # the suite's stale arm: one index, from the start, for the whole run
    _, own = sweep_points(f"{ABLATIONS}:smoke")[3]
    cfg = config(f"data.data_dir={data_dir}", "train.steps=6", *(o[9:] for o in own))
    history = pretrain_commands._train(cfg, str(tmp_path / "stale"))
    assert [s for s, _ in seen] == [0]
    stale = {h["step"]: h["staleness"] for h in history if "staleness" in h}
    assert stale == {s: s - 1 for s in range(1, 7)}


def test_bootstrap_interval_matches_the_normal_approximation():
    study = _study("ablations")
    rng = np.random.default_rng(1)
    values = (rng.random(2000) < 0.3).astype(np.float64)
    lo, hi = study.bootstrap(values, resamples=2000)
    p = values.mean()
    half = 1.96 * np.sqrt(p * (1 - p) / len(values))  # the binomial's normal interval
    assert abs(lo - (p - half)) < 0.006 and abs(hi - (p + half)) < 0.006
    assert study.bootstrap(np.ones(50)) == (1.0, 1.0)


def test_per_question_reads_the_evaluate_records():
    study = _study("ablations")
    records = [
        {"correct": True, "hits": {"5": True, "20": True}},
        {"correct": False, "hits": {"5": False, "20": True}},
    ]
    assert study.per_question(records, "em").tolist() == [1.0, 0.0]
    assert study.per_question(records, "recall@20").tolist() == [1.0, 1.0]
    assert study.cell(records, "recall@5").startswith("50.0 [")


def test_bm25_reader_picks_the_block_by_span_score_plus_weighted_retrieval_score():
    study = _study("bm25_reader")
    top = [  # BM25 ranks the wrong block first; its span scores prefer the other one
        {"span": "Paris", "span_score": 1.0, "bm25": 20.0, "score": -6.0, "has_answer": False},
        {"span": "Lyon", "span_score": 3.0, "bm25": 17.0, "score": -5.0, "has_answer": True},
    ]
    rec = {"gold": ["lyon"], "top_blocks": top}
    # 1.0 + 20w > 3.0 + 17w exactly when w > 2/3 (computed by hand)
    assert study.choose(rec, 0.0)["span"] == "Lyon"
    assert study.choose(rec, 0.5)["span"] == "Lyon"
    assert study.choose(rec, 1.0)["span"] == "Paris"
    assert study.choose(rec, study.TOP1)["span"] == "Paris"  # the retriever's first block
    assert study.choose(rec, 1.0, "score")["span"] == "Lyon"  # the dense relevance instead
    assert study.correct(rec, top[1]) and not study.correct(rec, top[0])  # ORQA's normalisation


def test_the_arms_share_one_prepared_folder(tmp_path):
    """The masks are drawn at read time: the four arms train on one prepared folder (a sweep
    refused them once, their data sections differing in data.mask_mode)."""
    from realm_jax.config import load_config
    from realm_jax.sweep import space
    from realm_jax.sweep.launch import data_folder

    for extra in ([], ["data.block_len=64"]):
        study = space.load(f"{ABLATIONS}:smoke", extra)
        base = load_config(study.spec, extra)
        folders = {data_folder(space.point_config(study, p), base, str(tmp_path))
                   for p in study.points}  # fmt: skip
        assert folders == {os.path.join(str(tmp_path), "data")} and len(study.points) == 4


def test_the_report_tables_what_was_run_and_marks_the_rest():
    study = _study("ablations")
    suite = study.Suite("quick")
    suite.timings = {"pretrain salient": {"wall_seconds": 120.0}}
    right = {"correct": True, "hits": {"5": True, "20": True}}
    wrong = {"correct": False, "hits": {"5": False, "20": True}}
    results = {key: {} for key, _, _, _ in study.ARMS}
    results["salient"] = {"zeroshot": [right, wrong], "em": [wrong, wrong], "after": None}
    curves = {"REALM, salient span masks": {0: 0.08, 100: 0.17}}
    title, body = study.report(suite, results, curves, "abc123", ["salient"])
    assert "quick scale" in title and "commit abc123" in body
    rows = {line.split(" | ")[0]: line for line in body.splitlines() if line.startswith("| ")}
    salient = rows["| REALM, salient span masks"].split(" | ")
    assert salient[1].startswith("50.0 [") and salient[2].startswith("100.0 [100.0, 100.0]")
    assert salient[3].startswith("0.0 [0.0, 0.0]") and salient[4] == "-"
    assert salient[7] == "2.0"  # pre-training minutes
    assert "| ICT only (ORQA's baseline) (*not run*)" in rows
    assert "| 100 | 0.1700 |" in body  # the retrieval-utility table


def test_realm_pretrains_from_an_mlm_reader_and_every_arm_finetunes_the_reading_phases():
    """REALM pre-training starts from the ICT embedders and the recipe's MLM reader (not the
    reading phase's, whose span training erased its fill-in-the-blank skill); fine-tuning
    (and zero-shot scoring) of every dense arm starts from the reading phase's reader and
    span head with the arm's own retriever, loaded last so it replaces the phase's."""
    study = _study("ablations")
    suite = study.Suite("quick")
    read = f"model.init_from_realm={suite.workdir('read')}"
    extra = suite.pretrain_extra()
    assert f"model.init_embedders_from_ict={suite.workdir('ict')}" in extra
    assert not any(o.startswith(("model.init_from_realm", "model.init_reader_from")) for o in extra)
    config = load_config(study.ABLATIONS, extra)
    # an MLM reader: bert-tiny by its hub id (the recipe since models by name), or a folder
    reader = config.model.init_reader_from
    assert reader == config_lib.BERT_TINY or reader.endswith("bert-tiny-mlm"), reader
    for arm, retriever in (
        ("ict", suite.workdir("ict")),
        ("salient", suite.point_workdir("salient")),
    ):
        over = study.init_overrides(suite, arm)
        assert over[:2] == [read, "model.init_span_head_from_realm=true"]
        assert over[2] == f"model.init_embedders_from_ict={retriever}"


def test_a_realm_workdirs_embedders_load_as_an_ict_runs(tmp_path):
    """init_overrides gives a REALM arm's workdir as model.init_embedders_from_ict: its
    checkpoint's query and document embedders come back exactly."""
    import jax

    from realm_jax.model.bert import ModelConfig
    from realm_jax.pretrain import step as pretrain_step
    from realm_jax.train import warm_start
    from tests.support.realm_fixtures import tiny_config

    cfg = tiny_config()
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    _, _, state, _ = pretrain_step.create_state(cfg, mesh, jax.random.key(0))
    mgr = checkpoint.manager(str(tmp_path), with_data=False)
    checkpoint.save(mgr, 3, state)
    mgr.wait_until_finished()
    got = warm_start.ict_embedder_params(
        str(tmp_path), ModelConfig.from_config(cfg.model, "embedder")
    )
    params = jax.device_get(state.params)
    assert set(got) == {"query_embedder", "doc_embedder"}
    for name, tree in got.items():
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(params[name]), strict=True):
            np.testing.assert_array_equal(a, b)
