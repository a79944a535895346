"""run_record: how a command's config is decided from the workdir's run_config.json (issue 59),
and the held-out hint of a small corpus. Pure Python, no CLI process."""

import os

import pytest

from realm_jax import run_record as rr
from realm_jax.config import ConfigError
from realm_jax.data import datasets
from tests.conftest import REPO

REALM = os.path.join(REPO, "configs", "realm.py") + ":squad"
ORQA = os.path.join(REPO, "configs", "orqa.py") + ":squad"


def _checkpoints(workdir, *steps):
    for s in steps:
        os.makedirs(os.path.join(workdir, "checkpoints", str(s)), exist_ok=True)


def test_no_record_takes_the_command_line(tmp_path):
    got = rr.resolve("train", str(tmp_path), None, ["train.lr=1e-3"])
    assert got.spec.endswith("configs/realm.py:smoke") and got.overrides == ["train.lr=1e-3"]
    assert not got.from_record and not got.notes


def test_no_config_takes_the_record_and_overrides_on_top(tmp_path):
    w = str(tmp_path)
    rr.write(w, REALM, ["data.corpus=a.jsonl", "train.lr=1e-4"], "prepare", True)
    got = rr.resolve("train", w, None, ["train.lr=3e-4", "train.steps=5"])
    assert got.from_record and got.spec == rr.normalize(REALM)
    assert got.overrides == ["data.corpus=a.jsonl", "train.lr=3e-4", "train.steps=5"]


def test_the_same_config_merges_a_settled_record(tmp_path):
    w = str(tmp_path)
    rr.write(w, REALM, ["data.corpus=a.jsonl"], "train", False)
    _checkpoints(w, 0, 100)  # a run past its first step: settled though not finished
    got = rr.resolve("train", w, REALM, ["train.steps=800"])
    assert got.from_record and got.overrides == ["data.corpus=a.jsonl", "train.steps=800"]


def test_a_failed_first_run_never_blocks_its_rerun(tmp_path):
    """Not finished, no checkpoint past 0: --config with other overrides replaces the record."""
    w = str(tmp_path)
    rr.write(w, REALM, ["data.corpus=wrong.jsonl", "train.lr=9"], "train", False)
    _checkpoints(w, 0)
    got = rr.resolve("train", w, REALM, ["data.corpus=right.jsonl"])
    assert not got.from_record and got.overrides == ["data.corpus=right.jsonl"]
    (note,) = got.notes
    assert "did not finish" in note and "--config.train.lr=9" in note
    # another config on it is taken too (checkpoint 0 is no trained state)
    got = rr.resolve("train", w, ORQA, [])
    assert got.spec == ORQA and got.overrides == [] and "not the recorded config" in got.notes[0]


def test_another_config_on_a_trained_workdir(tmp_path):
    w = str(tmp_path)
    rr.write(w, REALM, ["data.corpus=a.jsonl"], "train", True)
    _checkpoints(w, 0, 400)
    with pytest.raises(ConfigError, match="omit --config to go on with the recorded one"):
        rr.resolve("train", w, ORQA, [])
    got = rr.resolve("evaluate", w, ORQA, ["qa.dev_file=q.jsonl"])  # not training: a warning
    assert got.spec == ORQA and got.overrides == ["qa.dev_file=q.jsonl"] and got.notes


def test_merged_keeps_one_override_per_key():
    assert rr.merged(["a.b=1", "c.d=2"], ["a.b=3", "--config.e.f=4"]) == [
        "a.b=3",
        "c.d=2",
        "--config.e.f=4",
    ]


def test_describe_names_what_changes(tmp_path):
    from realm_jax.config import load_config

    w = str(tmp_path)
    rr.write(w, REALM, ["data.corpus=a.jsonl", "train.lr=1e-4"], "prepare", True)
    got = rr.resolve("train", w, None, ["train.lr=3e-4", "train.steps=400"])
    before = load_config(got.spec, ["data.corpus=a.jsonl", "train.lr=1e-4"])
    after = load_config(got.spec, got.overrides)
    line = rr.describe(w, got, ["train.lr=3e-4", "train.steps=400"], before, after)
    assert line.startswith(f"workdir {w}: config ")
    assert "configs/realm.py:squad + 2 recorded overrides" in line
    assert line.endswith("this command changes train.lr 0.0001 -> 0.0003"), line  # 400: as is


def test_fraction_for_one_holds_out_one():
    keys = ["Materialism", "Political philosophy", "Buddhism"]
    f = datasets.fraction_for_one(keys, 0)
    assert 0 < f < 1
    assert sum(datasets.is_eval(k, f, 0) for k in keys) >= 1
    assert sum(datasets.is_eval(k, f - 0.01, 0) for k in keys) == 0


def test_a_stale_checkpoint_0_is_set_aside_not_blocking(tmp_path):
    """A first run that stopped after checkpoint 0 (the initial state): its rerun on other data
    or config moves it aside and starts afresh; a checkpoint of a run that trained is kept."""
    import numpy as np

    from realm_jax import checkpoint
    from realm_jax.train import loop

    w = str(tmp_path / "run")
    mgr = checkpoint.manager(w, with_data=False)
    mgr.fingerprint = {"datasets.fingerprint": "old"}
    checkpoint.save(mgr, 0, {"w": np.zeros(3, np.float32)})
    mgr.wait_until_finished()
    loop.drop_stale_start(mgr, {"datasets.fingerprint": "old"})  # the same: kept
    assert list(mgr.all_steps()) == [0]
    loop.drop_stale_start(mgr, {"datasets.fingerprint": "new"})
    assert list(mgr.all_steps()) == []
    assert os.listdir(os.path.join(w, "checkpoints-damaged"))[0].startswith("0-")
    mgr.fingerprint = {"datasets.fingerprint": "old"}
    for step in (0, 5):
        checkpoint.save(mgr, step, {"w": np.zeros(3, np.float32)}, force=True)
        mgr.wait_until_finished()
    loop.drop_stale_start(mgr, {"datasets.fingerprint": "new"})  # trained: left to the resume
    assert list(mgr.all_steps()) == [0, 5]


def test_the_same_command_again_says_nothing(tmp_path):
    from realm_jax.config import load_config

    w = str(tmp_path)
    given = ["data.corpus=a.jsonl", "train.lr=1e-4"]
    rr.write(w, REALM, given, "train", True)
    got = rr.resolve("train", w, REALM, given)
    cfg = load_config(got.spec, got.overrides)
    assert rr.describe(w, got, given, cfg, cfg, explicit=True) is None
    # without --config the recorded (non-default) config is worth a line
    got = rr.resolve("train", w, None, given)
    assert "configs/realm.py:squad + 2 recorded overrides" in rr.describe(w, got, given, cfg, cfg)


def test_relative_paths_are_read_from_where_they_were_recorded(tmp_path, monkeypatch):
    there, here = tmp_path / "there", tmp_path / "here"
    (there / "runs" / "mine-data").mkdir(parents=True)
    here.mkdir()
    w = str(tmp_path / "work")
    monkeypatch.chdir(there)
    rr.write(w, REALM, ["data.data_dir=runs/mine-data", "train.lr=1e-4", "data.corpus=gone.jsonl"],
             "prepare", True)  # fmt: skip
    monkeypatch.chdir(here)
    got = rr.resolve("train", w, None, [])
    assert got.overrides == [
        f"data.data_dir={there / 'runs' / 'mine-data'}",
        "train.lr=1e-4",
        "data.corpus=gone.jsonl",  # nowhere: left as recorded (its error names it)
    ]
