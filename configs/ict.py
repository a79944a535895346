"""Inverse Cloze Task configs (ORQA, Lee et al. 2019): the embedders' warm start for REALM.

Same sections as configs/realm.py (the data is the same prepared corpus, the embedders the
same networks), plus `ict`. Run `python -m realm_jax ict --config configs/ict.py:<variant>`
after `prepare`; point REALM's `model.init_embedders_from_ict` at the workdir.

Variants: smoke (the bundled sample, tiny), small, base (ORQA's: batch 4096, lr 1e-4,
100k steps, BERT-base), squad (the learning recipe, experiments/squad_qa), world (the generated
world's warm start, docs/tutorial.md). configs/realm.py:own has no ICT stage (its retriever starts
from a trained sentence embedder): `own` is refused here with a line saying so.
"""

import ml_collections

from realm_jax import config as config_lib

# train.* fields taken from configs/realm.py's variant on purpose (tests/test_configs.py fails
# on any other inherited train field): the same AdamW and loop settings as REALM (ORQA's ICT
# uses BERT's optimizer too). Everything else that shapes what ICT trains is set below: a
# REALM-only setting (the squad recipe's train.embedder_lr_scale=0.1) once leaked into ICT.
INHERITED = config_lib.SHARED_TRAIN_FIELDS + ("train.log_every", "train.eval_batch_size")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "smoke"
    if variant == "own":
        raise ValueError(
            "the own recipe has no ICT stage: configs/realm.py:own starts the retriever from "
            "model.init_retriever_from (a sentence embedder); for ICT on your corpus use "
            "configs/ict.py:squad --config.data.corpus=FILE"
        )
    # configs/realm.py's variant (an unknown variant is rejected there)
    c = config_lib.sibling_config(__file__, "realm.py", variant)
    c.task = "ict"  # what `train` runs
    c.model.init_embedders_from_ict = ""  # ICT starts from BERT (model.init_embedder_from)
    c.ict = ml_collections.ConfigDict()
    c.ict.mask_rate = 0.9  # share of examples whose block loses the query sentence (ORQA)
    c.ict.recall_ks = (1, 5, 10, 20)  # held-out recall@k of the own block over the corpus
    c.ict.bm25_baseline = True  # also report BM25's recall@k on the same held-out sentences
    # The positives: "own_block" (ORQA's ICT: a sentence of a block, the block its positive) or
    # "bm25" (the BM25-imitation control: REALM's masked pre-training sentences, each with
    # BM25's top block for it as the positive, the own block excluded; data/span_candidates.py)
    c.ict.positives = "own_block"  # "own_block" or "bm25" (above)
    t = c.train
    # per variant: global batch, steps, peak LR (ORQA: 1e-4), warmup, eval and checkpoint
    # interval, held-out sentences evaluated
    sizes = {
        "smoke": (16, 60, 1e-3, 6, 30, 256),
        "small": (128, 2000, 1e-4, 200, 500, 2048),
        "base": (4096, 100_000, 1e-4, 10_000, 5000, 4096),
        "squad": (64, 600, 2e-4, 60, 200, 1024),
        "world": (64, 400, 3e-4, 30, 100, 256),
    }[variant]
    t.batch_size, t.steps, t.lr, t.warmup_steps, t.eval_every, t.eval_examples = sizes
    t.checkpoint_every = t.eval_every  # steps between checkpoints
    # ICT trains nothing but the embedders: their LR is train.lr (REALM's squad recipe slows
    # its embedders to a tenth, which made ICT learn at a tenth: issue 22)
    t.embedder_lr_scale = 1.0  # the embedders' LR relative to train.lr
    t.embedders_frozen_steps = 0  # ICT trains the embedders alone: from its first step
    t.embedders_warmup_steps = 0  # (no late start)
    t.frozen_step = False  # (no frozen steps: REALM's reader-only step unused)
    t.own_block_steps = 0  # (REALM pre-training only)
    return c


def sweep():
    """The query sentence's removal rate around ORQA's 0.9 x the LR (override dicts)."""
    return [{"ict.mask_rate": rate, "train.lr": lr} for rate in (0.9, 1.0) for lr in (1e-4, 3e-4)]
