"""A sweep trial's side in the training loop (REALM_JAX_TRIAL, realm_jax/sweep/trial.py), on
tiny ICT runs against a SQLite study made here with Optuna's own API: a trial behind the
finished ones is pruned at its first evaluation after the start (its checkpoint at that step,
PRUNED, metrics.json incomplete); one ahead of them runs to the end through a storage outage
(an exclusive lock held by another connection) with every evaluation reported; a storage that
is gone past retry_s leaves one warning and a finished run. The link's parsing and errors:
tests/unit/test_sweep_trial.py."""

import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import threading

import optuna
import pytest

from realm_jax import checkpoint
from realm_jax import workdir as paths
from realm_jax.config import ConfigError, load_config
from realm_jax.data import prepare
from realm_jax.ict import commands as ict_commands
from realm_jax.sweep import trial as trial_link
from realm_jax.train.metrics import read_scalars
from tests.conftest import REPO
from tests.support.realm_fixtures import tiny_networks
from tests.support.sweeps import sample_corpus

# ICT on the sample's first 80 passages (a quarter of their doc ids held out): a 1-layer
# 32-wide BERT, 6 steps, a held-out evaluation every 2 (steps 0, 2, 4, 6) of recall@k on 32
# sentences, no BM25 baseline.
ICT = tiny_networks("embedder", "reader", max_positions=64) + [
    "model.proj_dropout=0.0",
    "data.block_len=64",
    "data.query_len=32",
    "data.masking=random",
    "data.eval_split_key=doc_id",
    "data.eval_fraction=0.25",
    "train.batch_size=16",
    "train.steps=6",
    "train.log_every=1",
    "train.eval_every=2",
    "train.checkpoint_every=6",
    "train.eval_examples=32",
    "ict.bm25_baseline=False",
]
OBJECTIVE = "eval/recall@5"  # TensorBoard's tag: eval/recall_at_5
TAG = "eval/recall_at_5"
STEPS = (0, 2, 4, 6)


def _config(corpus, ddir, *extra):
    return load_config(
        os.path.join(REPO, "configs", "ict.py:smoke"),
        ICT + [f"data.corpus={corpus}", f"data.data_dir={ddir}", *extra],
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ict")
    corpus, ddir = sample_corpus(root, 80), str(root / "prepared")
    prepare.prepare(_config(corpus, ddir), ddir)
    return corpus, ddir


def _study(db, name: str, others: float) -> int:
    """A study (maximize) with two finished trials whose value is `others` at every evaluation
    step, and a new trial asked for: its id."""
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{db}", direction="maximize")
    for _ in range(2):
        t = study.ask()
        for s in STEPS:
            t.report(others, s)
        study.tell(t, others)
    return study.ask()._trial_id


def _link(monkeypatch, db, name, trial_id, retry_s=60, url=None):
    monkeypatch.setenv(
        trial_link.ENV,
        json.dumps(
            {
                "storage": url or f"sqlite:///{db}?timeout=0.2",  # a lock fails in 0.2 s
                "study": name,
                "trial_id": trial_id,
                "objective": OBJECTIVE,
                "direction": "maximize",
                "retry_s": retry_s,
                "pruner": {"name": "median", "n_startup_trials": 2, "n_warmup_steps": 0},
            }
        ),
    )


def _reported(db, trial_id) -> dict[int, float]:
    """The trial's intermediate values as the database holds them (sqlite3, not Optuna)."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT step, intermediate_value FROM trial_intermediate_values WHERE trial_id = ?",
            (trial_id,),
        ).fetchall()
    return dict(rows)


def _evaluations(workdir) -> dict[int, float]:
    """The run's own held-out recall@5 by step, from its TensorBoard events."""
    return read_scalars(workdir)[TAG]


def test_a_trial_behind_is_pruned_with_its_checkpoint(data, tmp_path, monkeypatch, caplog):
    corpus, ddir = data
    db, work = tmp_path / "study.db", str(tmp_path / "run")
    trial_id = _study(db, "behind", others=2.0)  # no recall reaches 2: behind at every step
    _link(monkeypatch, db, "behind", trial_id)
    with caplog.at_level(logging.WARNING):
        ict_commands.train(_config(corpus, ddir), work)
    evals = _evaluations(work)
    assert sorted(evals) == [0, 2]  # reported at 0 (never pruned there), pruned at 2
    assert _reported(db, trial_id) == pytest.approx(evals, rel=1e-6)
    pruned = json.load(open(paths.pruned_path(work)))
    assert pruned["step"] == 2 and pruned["objective"] == OBJECTIVE
    assert pruned["value"] == pytest.approx(evals[2], rel=1e-6) and pruned["time"].endswith("Z")
    assert f"pruned by the sweep at step 2 (objective={evals[2]:.6g})" in caplog.text
    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    assert list(mgr.all_steps()) == [0, 2]  # step 2 is no save step: forced
    metrics = json.load(open(paths.metrics_path(work)))
    assert metrics["complete"] is False and metrics["step"] == 2
    assert max(read_scalars(work)["loss"]) == 2  # no step trained past it


def test_a_trial_ahead_runs_to_the_end_through_a_storage_outage(
    data, tmp_path, monkeypatch, caplog
):
    """Once step 0 is in the study another connection holds an exclusive lock on the database
    until the trainer's next report has failed: that report is retried, and every evaluation
    ends up in the study."""
    corpus, ddir = data
    db, work = tmp_path / "study.db", str(tmp_path / "run")
    trial_id = _study(db, "ahead", others=-1.0)  # below any recall: never pruned
    _link(monkeypatch, db, "ahead", trial_id)
    retries = threading.Semaphore(0)

    class Retries(logging.Handler):
        def emit(self, record):
            if "retrying in" in record.getMessage():
                retries.release()

    def outage():
        while 0 not in _reported(db, trial_id):
            threading.Event().wait(0.05)
        con = sqlite3.connect(db, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        seen.append(retries.acquire(timeout=120))
        con.execute("COMMIT")
        con.close()

    seen = []
    handler = Retries()
    logging.getLogger("realm_jax.sweep").addHandler(handler)
    holder = threading.Thread(target=outage, daemon=True)
    holder.start()
    try:
        with caplog.at_level(logging.WARNING):
            ict_commands.train(_config(corpus, ddir), work)
    finally:
        logging.getLogger("realm_jax.sweep").removeHandler(handler)
    holder.join(10)
    assert seen == [True], caplog.text  # the outage met a report, which failed
    evals = _evaluations(work)
    assert sorted(evals) == list(STEPS)
    assert _reported(db, trial_id) == pytest.approx(evals, rel=1e-6)
    assert not os.path.exists(paths.pruned_path(work))
    assert json.load(open(paths.metrics_path(work)))["complete"] is True
    failures = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(failures) >= 1 and "database is locked" in failures[0].getMessage()
    assert "report at step 2 failed" in failures[0].getMessage()
    assert "without reporting" not in caplog.text


def test_a_storage_gone_past_retry_s_leaves_one_warning_and_a_finished_run(
    data, tmp_path, monkeypatch, caplog
):
    corpus, ddir = data
    work = str(tmp_path / "run")
    gone = f"sqlite:///{tmp_path / 'no-such-folder' / 'study.db'}"
    _link(monkeypatch, None, "gone", 3, retry_s=1.5, url=gone)
    with caplog.at_level(logging.WARNING):
        ict_commands.train(_config(corpus, ddir, "train.steps=2"), work)
    gave_up = [r for r in caplog.records if "without reporting" in r.getMessage()]
    assert len(gave_up) == 1 and "unable to open database file" in gave_up[0].getMessage()
    failures = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert 1 <= len(failures) <= 2  # 1 s, then what is left of 1.5 s: no retry after it
    assert json.load(open(paths.metrics_path(work)))["complete"] is True
    assert sorted(_evaluations(work)) == [0, 2]


def test_a_malformed_link_is_refused_before_the_run_touches_its_workdir(
    data, tmp_path, monkeypatch
):
    corpus, ddir = data
    work = tmp_path / "run"
    monkeypatch.setenv(trial_link.ENV, '{"storage": "sqlite:///s.db", "study": "s"}')
    with pytest.raises(ConfigError, match="REALM_JAX_TRIAL: trial_id missing; objective missing"):
        ict_commands.train(_config(corpus, ddir), str(work))
    assert not work.exists()  # no lock, no checkpoint


def test_reports_through_the_grpc_proxy_reach_the_study(tmp_path, caplog):
    """grpc://HOST:PORT: Optuna's gRPC proxy (a process of its own, in front of the SQLite
    study) carries the reports and the pruner's answers; the link, started before the proxy
    listens, retries until it does."""
    db = tmp_path / "study.db"
    study = optuna.create_study(study_name="g", storage=f"sqlite:///{db}", direction="maximize")
    for _ in range(2):
        t = study.ask()
        t.report(1.0, 2)
        study.tell(t, 1.0)
    trial_id = study.ask()._trial_id
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = (
        "import optuna; optuna.storages.run_grpc_proxy_server("
        f"optuna.storages.RDBStorage({f'sqlite:///{db}'!r}), host='127.0.0.1', port={port})"
    )
    proxy = subprocess.Popen([sys.executable, "-c", serve], stderr=subprocess.DEVNULL)
    try:
        text = json.dumps(
            {
                "storage": f"grpc://127.0.0.1:{port}",
                "study": "g",
                "trial_id": trial_id,
                "objective": "eval/recall_at_5",  # TensorBoard's spelling of recall@5
                "direction": "maximize",
                "retry_s": 120,
                "pruner": {"name": "median", "n_startup_trials": 2},
            }
        )
        link = trial_link.TrialLink.from_env({trial_link.ENV: text})
        assert link.report(0, {"eval/recall@5": 0.5, "step": 0}, may_prune=False) is False
        assert link.report(2, {"eval/recall@5": 0.25, "step": 2}) is True  # below 1.0
        assert link.report(4, {"eval/recall@5": 0.75, "step": 4}) is False  # none at 4
    finally:
        proxy.kill()
        proxy.wait()
    assert _reported(db, trial_id) == {0: 0.5, 2: 0.25, 4: 0.75}
    assert "without reporting" not in caplog.text


@pytest.mark.system  # two jax.distributed processes: CI keeps the one-process runs above
def test_two_processes_stop_at_the_same_pruned_step(data, tmp_path):
    """2 processes x 2 fake CPU devices through the CLI: process 0 reports and the pruner's
    answer reaches process 1 (multihost_utils), so both save checkpoint 2 and exit 0 there."""
    import portpicker

    corpus, ddir = data
    db, work = tmp_path / "study.db", str(tmp_path / "run")
    trial_id = _study(db, "pair", others=2.0)
    link = {
        "storage": f"sqlite:///{db}",
        "study": "pair",
        "trial_id": trial_id,
        "objective": OBJECTIVE,
        "direction": "maximize",
        "pruner": {"name": "median", "n_startup_trials": 2},
    }
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", trial_link.ENV: json.dumps(link)}
    port, procs = portpicker.pick_unused_port(), []
    for i in range(2):
        cmd = [sys.executable, "-m", "realm_jax", "ict", "--workdir", work]
        cmd += ["--config", os.path.join(REPO, "configs", "ict.py") + ":smoke"]
        cmd += [f"--config.{o}" for o in ICT]
        cmd += [f"--config.data.corpus={corpus}", f"--config.data.data_dir={ddir}"]
        cmd += ["--cpu_devices", "2", "--coordinator", f"127.0.0.1:{port}"]
        cmd += ["--num_processes", "2", "--process_id", str(i)]
        log = open(tmp_path / f"log.{i}", "wb")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log))
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"log.{i}").read_text() for i in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for text in logs:
        assert "pruned by the sweep at step 2" in text, text[-3000:]
    assert json.load(open(paths.pruned_path(work)))["step"] == 2
    assert _reported(db, trial_id) == pytest.approx(_evaluations(work), rel=1e-6)
    mgr = checkpoint.manager(work, with_data=False, read_only=True)
    assert list(mgr.all_steps()) == [0, 2]
