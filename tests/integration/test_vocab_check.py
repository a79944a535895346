"""A model.vocab_size below the prepared data's vocabulary (bert-base-uncased's 30,522 wordpieces)
would index past the embedding table and embed NaNs silently (every loss NaN): each command that
embeds prepared tokens refuses it before anything is built, in one error line (exit 2) naming the
field and the vocabulary's size (data/datasets.py check_vocab). A prepare records the size in its
summary; an older prepare's folder is checked against the bundled tokenizer's."""

import json
import os
import shutil

import pytest

from realm_jax import cli
from realm_jax.config import ConfigError, load_config
from realm_jax.data import datasets
from tests.conftest import REPO, prepare_sample_head, run_cli
from tests.support.realm_fixtures import TINY_NETWORKS

CONFIGS = {
    task: os.path.join(REPO, "configs", f"{name}.py") + ":smoke"
    for task, name in (("ict", "ict"), ("realm", "realm"), ("qa", "orqa"))
}
VOCAB = 30522
# Tiny runs of one step (on the old code each went on to train, or to fail otherwise)
OVERRIDES = TINY_NETWORKS + [
    "data.block_len=64",
    "data.query_len=32",
    "data.masking=random",
    "train.batch_size=8",
    "train.steps=1",
    "refresh.mode=inprocess",
]
ERROR = (
    "model.vocab_size=512 is smaller than the vocabulary of the token ids prepared in {ddir} "
    f"({VOCAB} wordpieces): ids from 512 up would index past the embedding table (NaN losses); "
    f"set --config.model.vocab_size={VOCAB} (or more)"
)


def _config(task: str, *extra: str):
    return load_config(CONFIGS[task], OVERRIDES + list(extra))


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    """The sample's first 20 passages, prepared."""
    return prepare_sample_head(tmp_path_factory, lambda *o: _config("ict", *o), 20)


def test_the_summary_records_the_vocabulary(ddir):
    assert datasets.load_summary(ddir)["vocab_size"] == VOCAB
    datasets.check_vocab(_config("ict", f"model.vocab_size={VOCAB}"), ddir)  # it fits
    datasets.check_vocab(_config("ict", "model.vocab_size=30720"), ddir)  # padded: fits too


def test_an_older_prepare_is_checked_against_the_tokenizer(ddir, tmp_path):
    old = str(tmp_path / "old")
    shutil.copytree(ddir, old)
    path = os.path.join(old, datasets.SUMMARY)
    summary = json.load(open(path))
    del summary["vocab_size"]
    with open(path, "w") as f:
        json.dump(summary, f)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=512 .*\(30522 wordpieces\)"):
        datasets.check_vocab(_config("ict", "model.vocab_size=512"), old)
    datasets.check_vocab(_config("ict"), old)


COMMANDS = [  # (command, the config's task, its flags)
    ("ict", "ict", []),
    ("train", "realm", []),
    ("local", "realm", []),
    ("finetune", "qa", []),
    ("evaluate", "qa", ["--checkpoint", "initial"]),  # the warm start: no checkpoint needed
]


@pytest.mark.parametrize("command, task, flags", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_each_command_refuses_a_vocabulary_below_the_data(
    ddir, tmp_path, capsys, command, task, flags
):
    work = str(tmp_path / "work")
    argv = [command, "--config", CONFIGS[task], "--workdir", work, *flags]
    argv += [f"--config.{o}" for o in OVERRIDES]
    argv += [f"--config.data.data_dir={ddir}", "--config.model.vocab_size=512"]
    rc = cli.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert rc == 2 and err == [f"realm-jax {command}: error: " + ERROR.format(ddir=ddir)], err
    assert not os.path.exists(os.path.join(work, "checkpoints"))  # nothing trained


def test_one_line_from_the_refresh_job(ddir, tmp_path):
    """As a user sees it (a process of its own, its logging at INFO): one line on stderr."""
    work = str(tmp_path / "work")
    argv = ["refresh", "--config", CONFIGS["realm"], "--workdir", work, "--max_versions", "1"]
    argv += [f"--config.{o}" for o in OVERRIDES]
    argv += [f"--config.data.data_dir={ddir}", "--config.model.vocab_size=512"]
    r = run_cli(*argv, timeout=120)  # the old code waited for a checkpoint to embed with
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == ["realm-jax refresh: error: " + ERROR.format(ddir=ddir)]
