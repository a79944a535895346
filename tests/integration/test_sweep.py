"""`realm-jax sweep`: a two-worker Optuna study of tiny REALM runs, checked against the SQLite
file read on its own (sqlite3) and the runs' metrics.json; the table, plots and best command;
a re-run repeating nothing; `--table` rebuilding it; dry runs (local and TPU); every shipped
sweep validating with its training command."""

import csv
import os
import re
import shlex
import sqlite3

import pytest

from realm_jax import cli
from realm_jax.config import load_config
from tests.conftest import REPO
from tests.support.sweeps import (
    ICT,
    ICT_COMMON,
    REALM,
    read_trials,
    sample_corpus,
    sweep_config,
    two_device_flags,
)

# Tiny ICT runs on 60 passages of the bundled sample, 2 steps, held-out recall at steps 0 and 2.
COMMON = ICT_COMMON + ["train.steps=2", "train.checkpoint_every=2", "train.eval_every=2"]
# The test's config files: ICT's variants by default and a search over fields that do not change
# the compiled programs (the seed, the log interval), so that both trials and a re-run share them;
# the held-out recall differs with the seed.
SEARCH = """space.Search(
    params={"train.seed": space.integer(0, 10**6), "train.log_every": space.choice([1, 2])},
    objective="eval/recall@20", sampler="random", pruner="none", trials=2, seed=0)"""
GRID = "[{'train.eval_examples': 8}, {'train.eval_examples': 24}, {'train.lr': 1e-3}]"


def _sweep(capture, *args):
    """cli.main's exit status and output (capfd: the workers' and trainers' too)."""
    rc = cli.main(["sweep", *args])
    out, err = capture.readouterr()
    return rc, out, err


def _csv(prefix) -> list[dict]:
    with open(os.path.join(prefix, "sweep.csv"), newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def two_devices(monkeypatch, tmp_path):
    """The trials' processes on 2 fake CPU devices."""
    monkeypatch.setenv("XLA_FLAGS", two_device_flags(os.environ.get("XLA_FLAGS", "")))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_a_two_worker_study(tmp_path, capfd, two_devices):
    import json

    corpus = sample_corpus(tmp_path)
    config = sweep_config(tmp_path, SEARCH) + ":smoke"
    prefix = str(tmp_path / "sweep")
    args = ["--config", config, "--workdir", prefix, "--workers", "2"]
    args += [f"--config.data.corpus={corpus}", *(f"--config.{o}" for o in COMMON)]

    rc, out, err = _sweep(capfd, *args)
    assert rc == 0, out[-4000:] + err[-3000:]
    db = read_trials(prefix)
    assert sorted(db) == [0, 1] and {t["state"] for t in db.values()} == {"COMPLETE"}
    a, b = db[0], db[1]
    assert a["params"] != b["params"]  # two points of the space
    assert a["start"] < b["end"] and b["start"] < a["end"]  # run side by side
    assert {t["attrs"]["worker"] for t in db.values()}.__len__() == 2  # by the two workers
    for number, t in db.items():  # the objective is the run's own held-out value
        workdir = t["attrs"]["workdir"]
        assert workdir == os.path.join(prefix, t["attrs"]["name"])
        metrics = json.load(open(os.path.join(workdir, "metrics.json")))
        assert metrics["complete"] and metrics["eval_step"] == 2
        assert t["values"] == [pytest.approx(metrics["eval"]["recall@20"], rel=1e-9)]
        run = load_config(
            config, [o.removeprefix("--config.") for o in args if o[:9] == "--config."]
        )
        seed = int(t["params"]["train.seed"])
        assert f"--config.train.seed={seed}" in open(os.path.join(workdir, "sweep.log")).read()
        assert f"[trial {number} " in out and run.train.steps == 2
    # One progress line a trial. The first reads the study when its own trial ends: the other
    # trial is then running, or (when both end within the same moment) complete already.
    lines = re.findall(
        r"sweep: trial (\d) COMPLETE \S+ in .* \| (\d) of 2 done \((\d) complete, 0 pruned\), "
        r"0 failed, (\d) running; best \S+ \(trial (\d)\); ETA ",
        out,
    )
    assert sorted(int(line[0]) for line in lines) == [0, 1], out[-4000:]
    counts = sorted(tuple(map(int, line[1:4])) for line in lines)
    assert counts in ([(1, 1, 1), (2, 2, 0)], [(2, 2, 0), (2, 2, 0)]), lines
    assert db[int(lines[-1][4])]["values"][0] == max(t["values"][0] for t in db.values())

    table = _csv(prefix)
    assert [int(r["trial"]) for r in table] == [0, 1]
    for r in table:
        t = db[int(r["trial"])]
        assert r["state"] == "COMPLETE" and r["step"] == "2"
        assert float(r["value"]) == pytest.approx(t["values"][0], rel=1e-9)
        assert f"train.seed={int(t['params']['train.seed'])}" in r["params"]
    md = open(os.path.join(prefix, "sweep.md")).read()
    assert md.startswith(f"# Sweep `{config}`") and "| 0 | seed=" in md and "| 1 | seed=" in md
    for png in ("optimization_history.png", "param_importances.png", "intermediate_values.png"):
        with open(os.path.join(prefix, "plots", png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png

    # the best command trains the best trial's point
    best = max(db, key=lambda n: db[n]["values"][0])
    line = next(x for x in out.splitlines() if x.startswith("sweep: the best trial's config: "))
    argv = shlex.split(line.split(": ", 2)[2])
    assert argv[3:8] == ["train", "--config", config, "--workdir", os.path.join(prefix, "best")]
    assert line.split(": ", 2)[2] in md
    got = load_config(config, [a.removeprefix("--config.") for a in argv[8:]])
    assert got.train.seed == int(db[best]["params"]["train.seed"])
    assert got.train.log_every == [1, 2][int(db[best]["params"]["train.log_every"])]

    # the same command again: nothing is repeated
    rc, out, err = _sweep(capfd, *args)
    assert rc == 0, err
    assert "[trial" not in out and sorted(read_trials(prefix)) == [0, 1]
    assert "every trial of the study is finished" in out and " prepare " not in out

    os.remove(os.path.join(prefix, "sweep.csv"))  # --table rebuilds it from the study alone
    rc, out, err = _sweep(capfd, "--table", prefix)
    assert rc == 0, err
    assert _csv(prefix) == table


def test_dry_run_prints_the_prepare_and_the_trials(tmp_path, capsys):
    config = sweep_config(tmp_path, GRID, task=REALM)
    prefix = str(tmp_path / "sweep")
    rc, out, _ = _sweep(capsys, "--config", config, "--workdir", prefix, "--dry_run")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("sweep: a grid of 3 points, objective eval/accuracy")
    assert " prepare " in lines[1] and lines[1].endswith(f"--config.data.data_dir={prefix}/data")
    trials = [x for x in lines if " local " in x]
    names = ["eval_examples=8", "eval_examples=24", "lr=0.001"]
    for line, name in zip(trials, names, strict=True):
        assert f" local --config {config}:small --workdir {prefix}/{name} " in line
        assert line.endswith(f"--config.data.data_dir={prefix}/data")
    assert not os.path.exists(prefix)

    search = sweep_config(tmp_path, SEARCH, name="search.py")  # ICT: `train`
    rc, out, _ = _sweep(capsys, "--config", search, "--workdir", prefix, "--dry_run",
                        "--workers", "2")  # fmt: skip
    assert rc == 0 and out.count("# worker ") == 2
    assert " train --config " in out and " local " not in out
    assert "'--config.train.seed=<integer>' '--config.train.log_every=<choice>'" in out


def test_tpu_dry_run_prints_one_launch_per_slice(tmp_path, capsys):
    rc, out, err = _sweep(
        capsys, "--config", REALM, "--workdir", "/mnt/shared/lr", "--dry_run",
        "--tpu", "realm-a:us-central2-b,realm-b:europe-west4-a", "--storage", "grpc://10.0.0.2:13000",
        "--config.train.steps=100",
    )  # fmt: skip
    assert rc == 0, err
    launches = [x for x in out.splitlines() if "tpu/launch.sh" in x]
    assert len(launches) == 6  # configs/realm.py's grid: 3 learning rates x 2 candidates
    for i, line in enumerate(launches):
        slice_ = ("realm-a us-central2-b", "realm-b europe-west4-a")[i // 3]  # worker 0, 1
        assert " --wait --run lr=" in line and "--env 'REALM_JAX_TRIAL={...}'" in line
        assert f" {slice_} /mnt/shared/lr/lr=" in line
        assert " configs/realm.py:small --config.train.steps=100 --config.train.lr=" in line
    assert " prepare " not in out  # with --tpu the data is prepared beforehand


SWEEP_FILES = {
    "realm": "configs/realm.py",
    "ict": "configs/ict.py",
    "orqa": "configs/orqa.py",
    "ablations": "experiments/ablations/config.py",  # the ablation study's sweep
}


@pytest.mark.parametrize("name", sorted(SWEEP_FILES))
def test_every_shipped_sweep_validates_with_its_training_command(name):
    from realm_jax.sweep import space

    path = os.path.join(REPO, SWEEP_FILES[name])
    for variant in ("smoke", "small", "base", "squad", "world"):
        if name == "ablations" and variant == "world":
            continue
        study = space.load(f"{path}:{variant}")  # every point (a search: its ends) validated
        command = {"realm": "local", "ict": "train", "orqa": "finetune", "ablations": "local"}
        assert space.RUN_COMMAND[study.task] == command[name]
        if study.kind == "grid":
            assert len(study.points) >= 2
            for point in study.points:  # the point's overrides reach its config
                config = space.point_config(study, point)
                for key, value in point.items():
                    section, field = key.split(".")
                    assert config[section][field] == value, (variant, key)
        else:
            assert study.trials >= 2 and len(study.params) >= 2


def test_heartbeats_and_the_table_through_the_grpc_proxy(tmp_path, capsys):
    """`python -m realm_jax.sweep.proxy` in front of a SQLite file: a trial whose worker stopped
    beating is failed and enqueued again through it, and `sweep --table` reads the study there."""
    import socket
    import subprocess
    import sys
    import time

    import optuna

    from realm_jax.sweep import storage

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = f"sqlite:///{tmp_path}/study.db"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "realm_jax.sweep.proxy", "--storage", db, "--host", "127.0.0.1",
         "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"grpc://127.0.0.1:{port}"
        st = storage.open_storage(url)
        study = optuna.create_study(storage=st, study_name="sweep")
        attrs = {"spec": f"{ICT}:smoke", "extra": [], "task": "ict", "kind": "search",
                 "objective": "eval/recall@5"}  # fmt: skip
        study.set_user_attr("realm_jax", attrs)
        lost, alive = study.ask(), study.ask()
        for t in (lost, alive):
            t.suggest_int("train.seed", 0, 100)
            t.set_user_attr("workdir", str(tmp_path / f"t{t.number}"))
        time.sleep(0.5)
        storage.beat(st, alive._trial_id)
        assert storage.fail_stale(study, grace_s=0.3) == [lost.number]
        states = [t.state.name for t in study.get_trials()]
        assert states == ["FAIL", "RUNNING", "WAITING"]
        study.tell(alive, 0.5)
        rc = cli.main(["sweep", "--table", str(tmp_path / "sw"), "--storage", url])
        out, err = capsys.readouterr()
        assert rc == 0, err
        table = _csv(str(tmp_path / "sw"))
        assert [r["state"][:4] for r in table] == ["FAIL", "COMP", "WAIT"]
        assert "--workdir " + str(tmp_path / "sw" / "best") in out
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    # the proxy served the SQLite file: the trials are there
    con = sqlite3.connect(f"{tmp_path}/study.db")
    assert [s for (s,) in con.execute("SELECT state FROM trials ORDER BY number")] == [
        "FAIL", "COMPLETE", "WAITING"
    ]  # fmt: skip
    con.close()
