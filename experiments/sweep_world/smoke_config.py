"""The smoke check's config (`python experiments/sweep_world/study.py --smoke`): configs/realm.py's
world variant shrunk to seconds a run, and its sweep(): the world search with an objective that
differs between trials at that size and the pruner's warm-up scaled to its steps, so that the
smoke's trials can be pruned and its later stages have pruned trials to run to the end.

The sizes: 80 people (60 the text tells about, 20 distractors), 12 steps at batch 8 (4 of the
copying curriculum, the embedders frozen until step 4), a held-out evaluation every 4 steps (16
sentences at this size), the index refreshed every 4 steps. The search is configs/realm.py's
sweep("world") (its parameters and sampler) on held-out eval/loss, minimised, with the median
pruner deciding from step 8 after one complete trial: at this size every trial's held-out
title recall@5 was 0 (a 6-step ICT start, 16 held-out sentences; 4 trials, 2026-11-29), ties a
pruner never cuts. The data paths and the ICT warm start are the study's overrides (its
--root). Never a result: the numbers of a 12-step run in an 80-person world say nothing.
"""

import dataclasses
import os

from realm_jax import config as config_lib

# configs/realm.py, from this study's folder (experiments/sweep_world/)
REALM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "realm.py")
STEPS, EVAL_EVERY = 12, 4
OBJECTIVE = "eval/loss"  # differs between trials at this size (title recall@5: 0 in all)
PRUNER_ARGS = {"n_startup_trials": 1, "n_warmup_steps": 2 * EVAL_EVERY}


def get_config(arg: str | None = None):
    c = config_lib.sibling_config(REALM, "realm.py", arg or "world")
    c.world.entities, c.world.distractors = 60, 20
    t = c.train
    t.batch_size, t.steps, t.warmup_steps = 8, STEPS, 2
    t.own_block_steps, t.embedders_frozen_steps, t.embedders_warmup_steps = 4, 4, 2
    t.eval_every = t.checkpoint_every = t.log_every = EVAL_EVERY
    t.eval_examples, t.eval_batch_size = 32, 16
    t.stall_floor_s = 1800.0  # two runs beside other work on 2 shared cores
    c.refresh.every = EVAL_EVERY
    return c


def sweep(variant: str | None = None):
    """configs/realm.py's world search on held-out loss, pruned from step 8 (module
    docstring)."""
    search = config_lib._load_module(REALM).sweep(variant or "world")
    return dataclasses.replace(
        search, objective=OBJECTIVE, direction="minimize", pruner_args=dict(PRUNER_ARGS)
    )
