"""A tiny REALM run's instruments (issue 58): MFU, goodput and its split in metrics.json,
the same figures in TensorBoard and on the console line, and train.profile_steps' trace
under the workdir, where TensorBoard's profile plugin opens it."""

import glob
import json
import os

import pytest

from realm_jax import workdir as paths
from realm_jax.pretrain import commands as pretrain_commands
from realm_jax.train import goodput
from realm_jax.train.metrics import read_scalars
from tests.conftest import prepare_sample_head
from tests.support.runs import realm_config as config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_sample_head(tmp_path_factory, config, 60)


def test_a_run_reports_mfu_goodput_and_writes_its_profile(data_dir, tmp_path, capsys):
    work = str(tmp_path / "run")
    over = ["train.steps=4", "train.log_every=2", "train.profile_steps=2:3"]
    pretrain_commands.train(config(f"data.data_dir={data_dir}", *over), work)

    out = json.loads(open(paths.metrics_path(work)).read())
    assert 0 < out["mfu"] < 1 and 0 < out["goodput"] < 1
    split = out["goodput_split"]
    assert set(split) == {*goodput.PARTS, "wall"} and min(split.values()) >= 0
    parts = sum(split[k] for k in goodput.PARTS)
    assert parts == pytest.approx(split["wall"], rel=1e-6)
    assert split["compile"] > 0 and split["redone"] == 0
    assert out["instruments"]["examples_per_sec"] > 0 and out["instruments"]["compile_seconds"] > 0

    tags = read_scalars(work)
    for tag in ("mfu", "goodput", "goodput/data", "step_time", "tokens_per_sec", "memory_gib"):
        assert sorted(tags[tag]) == [2, 4], tag
    assert "MFU " in capsys.readouterr().out

    traces = glob.glob(os.path.join(paths.profile_dir(work), "plugins", "profile", "*", "*"))
    assert [t for t in traces if t.endswith(".xplane.pb")], traces
