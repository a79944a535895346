"""experiments/trusted_start/study.py squad_em's scoring: the block a weight picks and whether
its span is right, on hand-made records."""

from experiments.trusted_start.study import picked, right


def record(gold, blocks):
    return {
        "gold": gold,
        "top_blocks": [dict(zip(("span", "span_score", "hybrid"), b)) for b in blocks],
    }


def test_the_weight_trades_the_span_score_against_the_retrievers():
    r = record(["Paris"], [("Lyon", 3.0, 1.0), ("Paris", 1.0, 2.0)])
    assert picked(r, 0.0, "hybrid")["span"] == "Lyon"  # the span scores alone: 3 > 1
    assert picked(r, 1.0, "hybrid")["span"] == "Lyon"  # 4 > 3
    assert picked(r, 3.0, "hybrid")["span"] == "Paris"  # 6 < 7
    assert right(r, picked(r, 3.0, "hybrid")) and not right(r, picked(r, 0.0, "hybrid"))


def test_squads_normalisation_and_no_gold():
    r = record(["the Eiffel Tower"], [("Eiffel tower.", 1.0, 0.0)])
    assert right(r, r["top_blocks"][0])  # articles, case and punctuation dropped
    assert not right(record([], [("x", 1.0, 0.0)]), {"span": "x"})
