"""The sweep engine's parts that run no training: a config's sweep() read and checked (one
error line, exit 2, before anything runs), the workers' devices (worker_env), the storage URLs,
lost trials failed and retried once (heartbeats), and the table's states and best command."""

import json
import os
import shlex
import time

import pytest

from realm_jax import cli
from realm_jax.config import ConfigError, load_config
from realm_jax.sweep import devices, space, storage, table
from tests.support.sweeps import REALM, sweep_config


def _config(tmp_path, body: str) -> str:
    """A config file with REALM's variants and this sweep()."""
    return sweep_config(tmp_path, body, task=REALM)


def test_a_search_is_read_with_its_controls(tmp_path):
    body = """space.Search(
        params={"train.lr": space.log_uniform(1e-5, 1e-3),
                "train.num_candidates": space.choice([8, 16]),
                "train.warmup_steps": space.integer(0, 100, step=10),
                "train.embedder_lr_scale": space.uniform(0.05, 1.0)},
        objective="title_recall@5", sampler="tpe", pruner="hyperband", trials=7, seed=3)"""
    study = space.load(_config(tmp_path, body) + ":smoke", ["train.steps=10"])
    assert (study.kind, study.trials, study.seed, study.task) == ("search", 7, 3, "realm")
    assert study.objective == "eval/title_recall@5" and study.direction == "maximize"
    assert study.extra == ["train.steps=10"] and study.spec.endswith(":smoke")
    d = study.distributions()
    assert d["train.lr"].log and (d["train.lr"].low, d["train.lr"].high) == (1e-5, 1e-3)
    assert d["train.num_candidates"].choices == (8, 16)
    assert (d["train.warmup_steps"].low, d["train.warmup_steps"].step) == (0, 10)
    assert not d["train.embedder_lr_scale"].log
    assert study.pruner_spec() == {"name": "hyperband"}
    assert study.make_sampler(1)._rng.rng.randint(1000) != study.make_sampler(0)._rng.rng.randint(
        1000
    )  # workers do not propose the same points


def test_a_plain_list_is_a_grid_with_the_task_default_objective(tmp_path):
    body = "[{'train.lr': 1e-4, 'train.num_candidates': 4}, {'train.lr': 3e-4}]"
    study = space.load(_config(tmp_path, body) + ":smoke")
    assert study.kind == "grid" and study.objective == "eval/accuracy" and study.pruner == "none"
    assert study.points == [{"train.lr": 1e-4, "train.num_candidates": 4}, {"train.lr": 3e-4}]
    assert study.params["train.lr"].values == (1e-4, 3e-4)
    assert space.overrides(study.points[0]) == ["train.lr=0.0001", "train.num_candidates=4"]
    assert space.run_name(study.points[0]) == "lr=0.0001,num_candidates=4"
    # a search's floats are named to 4 digits; the override keeps every digit
    assert space.run_name({"train.lr": 0.000123456789}) == "lr=0.0001235"
    assert space.overrides({"train.lr": 0.000123456789}) == ["train.lr=0.000123456789"]


def test_grid_sampler_expands_the_choices(tmp_path):
    body = """space.Search(params={"train.lr": space.choice([1e-4, 3e-4]),
        "train.num_candidates": space.choice([4, 8])}, sampler="grid", pruner="median")"""
    study = space.load(_config(tmp_path, body) + ":smoke")
    assert study.kind == "grid" and len(study.points) == 4 and study.pruner == "median"
    assert {(p["train.lr"], p["train.num_candidates"]) for p in study.points} == {
        (a, b) for a in (1e-4, 3e-4) for b in (4, 8)
    }


def test_the_shipped_world_search_is_the_measured_study():
    study = space.load(f"{REALM}:world")
    assert study.kind == "search" and study.objective == "eval/title_recall@5"
    assert set(study.params) == {"train.lr", "train.embedder_lr_scale", "train.num_candidates"}
    assert study.pruner == "median" and study.direction == "maximize"
    for k in study.params["train.num_candidates"].values:  # recall@5 is evaluated with each
        config = load_config(f"{REALM}:world", [f"train.num_candidates={k}"])
        assert "eval/title_recall@5" in space.eval_metrics(config)
    assert space.load(f"{REALM}:small").kind == "grid"  # the other variants keep the grid


BAD = [
    ('space.Search(params={"train.lr": space.log_uniform(0, 1e-3)})', "log scale needs low > 0"),
    ('space.Search(params={"train.lr": space.uniform(1e-3, 1e-4)})', "finite low < high"),
    ('space.Search(params={"train.lrr": space.log_uniform(1e-5, 1e-3)})', "train.lrr"),
    ('space.Search(params={"train.lr": 1e-4})', "is not a space.log_uniform"),
    ('space.Search(params={})', "needs params="),
    ('space.Search(params={"train.batch_size": space.choice(["big"])})', "train.batch_size"),
    ('space.Search(params={"train.steps": space.integer(1.5, 4)})', "integer() needs int"),
    ('space.Search(params={"train.lr": space.choice([])})', "non-empty list"),
    ('space.Search(params={"train.lr": space.choice([(1, 2)])})', "must be bool, int"),
    ('space.Search(params={"train.lr": space.log_uniform(1e-5, 1e-3)}, sampler="bayes")',
     "sampler 'bayes': must be one of tpe, random, cmaes, grid"),
    ('space.Search(params={"train.lr": space.log_uniform(1e-5, 1e-3)}, pruner="asha")',
     "pruner 'asha': must be one of median, halving, hyperband, none"),
    ('space.Search(params={"train.lr": space.log_uniform(1e-5, 1e-3)}, pruner_args={"x": 1})',
     "unexpected keyword argument 'x'"),
    ('space.Search(params={"train.lr": space.log_uniform(1e-5, 1e-3)}, trials=0)',
     "trials must be a whole number >= 1"),
    ('space.Search(params={"train.lr": space.uniform(1e-5, 1e-3)}, sampler="grid")',
     "sampler='grid' takes choice() params only"),
    ('space.Search(params={"train.lr": space.log_uniform(1e-5, 1e-3)}, objective="eval/bleu")',
     "the objective eval/bleu is not a metric the realm evaluation gives"),
    # recall@5 needs K - 1 >= 5 candidates: the search's choice of 4 is refused by name
    ('space.Search(params={"train.num_candidates": space.choice([8, 4])}, '
     'objective="eval/title_recall@5")', "the search with train.num_candidates=4"),
    ('space.Grid([{"train.lr": 1e-4}], direction="up")', "direction 'up' must be one of"),
    ("[{'train.lr': 1e-4}, {'train.lr': 1e-4}]", "duplicate run names"),
    ("[{'train.lr': 1e-4}, {'train.lrr': 1e-4}]", "sweep point 1"),
    ("[]", "returned no points"),
    ("{'train.lr': 1e-4}", "must return a list of override dicts, space.Grid or space.Search"),
    ("[{'train.lr': space.log_uniform(1e-5, 1e-3)}]", "is a search parameter"),
    ("1 / 0", "sweep() raised ZeroDivisionError"),
]  # fmt: skip


@pytest.mark.parametrize("body, message", BAD)
def test_a_bad_sweep_is_one_line_exit_2_before_anything_runs(tmp_path, capsys, body, message):
    config = _config(tmp_path, body)
    with pytest.raises(ConfigError, match=None) as e:
        space.load(config + ":smoke")
    assert message in str(e.value)
    prefix = tmp_path / "sweep"
    rc = cli.main(["sweep", "--config", config + ":smoke", "--workdir", str(prefix)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("realm-jax sweep: error: ")
    assert message in err
    assert not prefix.exists()  # nothing ran, nothing was written


def test_cli_refusals(tmp_path, capsys):
    config = _config(tmp_path, "[{'train.lr': 1e-4}]") + ":smoke"
    prefix = str(tmp_path / "s")
    cases = [
        (["--workdir", prefix, "--trials", "3"], "--trials bounds a search"),
        (["--workdir", "gs://bucket/sw"], "needs --storage naming a database server"),
        (["--workdir", prefix, "--tpu", "a:us-central2-b"], "--tpu needs --storage"),
        (["--workdir", prefix, "--tpu", "a", "--storage", "grpc://h:1"], "each slice is NAME:ZONE"),
        (["--workdir", prefix, "--tpu", "a:z,b:z", "--workers", "3", "--storage", "grpc://h:1"],
         "--workers 3 with 2 TPU slices"),
        (["--workdir", prefix, "--tpu", "a:z", "--storage", "grpc://h:1"], "inside the repo"),
        (["--workdir", prefix, "--storage", "grpc://host"], "grpc://HOST:PORT"),
        (["--workdir", prefix, "--storage", "study.db"], "not a database URL"),
        (["--workdir", prefix, "--config.train.lrr=1"], "common overrides"),
        (["--table", prefix], "study.db not found"),
        (["--workdir", prefix, "--grace_s", "1", "--heartbeat_s", "2"], "0 < heartbeat_s"),
        ([], "sweep needs --workdir PREFIX"),
    ]  # fmt: skip
    for args, message in cases:
        rc = cli.main(["sweep", "--config", config, *args])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and message in err, (args, err)
    assert not os.path.exists(prefix)


def test_storage_urls():
    assert storage.default_url("/tmp/sw") == "sqlite:////tmp/sw/study.db"
    url = "postgresql://optuna:hunter2@db:5432/s"
    assert storage.redact(url) == "postgresql://optuna:***@db:5432/s"
    storage.check(url, "gs://b/sw", tpu=True)  # a server: fine for any prefix and workers
    storage.check("grpc://proxy:13000", "gs://b/sw", tpu=True)
    storage.check("sqlite:////tmp/sw/study.db", "/tmp/sw", tpu=False)
    with pytest.raises(ConfigError, match="SQLite is a local file"):
        storage.check("sqlite:////tmp/x.db", "gs://b/sw", tpu=False)
    with pytest.raises(ConfigError, match="--tpu needs --storage naming a server"):
        storage.check("sqlite:////tmp/x.db", "/tmp/sw", tpu=True)
    with pytest.raises(ConfigError, match="grpc://HOST:PORT"):
        storage.check("grpc://proxy", "/tmp/sw", tpu=False)
    with pytest.raises(ConfigError) as e:  # a database SQLAlchemy cannot open: one line
        storage.open_storage("nosuchdb://optuna:hunter2@h/db")
    assert "nosuchdb://optuna:***@h/db" in str(e.value) and "hunter2" not in str(e.value)
    assert "\n" not in str(e.value)


def test_worker_env_splits_the_devices():
    cpu = {"platform": "cpu"}
    assert [devices.worker_env(i, 3, cpu) for i in range(3)] == [{}, {}, {}]
    gpus = {"platform": "gpu", "gpus": ["0", "1", "2", "3"]}
    assert [devices.worker_env(i, 2, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == [
        "0,1",
        "2,3",
    ]
    assert [devices.worker_env(i, 4, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == list(
        "0123"
    )
    with pytest.raises(ConfigError, match="do not split in 3"):
        devices.worker_env(0, 3, gpus)
    # a v4-8 host (2x2x1 chips): 4 workers of one chip, 2 of two (a row each), own ports
    tpu = {"platform": "tpu", "chips": 4}
    four = [devices.worker_env(i, 4, tpu) for i in range(4)]
    assert [e["TPU_VISIBLE_CHIPS"] for e in four] == ["0", "1", "2", "3"]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in four} == {"1,1,1"}
    assert {e["TPU_PROCESS_BOUNDS"] for e in four} == {"1,1,1"}
    assert [e["TPU_PROCESS_PORT"] for e in four] == ["8476", "8477", "8478", "8479"]
    assert [e["TPU_PROCESS_ADDRESSES"] for e in four][1] == "localhost:8477"
    two = [devices.worker_env(i, 2, tpu) for i in range(2)]
    chips = [set(e["TPU_VISIBLE_CHIPS"].split(",")) for e in two]
    assert chips[0] | chips[1] == {"0", "1", "2", "3"} and not chips[0] & chips[1]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in two} in ({"2,1,1"}, {"1,2,1"})
    # a v5e-8 host (2x4): 2 workers of 2x2 chips
    eight = [devices.worker_env(i, 2, {"platform": "tpu", "chips": 8}) for i in range(2)]
    assert [e["TPU_VISIBLE_CHIPS"] for e in eight] == ["0,1,2,3", "4,5,6,7"]
    assert eight[0]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    with pytest.raises(ConfigError, match="power of two"):
        devices.worker_env(0, 3, tpu)
    assert devices.worker_env(0, 1, tpu) == {}


def _study(tmp_path, direction="maximize"):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage.default_url(str(tmp_path))
    st = storage.open_storage(url, create=True)
    return optuna.create_study(storage=st, study_name="sweep", direction=direction)


def test_a_lost_trial_is_failed_and_retried_once(tmp_path, capsys):
    import optuna

    study = _study(tmp_path)
    st = study._storage
    lost, alive = study.ask(), study.ask()
    for t in (lost, alive):
        t.suggest_float("train.lr", 1e-5, 1e-3, log=True)
        t.set_user_attr("workdir", f"/w/{t.number}")
    st.set_trial_system_attr(lost._trial_id, storage.HEARTBEAT, time.time() - 100)
    # it started just now: not stale, whatever heartbeat it carries (a retry carries its dead
    # trial's until its own first)
    assert storage.fail_stale(study, grace_s=50) == []
    time.sleep(0.5)
    storage.beat(st, alive._trial_id)
    assert storage.fail_stale(study, grace_s=0.3) == [lost.number]
    assert storage.fail_stale(study, grace_s=0.3) == []  # failed once, by one worker
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "RUNNING", "WAITING"]
    dead, retry = trials[0], trials[2]
    assert retry.params == dead.params and retry.user_attrs["workdir"] == "/w/0"
    assert "fail_reason" not in retry.user_attrs
    assert "no heartbeat for" in dead.user_attrs["fail_reason"]
    assert "enqueued again with the same params" in capsys.readouterr().out
    # the retry, lost too, is not retried again (max_retry=1)
    st.set_trial_state_values(retry._trial_id, optuna.trial.TrialState.RUNNING)
    time.sleep(0.5)
    storage.beat(st, alive._trial_id)
    assert storage.fail_stale(study, grace_s=0.3) == [retry.number]
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "RUNNING", "FAIL"]
    assert "not retried again" in capsys.readouterr().out
    rows = {r["trial"]: r for r in table.rows(study, str(tmp_path))}
    assert rows[0]["state"].startswith("FAIL (retried as #2; no heartbeat for")
    assert rows[1]["state"] == "RUNNING" and rows[1]["wall_s"] >= 1.0


def test_table_states_and_the_best_command(tmp_path):
    import optuna
    from optuna.trial import TrialState

    study = _study(tmp_path, "minimize")
    attrs = {"spec": "configs/realm.py:world", "extra": ["train.steps=400"], "task": "realm",
             "kind": "search", "objective": "eval/loss"}  # fmt: skip
    study.set_user_attr("realm_jax", attrs)
    prefix = str(tmp_path)
    for lr, k, value in [(1e-4, 8, 3.0), (3e-4, 16, 2.5), (2e-4, 8, None)]:
        t = study.ask()
        study._storage.set_trial_param(
            t._trial_id,
            "train.lr",
            lr,
            optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True),
        )
        study._storage.set_trial_param(
            t._trial_id, "train.num_candidates", [8, 16].index(k),
            optuna.distributions.CategoricalDistribution([8, 16]),
        )  # fmt: skip
        name = space.run_name({"train.lr": lr, "train.num_candidates": k})
        workdir = os.path.join(prefix, name)
        os.makedirs(workdir)
        t.set_user_attr("name", name)
        t.set_user_attr("workdir", workdir)
        metrics = {"step": 300 if value is None else 400, "steps": 400,
                   "complete": value is not None, "train": {"loss": 7.0}, "eval_step": 300,
                   "eval": {"loss": value or 9.0},
                   "console_keys": {"train": ["loss"], "eval": ["loss"]}}  # fmt: skip
        with open(os.path.join(workdir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
        t.report(9.0, 300)
        if value is None:
            study.tell(t, state=TrialState.PRUNED)
        else:
            study.tell(t, value)
    line = table.write(study, prefix)
    argv = shlex.split(line)
    assert argv[:7] == ["python", "-m", "realm_jax", "local", "--config", "configs/realm.py:world",
                        "--workdir"]  # fmt: skip
    assert argv[7] == os.path.join(prefix, "best")
    assert argv[8:] == ["--config.train.steps=400", "--config.train.lr=0.0003",
                        "--config.train.num_candidates=16"]  # fmt: skip
    config = load_config(f"{REALM}:world", [a.removeprefix("--config.") for a in argv[8:]])
    assert (config.train.lr, config.train.num_candidates) == (3e-4, 16)  # the best's params
    with open(os.path.join(prefix, "sweep.csv")) as f:
        import csv

        rows = list(csv.DictReader(f))
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE", "PRUNED at step 300"]
    assert [r["value"] for r in rows] == ["3.0", "2.5", "9.0"]
    assert (
        rows[2]["step"] == "300" and rows[1]["params"] == "train.lr=0.0003 train.num_candidates=16"
    )
    md = open(os.path.join(prefix, "sweep.md")).read()
    assert "| 2 | lr=0.0002,num_candidates=8 | PRUNED at step 300 |" in md
    assert line in md and "Best: trial 1" in md
    for png in ("optimization_history.png", "param_importances.png", "intermediate_values.png"):
        with open(os.path.join(prefix, "plots", png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png


def test_a_failed_trial_retried_in_its_workdir_shows_none_of_its_retrys_metrics(tmp_path):
    """Trial 0 failed (interrupted at step 20) and trial 1 ran it again in the same workdir to
    its end: the table's row 0 has its reason and no step or metrics, row 1 the run's."""
    from optuna.trial import TrialState

    study = _study(tmp_path, "maximize")
    study.set_user_attr("realm_jax", {"spec": "configs/realm.py:world", "extra": [],
                                      "task": "realm", "kind": "search",
                                      "objective": "eval/title_recall@5"})  # fmt: skip
    workdir = os.path.join(str(tmp_path), "lr=0.001")
    os.makedirs(workdir)
    with open(os.path.join(workdir, "metrics.json"), "w") as f:
        json.dump({"step": 400, "steps": 400, "complete": True, "eval_step": 400,
                   "eval": {"title_recall@5": 0.99}}, f)  # fmt: skip
    failed = study.ask()
    failed.set_user_attr("workdir", workdir)
    failed.set_user_attr("fail_reason", "interrupted (stopped at step 20 of 400)")
    study.tell(failed, state=TrialState.FAIL)
    retry = study.ask()
    retry.set_user_attr("workdir", workdir)
    retry.set_user_attr("rerun_of", 0)
    study.tell(retry, 0.99)
    r0, r1 = table.rows(study, str(tmp_path))
    assert r0["state"] == "FAIL (retried as #1; interrupted (stopped at step 20 of 400))"
    assert r0["step"] is None and "eval/title_recall@5" not in r0
    assert r1["step"] == 400 and r1["eval/title_recall@5"] == 0.99
