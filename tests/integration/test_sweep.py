"""`realm-jax sweep`: a 3-point sweep of tiny REALM runs (one fails at run time), its DONE
markers and table against the TensorBoard events the runs wrote, the re-run skipping finished
points, bad sweeps refused before anything runs, dry runs (local and TPU)."""

import csv
import json
import os
import struct

import pytest

from realm_jax import cli
from tests.conftest import REPO
from tests.support.realm_fixtures import TINY_NETWORKS

REALM = os.path.join(REPO, "configs", "realm.py")
# Tiny runs: 60 passages of the bundled sample (a quarter of them held out), random masking,
# 4 steps with the index re-embedded in-process, a held-out evaluation at steps 0 and 4.
COMMON = TINY_NETWORKS + [
    "data.block_len=64",
    "data.query_len=32",
    "data.max_predictions=5",
    "data.masking=random",
    "data.eval_split_key=doc_id",
    "data.eval_fraction=0.25",
    "train.batch_size=8",
    "train.num_candidates=4",
    "train.steps=4",
    "train.warmup_steps=1",
    "train.log_every=2",
    "train.checkpoint_every=4",
    "train.eval_every=4",
    "train.eval_batch_size=8",
    "refresh.mode=inprocess",
    "refresh.every=4",
]
# A config file of the test's own: configs/realm.py's variants, and a sweep of two held-out
# sizes (the same programs: the second point takes them from the persistent compilation cache)
# plus a point that validates but fails at run time (more candidates than blocks).
WRAPPER = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("realm_for_sweep_test", {REALM!r})
_realm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_realm)


def get_config(arg=None):
    return _realm.get_config(arg)


def sweep():
    return {{points}}
"""
POINTS = [{"train.eval_examples": 8}, {"train.eval_examples": 24}, {"train.num_candidates": 1000}]


def _config_file(tmp_path, points, name="sweep_config.py"):
    path = tmp_path / name
    path.write_text(WRAPPER.format(points=repr(points)))
    return str(path)


def _sweep(capsys, *args):
    rc = cli.main(["sweep", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _tb_scalars(tb_dir: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} read from the TFRecord event files (independent of the sweep)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for name in sorted(os.listdir(tb_dir)):
        data = open(os.path.join(tb_dir, name), "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def _csv(prefix) -> dict[str, dict[str, str]]:
    with open(os.path.join(prefix, "sweep.csv"), newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}


@pytest.fixture
def two_devices(monkeypatch, tmp_path):
    """The points' processes on 2 fake CPU devices (conftest's CHILD_DEVICES; the test process
    has more), sharing a compilation cache."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append("--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


@pytest.mark.system  # three tiny runs: CI keeps sweep validation, dry runs and tables
def test_sweep_runs_tables_and_skips_finished_points(tmp_path, capsys, two_devices):
    corpus = tmp_path / "corpus.jsonl"
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        corpus.write_text("".join(f.readlines()[:60]))
    config = _config_file(tmp_path, POINTS) + ":smoke"
    prefix = str(tmp_path / "sweep")
    args = ["--config", config, "--workdir", prefix, f"--config.data.corpus={corpus}"]
    args += [f"--config.{o}" for o in COMMON]

    rc, out, err = _sweep(capsys, *args)
    assert rc == 1, out[-3000:] + err[-3000:]  # the third point failed
    names = ["eval_examples=8", "eval_examples=24", "num_candidates=1000"]
    assert sorted(os.listdir(prefix)) == sorted(  # run_config.json: the prepare's record
        [*names, "data", "run_config.json", "sweep.csv", "sweep.json", "sweep.md"]
    )
    assert "[point 1/3 eval_examples=8] step 4/4" in out
    assert "[point 3/3 num_candidates=1000] realm-jax local: error: train.num_candidates" in out
    assert "failed points: num_candidates=1000" in err
    table = _csv(prefix)
    assert list(table) == names
    for name in names[:2]:
        workdir = os.path.join(prefix, name)
        done = json.load(open(os.path.join(workdir, "DONE")))
        assert done["step"] == 4 and done["returncode"] == 0 and done["wall_s"] > 0
        assert not os.path.exists(os.path.join(workdir, "FAILED"))
        row, tb = table[name], _tb_scalars(os.path.join(workdir, "tb"))
        assert row["status"] == "done" and row["step"] == "4"
        assert row["overrides"] == f"train.{name}"
        assert float(row["wall_s"]) == pytest.approx(done["wall_s"])
        # The final train metrics and the held-out evaluation at step 4, as TensorBoard has them.
        for key in ("loss", "accuracy", "retrieval_utility", "null_doc_prob"):
            assert float(row[f"train/{key}"]) == pytest.approx(tb[key][4], rel=1e-6), key
        for key in ("accuracy", "retrieval_utility", "retrieval_entropy"):
            assert float(row[f"eval/{key}"]) == pytest.approx(tb[f"eval/{key}"][4], rel=1e-6)
        assert row["eval_step"] == "4"
    assert [table[n]["eval/examples"] for n in names[:2]] == ["8", "24"]
    failed = table[names[2]]
    assert failed["status"] == "failed" and failed["step"] == ""
    assert json.load(open(os.path.join(prefix, names[2], "FAILED")))["returncode"] == 2
    md = open(os.path.join(prefix, "sweep.md")).read().splitlines()
    assert md[0].startswith(f"# Sweep `{config}`")
    assert "eval/retrieval_utility" in md[2] and len(md) == 4 + len(names)
    assert "| eval_examples=8 | train.eval_examples=8 | done | 4 |" in md[4]

    done_before = {n: open(os.path.join(prefix, n, "DONE")).read() for n in names[:2]}
    rc, out, err = _sweep(capsys, *args)  # the re-run: only the failed point runs again
    assert rc == 1
    for name in names[:2]:
        assert f"skipping {name}" in out
        assert f"[point 1/3 {name}]" not in out and f"[point 2/3 {name}]" not in out
        assert open(os.path.join(prefix, name, "DONE")).read() == done_before[name]
    assert "[prepare data]" in out and "[point 3/3 num_candidates=1000]" in out
    table = _csv(prefix)
    assert [r["status"] for r in table.values()] == ["skipped", "skipped", "failed"]
    assert table["eval_examples=8"]["train/loss"] != ""

    os.remove(os.path.join(prefix, "sweep.csv"))  # --table rebuilds it from disk alone
    rc, out, err = _sweep(capsys, "--table", prefix)
    assert rc == 0, err
    rebuilt = _csv(prefix)
    assert [r["status"] for r in rebuilt.values()] == ["done", "done", "failed"]
    for name in names[:2]:
        assert {k: v for k, v in rebuilt[name].items() if k != "status"} == {
            k: v for k, v in table[name].items() if k != "status"
        }


@pytest.mark.parametrize(
    "points, message",
    [
        ([{"train.lr": 1e-3}, {"train.lrr": 1e-3}], "train.lrr"),
        ([{"train.batch_size": "big"}], "train.batch_size"),
        ([{"train.lr": 1e-3}, {"train.lr": 1e-3}], "duplicate run names"),
        (None, "defines no sweep"),
    ],
)
def test_a_bad_sweep_fails_cleanly_before_running(tmp_path, capsys, points, message):
    if points is None:
        path = tmp_path / "no_sweep.py"
        path.write_text(WRAPPER.split("def sweep")[0])
        config = str(path)
    else:
        config = _config_file(tmp_path, points)
    prefix = tmp_path / "sweep"
    rc, out, err = _sweep(capsys, "--config", config + ":smoke", "--workdir", str(prefix))
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("realm-jax sweep: error: ")
    assert message in err
    assert not prefix.exists()  # nothing ran, nothing was written


def test_a_bad_common_override_is_named(tmp_path, capsys):
    rc, _, err = _sweep(
        capsys, "--config", REALM + ":smoke", "--workdir", str(tmp_path / "s"), "--config.x.y=1"
    )
    assert rc == 2 and "common overrides" in err and "x.y" in err


def test_dry_run_prints_one_line_per_point(tmp_path, capsys):
    config = _config_file(tmp_path, POINTS[:2])
    names = ("eval_examples=8", "eval_examples=24")
    prefix = str(tmp_path / "sweep")
    rc, out, _ = _sweep(capsys, "--config", config, "--workdir", prefix, "--dry_run")
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 3 and " prepare " in lines[0]  # the shared data, then each point
    for line, name in zip(lines[1:], names, strict=True):
        assert f" local --config {config}:small --workdir {prefix}/{name} " in line
        assert line.endswith(f"--config.train.{name} --config.data.data_dir={prefix}/data")
    assert not os.path.exists(prefix)


def test_only_runs_the_named_points(tmp_path, capsys):
    config = _config_file(tmp_path, POINTS[:2])
    prefix = str(tmp_path / "sweep")
    args = ["--config", config, "--workdir", prefix, "--dry_run"]
    rc, out, _ = _sweep(capsys, *args, "--only", "eval_examples=24")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2 and f"{prefix}/eval_examples=24 " in lines[1]
    rc, _, err = _sweep(capsys, *args, "--only", "eval_examples=9")
    assert rc == 2 and "no sweep point named eval_examples=9" in err


def test_tpu_dry_run_prints_one_launch_per_point(tmp_path, capfd):
    rc = cli.main(
        ["sweep", "--config", REALM, "--workdir", "/mnt/shared/lr", "--dry_run"]
        + ["--tpu", "realm-v4", "us-central2-b", "--config.train.steps=100"]
    )
    out = capfd.readouterr().out  # tpu/sweep.sh's output
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 6, out  # configs/realm.py's sweep: 3 learning rates x 2 candidates
    for line in lines:
        assert "tpu/launch.sh --wait --run lr=" in line
        assert " realm-v4 us-central2-b /mnt/shared/lr/lr=" in line
        assert " configs/realm.py:small --config.train.steps=100 --config.train.lr=" in line


SWEEP_FILES = {
    "realm": "configs/realm.py",
    "ict": "configs/ict.py",
    "orqa": "configs/orqa.py",
    "ablations": "experiments/ablations/config.py",  # the ablation study's sweep
}


@pytest.mark.parametrize("name", sorted(SWEEP_FILES))
def test_every_shipped_sweep_validates_with_its_training_command(name, tmp_path):
    from realm_jax.sweep import runner

    path = os.path.join(REPO, SWEEP_FILES[name])
    for variant in ("smoke", "small", "base", "squad"):
        points = runner.load_points(f"{path}:{variant}", str(tmp_path), [])
        assert len(points) >= 2 and len({p.name for p in points}) == len(points)
        for p in points:  # the point's overrides reached its config
            for override in p.overrides:
                key, value = override.removeprefix("--config.").split("=")
                section, field = key.split(".")
                assert str(p.config[section][field]) == value, (variant, p.name, key)
            assert (
                runner.RUN_COMMAND[p.config.task]
                == {
                    "realm": "local",
                    "ict": "train",
                    "orqa": "finetune",
                    "ablations": "local",
                }[name]
            )


def test_table_only_reads_what_a_tpu_sweep_left(tmp_path, capsys):
    """tpu/sweep.sh's DONE holds a date; the metrics come from the run's metrics.json."""
    prefix = tmp_path / "lr"
    first = prefix / "lr=5e-05,num_candidates=4"
    first.mkdir(parents=True)
    (first / "DONE").write_text("2026-11-23T05:00:00Z\n")
    metrics = {
        "step": 2000,
        "steps": 2000,
        "complete": True,
        "train": {"loss": 7.25, "grad_norm": 1.5},
        "eval_step": 2000,
        "eval": {"accuracy": 0.125, "retrieval_utility": 0.0625},
        "console_keys": {"train": ["loss"], "eval": ["accuracy", "retrieval_utility"]},
    }
    (first / "metrics.json").write_text(json.dumps(metrics))
    rc, _, err = _sweep(capsys, "--config", REALM, "--workdir", str(prefix), "--table_only")
    assert rc == 0, err
    table = _csv(prefix)
    assert len(table) == 6
    row = table["lr=5e-05,num_candidates=4"]
    assert (row["status"], row["step"], row["wall_s"]) == ("done", "2000", "")
    assert (row["train/loss"], row["train/grad_norm"]) == ("7.25", "1.5")
    assert (row["eval/accuracy"], row["eval/retrieval_utility"]) == ("0.125", "0.0625")
    assert {r["status"] for n, r in table.items() if n != row["name"]} == {"pending"}
    md = (prefix / "sweep.md").read_text().splitlines()
    assert md[2] == (
        "| name | overrides | status | step | train/loss | eval_step | eval/accuracy "
        "| eval/retrieval_utility | wall_s |"
    )  # the markdown keeps the task's console keys
    assert md[4].startswith(
        "| lr=5e-05,num_candidates=4 | train.lr=5e-05 train.num_candidates=4 | done | 2000 "
        "| 7.25 | 2000 | 0.125 | 0.0625 |  |"
    )
    (prefix / "sweep.csv").unlink()
    assert _sweep(capsys, "--table", str(prefix))[0] == 0  # from the saved plan alone
    assert _csv(prefix) == table
    rc, _, err = _sweep(capsys, "--table", str(tmp_path))
    assert rc == 2 and "sweep.json not found" in err
