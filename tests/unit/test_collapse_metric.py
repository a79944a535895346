"""The held-out evaluation's collapse report: top1_share, distinct_top1 and the warning."""

import logging

import numpy as np

from realm_jax.pretrain import evaluation as E


def test_collapse_metrics_against_a_hand_count():
    top = np.array([3, 3, 5, 3, 7, 3, 5, 3])  # block 3 on top of 5 of 8 queries
    assert E.collapse_metrics(top) == {"top1_share": 5 / 8, "distinct_top1": 3.0}
    assert E.collapse_metrics(np.zeros(0, np.int64)) == {"top1_share": 0.0, "distinct_top1": 0.0}


def test_warning_names_the_block_above_the_share_only(caplog):
    titles = np.asarray([f"t{i}" for i in range(10)], dtype=object)
    tops = [np.array([3] * 12 + [1, 2, 4, 5])]  # 12 of 16: 75%
    out = dict(E.collapse_metrics(np.concatenate(tops)), examples=16.0)
    with caplog.at_level(logging.WARNING, logger="realm_jax.train"):
        E.warn_collapse(out, 50, tops, titles)
    assert "retrieval collapse at step 50: block 3 ('t3')" in caplog.text
    assert "75% of 16 held-out queries (5 distinct top blocks)" in caplog.text
    caplog.clear()
    spread = [np.arange(16) % 10]  # at most 2 of 16 on any block
    out = dict(E.collapse_metrics(spread[0]), examples=16.0)
    E.warn_collapse(out, 50, spread, titles)
    few = dict(out, top1_share=1.0, examples=8.0)  # too few queries to call it
    E.warn_collapse(few, 50, [np.zeros(8, np.int64)], titles)
    assert caplog.text == ""
