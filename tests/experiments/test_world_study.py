"""experiments/world/world_study.py: its arms, its refusal of unknown ones, its plot."""

import os

import pytest

from experiments.world import world_study as W
from realm_jax.config import load_config
from tests.conftest import REPO


def test_arms_are_overrides_of_the_world_config():
    config = load_config(os.path.join(REPO, "configs", "realm.py") + ":world")
    frozen = W.ARMS["frozen"][0].split("=")
    assert frozen[0] == "--config.train.embedders_frozen_steps"
    assert int(frozen[1]) == config.train.steps  # the control never trains the retriever
    assert W.ARMS["realm"] == []
    stale = int(W.ARMS["stale"][0].split("=")[1])
    assert stale >= 30 * config.refresh.every and stale > config.train.steps


def test_arms_started_from_an_imitation_name_an_imitation_run():
    for arm, base in W.FROM_IMITATION.items():
        assert arm in W.ARMS and base in W.IMITATIONS and base in W.ARMS
        # scored as REALM arms (their curriculum and REALM steps), not as an imitation's step 0
        assert not arm.startswith("imitation")
    # the control for REALM from the imitation: the imitation's steps plus REALM's again
    assert W.IMITATIONS["imitation_x2"][0] == 2 * W.IMITATIONS["imitation"][0]


def test_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        W.main(["--arms", "realm,bogus", "--root", "/nonexistent"])
    assert "unknown arms ['bogus']" in capsys.readouterr().err


def test_unknown_mention_is_refused(capsys):
    with pytest.raises(SystemExit):
        W.main(["--mention", "nickname", "--root", "/nonexistent"])
    assert "invalid choice: 'nickname'" in capsys.readouterr().err
    assert not os.path.exists("/nonexistent")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    steps = [0, 100, 200]
    h = {k: {s: 0.1 * i for i, s in enumerate(steps)} for k, _ in W.KEYS}
    out = str(tmp_path / "plot.png")
    W.plot({"realm": h, "frozen": h}, 100, out)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_own_document_recall_counts_the_questions_own_title_in_the_top_k(tmp_path):
    import json

    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        json.dumps({"question": "Where does A live?", "title": "A"})
        + "\n"
        + json.dumps({"question": "Where does B live?", "title": "B"})
        + "\n"
    )
    preds = tmp_path / "p.jsonl"
    top = lambda *t: [{"title": x} for x in t]  # noqa: E731
    preds.write_text(
        json.dumps({"question": "Where does A live?", "top_blocks": top("A", "B")})
        + "\n"
        + json.dumps({"question": "Where does B live?", "top_blocks": top("C", "D", "E", "F", "B")})
        + "\n"
    )
    got = W.own_document_recall(str(preds), str(qa))
    # A: top 1 and top 5; B: 5th
    assert got == {"own_recall@1": 0.5, "own_recall@5": 1.0}


def _section(title, rows):
    head = "| arm | step | " + " | ".join(n for _, n in W.KEYS) + " |"
    body = [
        f"| {arm} | {step} | " + " | ".join(f"{v:.3f}" for v in vals) + " |"
        for arm, step, vals in rows
    ]
    return f"## {title}\n\n_Measured now._\n\ntext\n\n{head}\n|---|\n" + "\n".join(body) + "\n\n"


def test_seeds_summary_is_the_mean_and_range_of_each_seeds_section():
    text = (
        "# World\n\n"
        + _section(
            "Arms: realm,frozen",
            [
                ("realm", 400, [0.3, 0.5, 0.3, 0.02, 0.02]),
                ("frozen", 400, [0.1, 0.4, 0.1, 0.02, 0.04]),
            ],
        )
        + _section(
            "Arms: realm,frozen (seed 1 world)",
            [
                ("realm", 400, [0.1, 0.3, 0.2, 0.01, 0.02]),
                ("frozen", 400, [0.1, 0.35, 0.1, 0.02, 0.04]),
            ],
        )
        + _section(
            "Arms: realm,frozen (attributes, seed 1 world)",
            [("realm", 400, [0.9] * 5), ("frozen", 400, [0.9] * 5)],
        )
    )
    table = W.seeds_summary(text, "realm,frozen", [0, 1])
    realm = next(x for x in table.splitlines() if x.startswith("| realm | 400 |"))
    assert "0.200 [0.100, 0.300]" in realm  # recall@1: (0.3 + 0.1) / 2
    assert "0.400 [0.300, 0.500]" in realm  # recall@5
    frozen = next(x for x in table.splitlines() if x.startswith("| frozen | 400 |"))
    assert "0.375 [0.350, 0.400]" in frozen
    # seed 0: 0.5 > 0.4; seed 1: 0.3 < 0.35
    assert "realm above frozen in recall@5 at its last step: 1 of 2 seeds." in table
    # recall@5 differences: +10 and -5 points
    assert "realm - frozen, recall@5: +2.5 points [-5.0, +10.0]." in table
    # another world's section with the same arms is not read
    assert (
        W.seed_title("realm,frozen", 1, ("attributes",))
        == "Arms: realm,frozen (attributes, seed 1 world)"
    )
    with pytest.raises(SystemExit, match="seed 2 world"):
        W.seeds_summary(text, "realm,frozen", [0, 2])


def test_summarise_seeds_refuses_a_non_integer(capsys):
    with pytest.raises(SystemExit):
        W.main(["--summarise_seeds", "0,one", "--root", "/nonexistent"])
    assert "a comma list of integers" in capsys.readouterr().err
