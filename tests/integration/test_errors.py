"""Clean errors: every expected error (bad input, config, data, weights, workdir) is one line
`realm-jax <command>: error: <message>` on stderr with exit code 2, before any model is
compiled or any checkpoint written; -v adds the traceback; anything else keeps its traceback
and exits 1. The cases are acceptance/bad_input.py's (the table in docs/reliability.md)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from acceptance import bad_input as R
from realm_jax import cli
from realm_jax.config import ConfigError, load_config, validate
from tests.conftest import REPO


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The cases' inputs, the prepared sample (random masking: seconds) and a 'trained'
    workdir (its checkpoints and index faked) for the overwrite warning."""
    tmp = str(tmp_path_factory.mktemp("errors"))
    R.write_inputs(tmp)
    data = R.prepare_sample(os.path.join(tmp, "sample"))
    R.make_trained(tmp, data)
    return tmp, data


def _command(case: R.Case) -> str:
    return case.args[0]


@pytest.mark.parametrize("case", R.CASES, ids=[c.name for c in R.CASES])
def test_bad_input_is_one_line_and_exit_2(root, case):
    tmp, data = root
    r = R.run_case(case, tmp, data)
    assert r.returncode == case.exit, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.lines) == 1, r.stderr[-3000:]
    (line,) = r.lines
    kind = "error" if case.exit == 2 else "warning"
    assert line.startswith(f"realm-jax {_command(case)}: {kind}: "), line
    assert case.expect in line, line
    if case.exit == 2:  # nothing trained, nothing published
        run = os.path.join(tmp, "runs", case.name)
        ckpt = os.path.join(run, "checkpoints")
        assert not os.path.isdir(ckpt) or not os.listdir(ckpt), os.listdir(ckpt)
        assert not os.path.exists(os.path.join(run, "index"))
    assert r.seconds < 30, f"{case.name} took {r.seconds:.1f}s: it should fail before work"


def test_bad_corpus_writes_nothing(root):
    tmp, _ = root
    (case,) = [c for c in R.CASES if c.name == "corpus_bad_line"]
    r = R.run_case(case, tmp)
    assert r.returncode == 2
    assert not os.path.exists(os.path.join(tmp, "runs", case.name, "data"))  # no partial data
    assert "\r" not in r.stderr.split("realm-jax prepare: error:")[1]  # not after a half bar


def test_verbose_adds_the_traceback(root):
    tmp, data = root
    (case,) = [c for c in R.CASES if c.name == "weights_pickle"]
    r = R.run_case(case, tmp, data, verbose=True)
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert "realm_jax.interop.hf_import.WeightImportError: " in r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == r.lines[0]  # the one line still comes last
    assert r.lines[0].startswith("realm-jax train: error: ") and "pickles" in r.lines[0]
    quiet = R.run_case(case, tmp, data)
    assert "Traceback" not in quiet.stderr and quiet.lines == r.lines


def test_an_unexpected_exception_keeps_its_traceback_and_exit_1(tmp_path):
    bad = tmp_path / "no_data_section.py"
    bad.write_text(
        "import ml_collections\n\ndef get_config(arg=None):\n"
        "    return ml_collections.ConfigDict({'task': 'realm'})\n"
    )
    out = R.cli("prepare", "--workdir", str(tmp_path / "run"), "--config", str(bad))
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert "error:" not in out.stderr.splitlines()[-1]


def _raise(error):
    raise error


def test_which_errors_are_expected():
    from realm_jax.data.corpus import CorpusError
    from realm_jax.train.loop import TrainingStopped

    def caught(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            return e
        raise AssertionError("no exception")

    # realm_jax's own error classes, wherever raised (here: from a test's frame)
    assert cli.is_expected(caught(lambda: _raise(CorpusError("x.jsonl:2: bad"))))
    assert cli.is_expected(caught(lambda: _raise(ConfigError("train.lr=0: must be positive"))))
    # ValueError / FileNotFoundError: expected when realm_jax's code raised them ...
    own = caught(lambda: load_config("configs/realm.py:smoke", ["nonsense"]))
    assert isinstance(own, ConfigError) and cli.is_expected(own)
    from realm_jax.data import datasets

    own_value = caught(lambda: datasets.examples_source("/nonexistent", "dev"))
    assert type(own_value) is ValueError and cli.is_expected(own_value)
    # ... not when a library (or the test itself) did: a bug, with its traceback
    assert not cli.is_expected(caught(lambda: np.reshape(np.arange(3), (2, 2))))
    assert not cli.is_expected(caught(lambda: _raise(ValueError("from a test"))))
    assert not cli.is_expected(caught(lambda: _raise(KeyError("k"))))
    assert not cli.is_expected(TrainingStopped("stopped"))  # its own line, exit 1
    assert cli.error_line("train", ValueError("a\n  b")) == "realm-jax train: error: a b"


@pytest.mark.parametrize("name", ["realm", "ict", "orqa"])
@pytest.mark.parametrize("variant", ["smoke", "small", "base", "squad"])
def test_every_shipped_variant_validates(name, variant):
    validate(load_config(os.path.join(REPO, "configs", f"{name}.py:{variant}")))


def test_validate_names_every_bad_field_at_once():
    config = load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"),
        ["train.batch_size=-1", "data.masking=ner", "train.lr=0"],
    )
    with pytest.raises(ConfigError) as e:
        validate(config)
    msg = str(e.value)
    assert "data.masking='ner': must be one of salient, random" in msg
    assert "train.batch_size=-1: must be at least 1" in msg
    assert "train.lr=0.0: must be positive" in msg


def test_the_cli_validates_before_jax_starts(tmp_path):
    """A config error never imports JAX (nor creates the workdir)."""
    code = (
        "import sys\nfrom realm_jax import cli\n"
        f"rc = cli.main(['train', '--workdir', {str(tmp_path / 'run')!r}, "
        "'--config.train.batch_size=0'])\n"
        "assert rc == 2, rc\nassert 'jax' not in sys.modules, 'jax imported'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=R.env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == ("realm-jax train: error: train.batch_size=0: must be at least 1")
    assert not (tmp_path / "run").exists()
