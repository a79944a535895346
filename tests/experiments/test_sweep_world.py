"""experiments/sweep_world/study.py on a fake finished study (an Optuna SQLite file made here,
no training): its stage planning, the pruning's savings and regret against hand counts, the
paired differences, and the README it writes."""

import datetime
import json
import os
import re
import sys

import pytest

from experiments.sweep_world import study as S
from tests.conftest import REPO

T0 = datetime.datetime(2026, 11, 29, 12, 0, 0)
ATTRS = {"spec": S.REALM, "extra": [], "task": "realm", "kind": "search"}
ATTRS["objective"] = "eval/title_recall@5"
# trial: state, params (lr, embedder_lr_scale, num_candidates), its held-out curve, its wall (s)
TRIALS = [
    ("COMPLETE", (5e-4, 0.1, 8), {0: 0.30, 250: 0.45, 300: 0.50, 350: 0.55, 400: 0.60}, 100),
    ("COMPLETE", (1e-4, 0.05, 8), {0: 0.30, 250: 0.40, 300: 0.45, 350: 0.48, 400: 0.50}, 120),
    ("PRUNED", (1e-3, 0.2, 16), {0: 0.30, 250: 0.30}, 60),
    ("PRUNED", (2e-4, 0.4, 16), {0: 0.30, 250: 0.40, 300: 0.42}, 80),
    ("FAIL", (1.5e-3, 0.03, 8), {}, 10),
]
KEYS = ("train.lr", "train.embedder_lr_scale", "train.num_candidates")


def fake_study(root) -> None:
    """ROOT/study/study.db as `sweep` leaves it after TRIALS (names n0..n4)."""
    import optuna

    from realm_jax.sweep import space

    os.makedirs(os.path.join(root, "study"))
    storage = f"sqlite:///{os.path.join(root, 'study', 'study.db')}"
    study = optuna.create_study(storage=storage, study_name="sweep", direction="maximize")
    study.set_user_attr("realm_jax", ATTRS)
    dists = space.load(os.path.join(REPO, S.REALM)).distributions()
    for i, (state, values, curve, wall) in enumerate(TRIALS):
        name = f"n{i}"
        state = optuna.trial.TrialState[state]
        trial = optuna.trial.FrozenTrial(
            number=i,
            state=state,
            value=curve[400] if state.name == "COMPLETE" else None,
            datetime_start=T0,
            datetime_complete=T0 + datetime.timedelta(seconds=wall),
            params=dict(zip(KEYS, values, strict=True)),
            distributions=dists,
            user_attrs={"name": name, "workdir": os.path.join(root, "study", name)},
            system_attrs={},
            intermediate_values=curve,
            trial_id=i,
        )
        study.add_trial(trial)


def finished_run(workdir, step=400, wall=None, **recall) -> None:
    """A finished `local` run: metrics.json (complete) and the study's <workdir>.run.json."""
    os.makedirs(workdir, exist_ok=True)
    evals = {f"title_recall@{k[1:]}": v for k, v in recall.items()} | {"examples": 256}
    metrics = {"complete": True, "step": step, "steps": 400, "eval": evals}
    with open(os.path.join(workdir, "metrics.json"), "w") as f:
        json.dump(metrics, f)
    if wall is not None:
        with open(workdir + ".run.json", "w") as f:
            json.dump({"wall_s": wall}, f)


@pytest.fixture
def root(tmp_path):
    r = str(tmp_path / "sweep-world")
    fake_study(r)
    return r


def test_stages_plan_the_pruned_trials_runs_to_the_end_and_the_seeds(root, capsys):
    setup = S.Setup(root)
    study = S.open_study(setup)
    assert S.study_finished(study, 4) and not S.study_finished(study, 5)  # the FAIL not counted
    # the pruned trials, each to the end with the overrides it trained with, nothing else
    jobs = S.unpruned_jobs(setup, study)
    assert [j.name for j in jobs] == ["n2", "n3"]
    assert jobs[0].args == [
        "local",
        "--config",
        "configs/realm.py:world",
        "--workdir",
        os.path.join(root, "unpruned", "n2"),
        "--config.train.lr=0.001",
        "--config.train.embedder_lr_scale=0.2",
        "--config.train.num_candidates=16",
    ]
    # a finished one is skipped on a re-run, the other would run
    finished_run(os.path.join(root, "unpruned", "n2"), r5=0.65)
    assert S.main(["--root", root, "--trials", "4", "--stages", "study,unpruned", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "study: 4 trials finished already" in out
    assert "n2: finished already" in out and "n3: finished already" not in out
    assert "would run: python -m realm_jax local" in out and "/unpruned/n3 " in out
    assert "/unpruned/n2 " not in out
    # best against recipe: the best complete trial (n0); seed 0 is the recipe as it is (no
    # overrides at all), seed 1 its own world, held-out people, ICT start and initialisation
    best = S.best_params(study)
    assert best == ("n0", dict(zip(KEYS, TRIALS[0][1], strict=True)))
    jobs = {j.key: j for j in S.compare_jobs(setup, best, [0, 1])}
    assert sorted(jobs) == [("n0", 0), ("n0", 1), ("recipe", 0), ("recipe", 1)]
    assert not [a for a in jobs["recipe", 0].args if a.startswith("--config.")]
    assert [a for a in jobs["n0", 0].args if a.startswith("--config.")] == [
        "--config.train.lr=0.0005",
        "--config.train.embedder_lr_scale=0.1",
        "--config.train.num_candidates=8",
    ]
    seed1 = jobs["recipe", 1].args
    assert "--config.data.seed=1" in seed1 and "--config.train.seed=1" in seed1
    ict = os.path.join(root, "seed1", "ict")
    assert f"--config.model.init_embedders_from_ict={ict}" in seed1
    assert jobs["recipe", 1].workdir == os.path.join(root, "compare", "recipe-s1")
    # the world of seed 1 is made in ROOT/seed1 (world.seed=1), then prepared, then ICT
    assert jobs["n0", 0].workdir == os.path.join(root, "compare", "n0-s0")
    # once the best trial's own run has finished it is seed 0's best arm (the same command on
    # the same world and seeds), not trained again; seed 1's is still its own run
    finished_run(os.path.join(root, "study", "n0"), r5=0.60)
    again = {j.key: j for j in S.compare_jobs(setup, best, [0, 1])}
    assert again["n0", 0].workdir == os.path.join(root, "study", "n0")
    assert again["n0", 1].workdir == os.path.join(root, "compare", "n0-s1")
    assert again["recipe", 0].workdir == os.path.join(root, "compare", "recipe-s0")
    made = S.world_jobs(setup, 1)
    assert [j.name for j in made] == ["world-s1", "prepare-s1", "ict-s1"]
    assert "--config.world.seed=1" in made[0].args


def test_savings_and_regret_against_hand_counts(root):
    trials = S.study_trials(S.open_study(S.Setup(root)))
    assert [(t.state, t.step, t.wall_s) for t in trials[:4]] == [
        ("COMPLETE", 400, 100),
        ("COMPLETE", 400, 120),
        ("PRUNED", 250, 60),
        ("PRUNED", 300, 80),
    ]
    assert trials[2].value == 0.30 and trials[3].value == 0.42  # where they were pruned
    obj = "eval/title_recall@5"
    to_end = {
        "n2": S.Run({"title_recall@5": 0.65}, 400, 110.0, {}),
        "n3": S.Run({"title_recall@5": 0.55}, 400, 100.0, {}),
    }
    s = S.savings(trials, to_end, obj, maximize=True)
    # steps: 400 + 400 + 250 + 300 = 1350 as run, 4 x 400 = 1600 to the end: 250 saved
    assert s["steps"] == {"as_run": 1350, "to_end": 1600, "saved": 250, "share": 250 / 1600}
    # wall: 100 + 120 + 60 + 80 = 360 as run, 100 + 120 + 110 + 100 = 430 to the end
    assert s["wall_s"]["as_run"] == 360 and s["wall_s"]["to_end"] == 430
    assert s["wall_s"]["share"] == pytest.approx(70 / 430)
    # n2 ends at 0.65, above the study's best (n0, 0.60): regret 0.05
    assert s["best"] == (0, "n0", 0.60) and s["beaten"] == ["n2"]
    assert s["regret"] == pytest.approx(0.05)
    # minimised, the best is n1 (0.50) and neither end is below it
    s = S.savings(trials, to_end, obj, maximize=False)
    assert s["best"][0] == 1 and s["beaten"] == [] and s["regret"] == 0.0
    with pytest.raises(KeyError, match="n3"):
        S.savings(trials, {"n2": to_end["n2"]}, obj, maximize=True)


def test_paired_differences_by_hand():
    r = {
        ("recipe", 0): {"recall@1": 0.30, "recall@5": 0.50},
        ("best", 0): {"recall@1": 0.40, "recall@5": 0.70},
        ("recipe", 1): {"recall@1": 0.20, "recall@5": 0.60},
        ("best", 1): {"recall@1": 0.20, "recall@5": 0.55},
    }
    p = S.paired(r, ("recipe", "best"), [0, 1])
    assert p["recall@5"]["diff"] == {0: pytest.approx(0.20), 1: pytest.approx(-0.05)}
    assert p["recall@5"]["mean_diff"] == pytest.approx(0.075)
    assert p["recall@5"]["unseen_mean_diff"] == pytest.approx(-0.05)  # seed 1 alone
    assert p["recall@5"]["mean"] == {"recipe": pytest.approx(0.55), "best": pytest.approx(0.625)}
    assert p["recall@1"]["range"] == (pytest.approx(0.0), pytest.approx(0.10))


def test_report_writes_the_sections_the_plots_and_the_summary(root, tmp_path):
    doc = tmp_path / "README.md"
    head = open(S.RESULTS).read().split("\n")[:7]  # the study's own five-line summary
    doc.write_text("\n".join(head) + "\n")
    setup = S.Setup(root, doc=str(doc), plots_to=str(tmp_path))
    plots = os.path.join(root, "study", "plots")
    os.makedirs(plots)
    with open(os.path.join(plots, "optimization_history.png"), "wb") as f:
        f.write(b"\x89PNG small")
    with open(os.path.join(plots, "param_importances.png"), "wb") as f:
        f.write(b"\0" * S.MAX_PLOT_BYTES)  # too big: named, not copied
    finished_run(os.path.join(root, "unpruned", "n2"), wall=110, r5=0.65)
    S.report(setup, [0, 1])  # the runs to the end half done: no pruning section yet
    assert "## Pruning" not in doc.read_text()
    finished_run(os.path.join(root, "unpruned", "n3"), wall=100, r5=0.55)
    for arm, seed, r1, r5 in (
        ("recipe", 0, 0.30, 0.50),
        ("n0", 0, 0.40, 0.70),
        ("recipe", 1, 0.20, 0.60),
        ("n0", 1, 0.20, 0.55),
    ):
        finished_run(os.path.join(root, "compare", f"{arm}-s{seed}"), r1=r1, r5=r5)
    S.report(setup, [0, 1])
    text = doc.read_text()
    assert [s for s in S.SECTIONS if f"## {s}\n" in text] == list(S.SECTIONS)
    assert "| 2 | PRUNED at step 250 | 0.001 | 0.2 | 16 | 30.0 | 250 | 1m00s |" in text
    assert "| 0 | COMPLETE | 0.0005 | 0.1 | 8 | 60.0 | 400 | 1m40s |" in text
    assert "5 trials: 2 complete, 2 pruned, 1 failed" in text
    assert "pruning saved 250 steps, 16%" in text
    assert "| 2 | 250 | 30.0 |  | 65.0 | 400 | 1m50s | yes |" in text
    assert "the study's best with them: +5.0 points" in text
    assert "| 0 (the search's world) | 30.0 | 50.0 | 40.0 | 70.0 | +10.0 | +20.0 |" in text
    assert (
        "- best - recipe, recall@5: +7.5 points (seed 0 +20.0, seed 1 -5.0); over the seeds the "
        "search never saw: -5.0; ahead at 1 of 2 seeds (sign test p = 0.75, one-sided)." in text
    )
    assert os.path.exists(tmp_path / "optimization_history.png")
    assert not os.path.exists(tmp_path / "param_importances.png")
    assert "![optimization_history.png](optimization_history.png)" in text
    # the summary's Found and When now hold the figures, still the five lines test_docs reads
    lines = text.split("\n")
    assert [re.match(r"- \*\*(\w+):\*\* \S", x).group(1) for x in lines[2:7]] == [
        "Asked",
        "Ran",
        "Found",
        "Command",
        "When",
    ]
    assert "4 trials (2 complete, 2 pruned), 2 workers" in lines[3]
    assert "(lr=0.0005, embedder_lr_scale=0.1, num_candidates=8)" in lines[4]
    assert "62.5% against 55.0%, +7.5 points (seed 0 +20.0, seed 1 -5.0)" in lines[4]
    assert "pruning saved 16% of the steps" in lines[4] and "regret +5.0 points" in lines[4]
    assert "the study's own trial" not in text
    # the best trial's own finished run stands for its seed-0 arm, and the section says so
    finished_run(os.path.join(root, "study", "n0"), r1=0.45, r5=0.75)
    S.report(setup, [0, 1])
    text = doc.read_text()
    assert "At seed 0 the best arm is the study's own trial (`ROOT/study/n0`)" in text
    assert "| 0 (the search's world) | 30.0 | 50.0 | 45.0 | 75.0 | +15.0 | +25.0 |" in text
    # the report rerun on the same figures (a new machine, restored from kept/) keeps the
    # sections' stamps and the When line: they say when the figures were measured
    old = re.sub(r"_Measured [^_]*_", "_Measured 2000-01-01 00:00 UTC on then._", text)
    old = re.sub(r"- \*\*When:\*\* .*", "- **When:** 2000-01-01 (commit abc)", old)
    doc.write_text(old)
    S.report(setup, [0, 1])
    assert doc.read_text() == old
    finished_run(os.path.join(root, "compare", "recipe-s1"), r1=0.25, r5=0.60)  # new figures
    S.report(setup, [0, 1])
    text = doc.read_text()
    assert text.count("_Measured 2000-01-01") == 2 and "2000-01-01 (commit" not in text


def test_sign_test_against_hand_counts():
    assert S.sign_p(3, 3) == 1 / 8 and S.sign_p(2, 3) == 4 / 8 and S.sign_p(0, 3) == 1.0


def test_report_draws_the_plots_of_a_study_restored_without_them(root, tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("\n".join(open(S.RESULTS).read().split("\n")[:7]) + "\n")
    S.report(S.Setup(root, doc=str(doc), plots_to=str(tmp_path)), [0, 1])
    assert open(tmp_path / "optimization_history.png", "rb").read(4) == b"\x89PNG"
    assert "![optimization_history.png](optimization_history.png)" in doc.read_text()


def test_a_study_restored_at_another_path_reads_and_keeps_its_trials_there(root, tmp_path, capsys):
    """The study's storage names each trial's workdir by the path it ran at; restored from kept/
    into a checkout elsewhere, the trials' ends are read, and kept, from ROOT/study there."""
    import shutil

    finished_run(os.path.join(root, "study", "n0"), step=350, r5=0.60)
    kept = str(tmp_path / "kept")
    S.keep(S.Setup(root, kept=kept))
    capsys.readouterr()
    shutil.rmtree(root)  # the first machine and its path are gone
    moved = S.Setup(str(tmp_path / "elsewhere" / "sweep-world"), kept=kept)
    S.restore(moved)
    study = S.open_study(moved)
    assert S.study_trials(study)[0].step == 400  # the recorded path is gone: its curve's end
    assert S.study_trials(study, moved.prefix)[0].step == 350  # its metrics.json, read here
    assert os.path.join(moved.prefix, "n0") in S.finished_workdirs(moved, study)
    S.keep(moved)
    assert "kept: the study and 1 finished runs' ends" in capsys.readouterr().out


def test_unknown_stage_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        S.main(["--stages", "study,bogus", "--root", str(tmp_path / "x")])
    assert "unknown stages ['bogus']" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_the_kept_state_brings_a_study_back_on_a_machine_that_lost_its_runs(root, tmp_path, capsys):
    """keep() -> the machine loses ROOT -> restore(): the study resumes from its storage, the
    finished runs' ends (metrics, wall, curve) read as before and are not run again, and no
    world is made for runs that have all finished."""
    import shutil

    kept = str(tmp_path / "kept")
    setup = S.Setup(root, kept=kept)
    finished_run(os.path.join(root, "study", "n0"), r5=0.60)  # a complete trial's workdir
    for name, wall, r5 in (("n2", 110, 0.65), ("n3", 100, 0.55)):
        wd = os.path.join(root, "unpruned", name)
        finished_run(wd, wall=wall, r5=r5)
        with open(os.path.join(wd, S.KEPT_CURVE), "w") as f:  # stands in for its TensorBoard
            json.dump({"250": r5 - 0.1, "400": r5}, f)
    before = {n: S.read_run(os.path.join(root, "unpruned", n)) for n in ("n2", "n3")}
    S.keep(setup)
    assert "kept: the study and 3 finished runs' ends" in capsys.readouterr().out
    shutil.rmtree(root)  # the machine's runs/ is gone; the repository's kept state is not
    S.restore(setup)
    assert "restored from" in capsys.readouterr().out
    study = S.open_study(setup)
    assert S.study_finished(study, 4) and len(S.study_trials(study)) == len(TRIALS)
    after = {n: S.read_run(os.path.join(root, "unpruned", n)) for n in ("n2", "n3")}
    assert after == before and after["n2"].curve == {250: 0.55, 400: 0.65}
    assert after["n2"].wall_s == 110 and after["n3"].metric("eval/title_recall@5") == 0.55
    assert json.load(open(os.path.join(root, "study", "n0", "metrics.json")))["complete"]
    S.restore(setup)  # nothing missing: nothing copied over what is there
    assert "restored" not in capsys.readouterr().out
    shutil.rmtree(root)  # --plan on a machine without ROOT plans from the kept state
    args = ["--root", root, "--kept", kept, "--trials", "4", "--stages", "world,study,unpruned"]
    assert S.main([*args, "--plan"]) == 0
    out = capsys.readouterr().out
    assert "restored from" in out
    assert "world s0: not needed" in out and "would run" not in out
    assert "n2: finished already" in out and "n3: finished already" in out


def test_a_pruned_trial_still_on_the_machine_is_continued_from_its_checkpoint(
    root, monkeypatch, capsys
):
    """The unpruned stage: n3 (pruned at step 300, 80 s) still has its checkpoint at 300, so
    it is continued from a copy of its workdir, first; n2 (restored: no checkpoint) is trained
    from step 0. The continued run's wall is the trial's plus the continuation's."""
    trial = os.path.join(root, "study", "n3")
    for step in (100, 300):
        os.makedirs(os.path.join(trial, "checkpoints", str(step)))
        open(os.path.join(trial, "checkpoints", str(step), "commit_success.txt"), "w").close()
    os.makedirs(os.path.join(trial, "tb"))
    for name, text in (("PRUNED", "{}"), ("trainer.lock", ""), ("sweep.log", "trial's")):
        open(os.path.join(trial, name), "w").write(text)
    json.dump({"complete": False, "step": 300}, open(os.path.join(trial, "metrics.json"), "w"))
    assert S.checkpoint_at(trial, 300) and not S.checkpoint_at(trial, 250)
    os.makedirs(os.path.join(trial, "checkpoints", "350"))  # not committed: still the end
    assert S.checkpoint_at(trial, 300)
    open(os.path.join(trial, "checkpoints", "350", "commit_success.txt"), "w").close()
    assert not S.checkpoint_at(trial, 300)  # it trained past where it was pruned
    import shutil

    shutil.rmtree(os.path.join(trial, "checkpoints", "350"))
    setup = S.Setup(root)
    study = S.open_study(setup)
    jobs = S.unpruned_jobs(setup, study)
    assert [(j.name, j.source, j.base_wall) for j in jobs] == [("n3", trial, 80), ("n2", "", 60)]
    seen = []

    def fake_run(args, log):
        wd = args[args.index("--workdir") + 1]
        seen.append(sorted(os.listdir(wd)) if os.path.exists(wd) else None)
        os.makedirs(wd, exist_ok=True)
        finished_run(wd, r5=0.5)
        return 30.0

    monkeypatch.setattr(S, "run", fake_run)
    S.run_jobs(jobs, 1, plan=False)
    assert seen == [["checkpoints", "metrics.json", "tb"], None]  # a copy without the trial's
    assert os.path.exists(os.path.join(trial, "PRUNED"))  # the trial's own is as it ended
    assert json.load(open(os.path.join(trial, "metrics.json")))["step"] == 300
    rec = json.load(open(os.path.join(root, "unpruned", "n3") + ".run.json"))
    assert rec["wall_s"] == 110 and rec["from_step"] == 300
    assert rec["trial_wall_s"] == 80 and rec["continuation_wall_s"] == 30
    assert json.load(open(os.path.join(root, "unpruned", "n2") + ".run.json"))["wall_s"] == 30
    to_end = {j.name: S.read_run(j.workdir) for j in jobs}
    assert to_end["n3"].from_step == 300 and to_end["n2"].from_step is None
    trials = S.study_trials(study)
    s = S.savings(trials, to_end, "eval/title_recall@5", maximize=True)
    assert s["wall_s"]["to_end"] == 100 + 120 + 30 + 110
    text = S.pruning_section(trials, to_end, s, "eval/title_recall@5")
    assert "| 3 | 300 | 42.0 | continued from there | 50.0 | 400 | 1m50s | no |" in text
    assert "| 2 | 250 | 30.0 |  | 50.0 | 400 | 0m30s | no |" in text


def test_a_sigterm_mid_stage_starts_nothing_more_and_records_no_stopped_run(tmp_path, monkeypatch):
    """The stage's runs get the SIGTERM too: each checkpoints and exits 0 before its last step.
    The stage stops there: the queued runs are not started, and the stopped run has no
    <workdir>.run.json (it is not finished; a re-run starts it again)."""
    import signal
    import time

    started = []

    def fake_run(args, log):
        wd = args[args.index("--workdir") + 1]
        started.append(os.path.basename(wd))
        os.makedirs(wd, exist_ok=True)
        first = len(started) == 1
        json.dump({"complete": not first, "step": 7}, open(os.path.join(wd, "metrics.json"), "w"))
        if first:
            os.kill(os.getpid(), signal.SIGTERM)  # the session's end, mid-run
            time.sleep(0.5)  # the run checkpoints and exits 0
        return 5.0

    monkeypatch.setattr(S, "run", fake_run)
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as main() installs it
    jobs = [S.Job(f"r{i}", ["local", "--workdir", str(tmp_path / f"r{i}")], str(tmp_path / f"r{i}"),
                  str(tmp_path / f"r{i}.log")) for i in range(3)]  # fmt: skip
    try:
        with pytest.raises(SystemExit):
            S.run_jobs(jobs, 1, plan=False)
    finally:
        signal.signal(signal.SIGTERM, old)
    time.sleep(2)  # the stopped run's end (0.5 s) and what a pool left running would start
    assert started == ["r0"]
    assert not os.path.exists(str(tmp_path / "r0") + ".run.json")
