"""experiments/second_retriever/squad.py: its arms are valid overrides of the configs they run
with, and an unknown arm is refused before any work."""

import os

import pytest

from experiments.second_retriever import squad as S
from realm_jax.config import load_config, validate
from tests.conftest import REPO


@pytest.mark.parametrize("arm", sorted(S.ARMS))
def test_every_arm_is_a_valid_config(arm):
    spec = S.ICT if arm == "imitation" else S.REALM
    path, variant = spec.split(":")
    overrides = [o.removeprefix("--config.") for o in S.ARMS[arm]]
    config = load_config(os.path.join(REPO, path) + f":{variant}", overrides)
    validate(config)
    if arm == "imitation":  # as many steps as the bm25 arm trains its embedders
        assert config.train.steps == S.STEPS - S.READ and config.ict.positives == "bm25"


def test_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        S.main(["--arms", "bm25,bogus", "--root", "/nonexistent"])
    assert "unknown arms ['bogus']" in capsys.readouterr().err
    assert not os.path.exists("/nonexistent")
