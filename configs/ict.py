"""Inverse Cloze Task configs (ORQA, Lee et al. 2019): the embedders' warm start for REALM.

Same sections as configs/realm.py (the data is the same prepared corpus, the embedders the
same networks), plus `ict`. Run `python -m realm_jax ict --config configs/ict.py:<variant>`
after `prepare`; point REALM's `model.init_embedders_from_ict` at the workdir.

Variants: smoke (the bundled sample, tiny), small, base (ORQA's: batch 4096, lr 1e-4,
100k steps, BERT-base), squad (the learning recipe in docs/results.md).
"""

import importlib.util
import os

import ml_collections


def _realm_config(variant: str) -> ml_collections.ConfigDict:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "realm.py")
    spec = importlib.util.spec_from_file_location("realm_jax_configs_realm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "smoke"
    c = _realm_config(variant)  # unknown variants are rejected there
    c.task = "ict"  # what `train` runs
    c.model.init_embedders_from_ict = ""  # ICT starts from BERT (model.init_embedder_from)
    c.ict = ml_collections.ConfigDict()
    c.ict.mask_rate = 0.9  # share of examples whose block loses the query sentence (ORQA)
    c.ict.recall_ks = (1, 5, 10, 20)  # held-out recall@k of the own block over the corpus
    c.ict.bm25_baseline = True  # also report BM25's recall@k on the same held-out sentences
    t = c.train
    t.batch_size = {"smoke": 16, "small": 128, "base": 4096, "squad": 64}[variant]  # global
    t.steps = {"smoke": 60, "small": 2000, "base": 100_000, "squad": 600}[variant]
    t.lr = {"smoke": 1e-3, "small": 1e-4, "base": 1e-4, "squad": 2e-4}[variant]  # ORQA: 1e-4
    t.warmup_steps = {"smoke": 6, "small": 200, "base": 10_000, "squad": 60}[variant]
    t.eval_every = {"smoke": 30, "small": 500, "base": 5000, "squad": 200}[variant]
    t.checkpoint_every = {"smoke": 30, "small": 500, "base": 5000, "squad": 200}[variant]
    t.eval_examples = {"smoke": 256, "small": 2048, "base": 4096, "squad": 1024}[variant]
    return c


def sweep():
    """The query sentence's removal rate around ORQA's 0.9 x the LR (override dicts)."""
    return [{"ict.mask_rate": rate, "train.lr": lr} for rate in (0.9, 1.0) for lr in (1e-4, 3e-4)]
