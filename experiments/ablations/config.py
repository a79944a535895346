"""The ablation suite's pre-training arms (REALM's Table 2, Guu et al. 2020, at small scale):
`make ablations` (experiments/ablations/ablations.py) runs this file's sweep() with
`realm-jax sweep`.

The config is configs/realm.py's variant unchanged (default: squad, the learning recipe);
each sweep point is one REALM pre-training arm of the paper's ablations:

  mask_mode=salient             REALM: one salient span (named entity or date) per sentence
  mask_mode=random_span         "random span masks" (SpanBERT-style whole-word spans)
  mask_mode=uniform             "random uniform masks" (BERT-style, 15% of the wordpieces)
  mask_mode=salient,every=3000  "30x stale MIPS index": the recipe refreshes every 100 steps,
                                this arm every 3,000, i.e. never within its run: it reads the
                                ICT warm start's index throughout

The two arms without REALM pre-training (BM25 + the reader, ICT only: ORQA's baseline) and
the fine-tuning and scoring of every arm are experiments/ablations/ablations.py's stages.
"""

import os

from realm_jax import config as config_lib

# configs/realm.py, from this study's folder (experiments/ablations/)
REALM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "realm.py")
STALE_REFRESH_EVERY = 3000  # 30 x the squad recipe's refresh.every (100)


def get_config(arg: str | None = None):
    return config_lib.sibling_config(REALM, "realm.py", arg or "squad")


def sweep():
    """The REALM pre-training arms (override dicts; see the module docstring)."""
    return [
        {"data.mask_mode": "salient"},
        {"data.mask_mode": "random_span"},
        {"data.mask_mode": "uniform"},
        {"data.mask_mode": "salient", "refresh.every": STALE_REFRESH_EVERY},
    ]
