"""A study that matters, measured (issue 60, deliverable 6): `realm-jax sweep`'s search over the
world recipe with pruning on held-out recall, 2 workers, then the compute pruning saved against
the same trials run to the end, and the best trial against today's recipe over seeds.

    python experiments/sweep_world/study.py [--root runs/sweep-world] [--trials 12]
        [--workers 2] [--seeds 0,1,2] [--stages world,study,unpruned,compare,report] [--plan]
    python experiments/sweep_world/study.py --smoke     # the same chain, tiny (minutes)

Stages, run as a user would (one `python -m realm_jax` process per run, from the repository
root, its output in ROOT/logs/), each resumable: what has finished is skipped on a re-run, a run
that did not finish is started again from step 0 (its wall time is measured whole).

  world     what configs/realm.py:world expects (docs/tutorial.md): the world in runs/world
            (`world`), its prepared data in runs/world-data (`prepare`), the ICT warm start in
            runs/world-ict (`ict --config configs/ict.py:world`), each made only when missing.
            A runs/world generated with another `world` section stops the study (move it away).
  study     `python -m realm_jax sweep --config configs/realm.py:world --workdir ROOT/study
            --workers 2 --trials N`: configs/realm.py's sweep("world"), a TPE search over
            train.lr, train.embedder_lr_scale and train.num_candidates on held-out
            eval/title_recall@5 with median pruning. Skipped once N trials are complete or
            pruned; otherwise the same command resumes the study (a failed trial is in its table).
  unpruned  every PRUNED trial trained again to train.steps with its params and no pruning,
            `python -m realm_jax local --config configs/realm.py:world --workdir
            ROOT/unpruned/<trial name> --config.<param>=<value> ...` (the trial's overrides as
            the study stored them), as many at once as the study had workers, so that a run's
            wall is measured beside another as the trials' were. From these: the compute
            pruning saved (steps, and wall) against the same trials all run to the end, and its
            regret (a pruned trial whose end beats the study's best). A pruned trial whose
            checkpoint at its last step is still on this machine is continued from it in a
            copy of its workdir (the same trial run on; its wall the trial's plus the rest's)
            instead of trained from step 0; those go first.
  compare   the study's best trial's params and the recipe (no overrides), each over --seeds,
            into ROOT/compare/<arm>-s<seed> (<arm>: recipe, or the best trial's name). A seed
            is the world study's (experiments/world/world_study.py --seed): world.seed,
            data.seed and train.seed, its own world, held-out people, ICT warm start and
            initialisation, made in ROOT/seed<seed>/; seed 0 is the recipe's own runs/world,
            the world the search chose on (its held-out sentences are the objective's), so
            seeds 1 and 2 are the comparison the search never saw. The best arm at seed 0 is
            the study's own trial (ROOT/study/<name>, the same command), not trained twice.
  report    the README's sections (the trials, the pruning, best against the recipe) from what
            has been measured so far; the study's plots (ROOT/study/plots/) copied beside the
            README when under 200 KB; the summary's Found and When lines once all three are in.

Kept state: this machine's runs/ does not outlive it; the repository does. Every run of the
script ends (a SIGTERM too: stop it with `kill -TERM -- -<its process group>`, the trainers
checkpoint and the sweep stops its trials cleanly) by copying what the report reads into
experiments/sweep_world/kept/ (--kept): the study's SQLite storage and each finished run's
metrics.json, wall and objective curve, a few KB each; commit it. On a machine without ROOT
the script first restores it: the sweep resumes from its storage (a trial that was running
is failed by its heartbeat and retried), finished runs are not run again, and a world is made
only where a run still needs it.

--smoke: experiments/sweep_world/smoke_config.py (80 people, 12 steps, the search on held-out
loss pruned from step 8), everything in --root (default runs/sweep-world-smoke, seed 0 too),
4 trials, seed 0, the report into ROOT/README.md: the chain end to end in minutes, never a
result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools.cli_runs import done, run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "README.md")
REALM, ICT = "configs/realm.py:world", "configs/ict.py:world"
SMOKE_REALM = "experiments/sweep_world/smoke_config.py:world"
# ICT's warm start at smoke size (configs/ict.py:world trains 400 steps at batch 64)
SMOKE_ICT = ["train.steps=6", "train.eval_every=6", "train.checkpoint_every=6"]
SMOKE_ICT += ["train.batch_size=16", "train.warmup_steps=1", "train.eval_examples=32"]
STAGES = ("world", "study", "unpruned", "compare", "report")
STUDY = "sweep"  # the sweep's default study name (realm_jax/sweep/study.py STUDY)
MAX_PLOT_BYTES = 200_000  # a plot copied beside the README only under this size
SECTIONS = (
    "The study",
    "Pruning against the same trials run to the end",
    "The best trial against the recipe",
)
KS = (1, 5)


# ---------------------------------------------------------------- where things live


@dataclasses.dataclass
class Setup:
    """The study's configs and folders: the real one, or --smoke's."""

    root: str  # absolute: ROOT
    realm: str = REALM  # the REALM spec of the sweep and of every run
    ict: str = ICT
    ict_extra: list = dataclasses.field(default_factory=list)  # ICT's overrides ("k=v")
    smoke: bool = False
    doc: str = RESULTS  # the README the report writes
    plots_to: str = HERE  # where the study's plots are copied
    kept: str = ""  # the study's kept state (keep()), "" for none

    def seed(self, seed: int) -> SeedWorld:
        """The world, data and ICT warm start of `seed` (module docstring: compare)."""
        if seed == 0 and not self.smoke:  # the recipe's own paths (configs/realm.py _world)
            from realm_jax.config import load_config

            c = load_config(os.path.join(REPO, self.realm))
            return SeedWorld(
                seed,
                world=os.path.join(REPO, os.path.dirname(c.data.corpus)),
                data=os.path.join(REPO, c.data.data_dir),
                ict=os.path.join(REPO, c.model.init_embedders_from_ict),
                flags=[],
                prepare_workdir=os.path.join(self.root, "prepare-s0"),
            )
        base = os.path.join(self.root, f"seed{seed}")
        world, data, ict = (os.path.join(base, n) for n in ("world", "data", "ict"))
        flags = [f"data.corpus={world}/corpus.jsonl", f"data.sentences={world}/text"]
        flags += [f"data.data_dir={data}"]
        if seed:
            flags += [f"data.seed={seed}", f"train.seed={seed}"]
        return SeedWorld(seed, world, data, ict, flags, os.path.join(base, "prepare"))

    def logs(self, name: str) -> str:
        return os.path.join(self.root, "logs", f"{name}.log")

    @property
    def prefix(self) -> str:
        """The sweep's --workdir."""
        return os.path.join(self.root, "study")


@dataclasses.dataclass
class SeedWorld:
    seed: int
    world: str
    data: str
    ict: str
    flags: list  # data paths and seeds ("k=v"), for ICT and REALM alike
    prepare_workdir: str

    @property
    def realm_flags(self) -> list[str]:
        """A REALM run's overrides: the data, the seeds and the ICT warm start (none: the
        recipe's own, at seed 0)."""
        return [*self.flags, f"model.init_embedders_from_ict={self.ict}"] if self.flags else []


def flags(overrides: list[str]) -> list[str]:
    return [f"--config.{o}" for o in overrides]


@dataclasses.dataclass
class Job:
    """One `python -m realm_jax` run of a stage: its arguments, workdir and log."""

    name: str
    args: list
    workdir: str
    log: str
    key: tuple = ()  # compare: (arm, seed)
    source: str = ""  # unpruned: the pruned trial's workdir to continue from ("" from step 0)
    base_wall: float | None = None  # unpruned, continued: the trial's own wall up to there

    def line(self) -> str:
        return shlex.join(["python", "-m", "realm_jax", *self.args])


# ---------------------------------------------------------------- stage 1: the world


def world_jobs(setup: Setup, seed: int) -> list[Job]:
    """world, prepare, ict for `seed`: the ones missing, in order (each needs the one before)."""
    w = setup.seed(seed)
    jobs = []
    if not os.path.exists(os.path.join(w.world, "world.json")):
        shape = [f"world.seed={seed}"] if seed else []
        args = ["world", "--config", setup.realm, "--workdir", w.world, *flags(shape)]
        jobs.append(Job(f"world-s{seed}", args, w.world, setup.logs(f"world-s{seed}")))
    if not os.path.exists(os.path.join(w.data, "summary.json")):
        args = ["prepare", "--config", setup.realm, "--workdir", w.prepare_workdir]
        args += flags(w.realm_flags)
        jobs.append(Job(f"prepare-s{seed}", args, w.data, setup.logs(f"prepare-s{seed}")))
    if not done(w.ict):
        args = ["ict", "--config", setup.ict, "--workdir", w.ict]
        args += flags([*w.flags, *setup.ict_extra])
        jobs.append(Job(f"ict-s{seed}", args, w.ict, setup.logs(f"ict-s{seed}")))
    return jobs


def check_world(setup: Setup, seed: int) -> None:
    """A world already there must be the one the config generates (its `world` section)."""
    from realm_jax.config import load_config

    w = setup.seed(seed)
    path = os.path.join(w.world, "world.json")
    if not os.path.exists(path):
        return
    want = load_config(os.path.join(REPO, setup.realm), [f"world.seed={seed}"]).world
    have = json.load(open(path))
    diff = {k: (have.get("world", {}).get(k), v) for k, v in want.to_dict().items()}
    diff = {k: hv for k, hv in diff.items() if hv[0] != hv[1]}
    if diff or not have.get("complete"):
        raise SystemExit(
            f"{w.world} holds another world (or an unfinished one): "
            + (", ".join(f"world.{k} {a!r} there, {b!r} here" for k, (a, b) in diff.items()))
            + "; move it away and run again"
        )


def make_world(setup: Setup, seed: int, plan: bool) -> None:
    check_world(setup, seed)
    jobs = world_jobs(setup, seed)
    if not jobs:
        print(f"world s{seed}: world, data and ICT warm start there already", flush=True)
    for job in jobs:  # in order: prepare reads the world, ICT the prepared data
        if plan:
            print(f"would run: {rel(job.line())}")
        else:
            run(job.args, job.log)


# ---------------------------------------------------------------- stage 2: the sweep


def open_study(setup: Setup):
    """The sweep's study (read only here), None before the sweep made it."""
    import optuna

    db = os.path.join(setup.prefix, "study.db")
    if not os.path.exists(db):
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    except KeyError:
        return None


def study_finished(study, trials: int) -> bool:
    """Whether `trials` trials are complete or pruned and none is running or waiting."""
    if study is None:
        return False
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    if "RUNNING" in states or "WAITING" in states:
        return False
    return states.count("COMPLETE") + states.count("PRUNED") >= trials


def sweep_job(setup: Setup, trials: int, workers: int) -> Job:
    args = ["sweep", "--config", setup.realm, "--workdir", setup.prefix]
    args += ["--workers", str(workers), "--trials", str(trials)]
    args += flags(setup.seed(0).realm_flags)
    return Job("study", args, setup.prefix, setup.logs("study"))


def run_sweep(setup: Setup, trials: int, workers: int, plan: bool) -> None:
    job = sweep_job(setup, trials, workers)
    if study_finished(open_study(setup), trials):
        print(f"study: {trials} trials finished already ({setup.prefix})", flush=True)
        return
    if plan:
        print(f"would run: {rel(job.line())}")
        return
    cmd = [sys.executable, "-m", "realm_jax", *job.args]
    print("$", " ".join(cmd[1:]), flush=True)
    t = time.time()
    os.makedirs(os.path.dirname(job.log), exist_ok=True)
    with open(job.log, "a") as f:  # a resumed study's log follows the earlier one
        f.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {job.line()}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait()
        except BaseException:  # SIGTERM or Ctrl-C: the sweep stops its trials cleanly first
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    print(f"  done in {time.time() - t:.0f} s, exit {rc} (log {job.log})", flush=True)
    if rc == 1:  # a trial failed and was not run again: the study's table says why
        print(f"study: a trial failed (see {setup.prefix}/sweep.md); going on", flush=True)
    elif rc != 0:
        raise SystemExit(f"the sweep exited with {rc}: see {job.log}")


# ---------------------------------------------------------------- what the study holds


@dataclasses.dataclass
class Trial:
    """A trial of the study, as this study reads it."""

    number: int
    name: str
    state: str  # COMPLETE, PRUNED, FAIL, RUNNING or WAITING
    params: dict
    value: float | None  # COMPLETE: the objective at its end; PRUNED: at the step it stopped
    step: int | None  # the last step it trained
    wall_s: float | None  # the worker's wall time for it (start to end)
    curve: dict  # {step: objective} as it reported them
    examples: int | None = None  # held-out sentences its evaluation scored


def trial_workdir(t, prefix: str | None = None) -> str:
    """The trial's workdir as the sweep recorded it, or, where that path is not on this machine
    (the repository checked out elsewhere, the study restored from kept/), the same name under
    `prefix` (ROOT/study) when it is there."""
    wd = t.user_attrs.get("workdir", "")
    if wd and prefix and not os.path.exists(wd):
        here = os.path.join(prefix, os.path.basename(wd))
        if os.path.exists(here):
            return here
    return wd


def study_trials(study, prefix: str | None = None) -> list[Trial]:
    from realm_jax.sweep import table
    from realm_jax.workdir import metrics_path

    out = []
    for t in study.get_trials(deepcopy=False):
        state = t.state.name
        curve = {int(s): float(v) for s, v in t.intermediate_values.items()}
        workdir = trial_workdir(t, prefix)
        metrics = table._read_json(metrics_path(workdir)) if workdir else {}
        if state == "PRUNED":
            step = t.last_step
            value = curve.get(step) if step is not None else None
        else:
            step = metrics.get("step", max(curve) if curve else None)
            value = t.value if t.values else None
        wall = None
        if t.datetime_start and t.datetime_complete:
            wall = (t.datetime_complete - t.datetime_start).total_seconds()
        out.append(
            Trial(
                t.number,
                t.user_attrs.get("name", ""),
                state,
                table.trial_params(t),
                value,
                step,
                wall,
                curve,
                metrics.get("eval", {}).get("examples"),
            )
        )
    return out


def study_attrs(study) -> dict:
    """What the sweep stored of itself: spec, extra (its common overrides), objective, ..."""
    return dict(study.user_attrs.get("realm_jax", {}))


def trial_overrides(attrs: dict, params: dict) -> list[str]:
    """The overrides a trial of `params` trained with (the sweep's common ones first)."""
    from realm_jax.sweep import space

    return [*attrs.get("extra", []), *space.overrides(params)]


# ---------------------------------------------------------------- stage 3: run to the end


def checkpoint_at(workdir: str, step: int | None) -> bool:
    """Whether `workdir` holds a committed checkpoint of `step` and none after it: a pruned
    trial's own end, still on this machine (a restored trial's workdir has only its metrics)."""
    ckpt = os.path.join(workdir, "checkpoints")
    if step is None or not os.path.isdir(ckpt):
        return False
    steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()]
    committed = [n for n in steps if os.path.exists(os.path.join(ckpt, str(n), COMMITTED))]
    return max(committed, default=-1) == step


COMMITTED = "commit_success.txt"  # Orbax's marker of a checkpoint written whole


def unpruned_jobs(setup: Setup, study) -> list[Job]:
    """Every PRUNED trial's run to the end: ROOT/unpruned/<its name>, its spec and overrides.
    A trial whose checkpoint at the step it was pruned is still on this machine is continued
    from it (`source`: a copy of its workdir, so the trial's own stays as it ended), the others
    are trained from step 0; the continued ones first, as their checkpoints do not outlive the
    machine."""
    attrs = study_attrs(study)
    spec = attrs.get("spec", setup.realm)
    jobs = []
    for t in study_trials(study, setup.prefix):
        if t.state != "PRUNED":
            continue
        wd = os.path.join(setup.root, "unpruned", t.name)
        args = ["local", "--config", spec, "--workdir", wd]
        args += flags(trial_overrides(attrs, t.params))
        trial_wd = os.path.join(setup.prefix, t.name)
        source = trial_wd if checkpoint_at(trial_wd, t.step) and t.wall_s else ""
        log = setup.logs(f"unpruned-{t.name}")
        jobs.append(Job(t.name, args, wd, log, source=source, base_wall=t.wall_s))
    return sorted(jobs, key=lambda j: not j.source)


# a pruned trial's files that are not the run's: the sweep's marker, its log and the lock
NOT_COPIED = ("PRUNED", "sweep.log", "trainer.lock")


def run_jobs(jobs: list[Job], parallel: int, plan: bool) -> None:
    """The jobs not finished yet, `parallel` at a time; an unfinished workdir is started again
    from step 0 (the run's wall is measured whole). Each finished run's wall goes into
    <workdir>.run.json."""
    todo = [j for j in jobs if not done(j.workdir)]
    for j in jobs:
        if j not in todo:
            print(f"{j.name}: finished already ({j.workdir})", flush=True)
    if plan:
        for j in todo:
            also = f" (continuing {rel(j.source)} from its checkpoint)" if j.source else ""
            print(f"would run: {rel(j.line())}{also}")
        return

    def one(j: Job) -> None:
        if os.path.exists(j.workdir):
            shutil.rmtree(j.workdir)
        if os.path.exists(j.workdir + ".run.json"):  # an earlier, unfinished try's
            os.remove(j.workdir + ".run.json")
        record = {"command": j.line()}
        if j.source:  # continued from the pruned trial's checkpoint: its copy resumes there
            shutil.copytree(j.source, j.workdir, ignore=shutil.ignore_patterns(*NOT_COPIED))
            step = json.load(open(os.path.join(j.source, "metrics.json"))).get("step")
            record |= {"continued_from": j.source, "from_step": step, "trial_wall_s": j.base_wall}
        wall = run(j.args, j.log)
        if not done(j.workdir):  # stopped (a SIGTERM checkpoints and exits 0): not a finished run
            raise RuntimeError(f"{j.name} stopped before its last step (log {j.log})")
        if j.source:
            record["continuation_wall_s"] = wall
            wall += j.base_wall  # the trial's wall to where it stopped + the rest
        with open(j.workdir + ".run.json", "w") as f:
            json.dump({"wall_s": wall, **record}, f, indent=1)

    pool = concurrent.futures.ThreadPoolExecutor(max(1, parallel))
    futures = {pool.submit(one, j): j for j in todo}
    try:
        concurrent.futures.wait(futures)
    except BaseException:  # SIGTERM or Ctrl-C: start nothing more (the running runs got the
        pool.shutdown(wait=False, cancel_futures=True)  # signal too, and checkpoint and stop)
        raise
    pool.shutdown()
    failed = [j for f, j in futures.items() if f.exception() is not None]
    if failed:
        raise SystemExit(
            "failed: " + ", ".join(f"{j.name} (log {j.log})" for j in failed) + "; run again"
        )


@dataclasses.dataclass
class Run:
    """A finished run's end: its held-out metrics, step and wall."""

    eval: dict  # metrics.json's latest held-out evaluation
    step: int
    wall_s: float | None
    curve: dict  # {step: objective}
    from_step: int | None = None  # continued from a pruned trial's checkpoint at this step

    def metric(self, key: str) -> float | None:
        v = self.eval.get(key.removeprefix("eval/"))
        return None if v is None else float(v)


def read_run(workdir: str, objective: str = "eval/title_recall@5") -> Run | None:
    """A finished run (None otherwise): metrics.json, the wall this study measured (else the
    trainer's own, metrics.json goodput_split), the objective's curve from TensorBoard."""
    if not done(workdir):
        return None
    metrics = json.load(open(os.path.join(workdir, "metrics.json")))
    wall, from_step = None, None
    if os.path.exists(workdir + ".run.json"):
        record = json.load(open(workdir + ".run.json"))
        wall, from_step = record.get("wall_s"), record.get("from_step")
    if wall is None:
        wall = metrics.get("goodput_split", {}).get("wall")
    curve = {}
    try:
        from realm_jax.train.metrics import read_scalars

        curve = read_scalars(workdir).get(objective.replace("@", "_at_"), {})
    except (FileNotFoundError, OSError, ValueError):
        pass
    kept_curve = os.path.join(workdir, KEPT_CURVE)
    if not curve and os.path.exists(kept_curve):  # a run restored from the kept state
        curve = {int(k): v for k, v in json.load(open(kept_curve)).items()}
    return Run(dict(metrics.get("eval", {})), int(metrics["step"]), wall, curve, from_step)


def savings(trials: list[Trial], to_end: dict[str, Run], objective: str, maximize: bool) -> dict:
    """The compute pruning saved and what it cost: the study's complete and pruned trials as
    they ran, against the same trials with each pruned one run to the end (`to_end`: trial
    name -> that run). KeyError naming the pruned trials without one.

    steps/wall: as run (complete trials' + pruned trials' up to where they stopped) and to the
    end (complete trials' + the pruned ones' runs to the end); saved = to_end - as_run, and its
    share of to_end. regret: how far the best pruned trial's end is beyond the study's best
    complete value (0 when none is); beaten: the pruned trials whose end beats it."""
    finished = [t for t in trials if t.state in ("COMPLETE", "PRUNED")]
    pruned = [t for t in finished if t.state == "PRUNED"]
    missing = [t.name for t in pruned if t.name not in to_end]
    if missing:
        raise KeyError(f"no run to the end of the pruned trials {missing}")
    complete = [t for t in finished if t.state == "COMPLETE"]
    out = {"trials": len(finished), "pruned": len(pruned), "complete": len(complete)}
    for key, get_run, get_end in (
        ("steps", lambda t: t.step, lambda r: r.step),
        ("wall_s", lambda t: t.wall_s, lambda r: r.wall_s),
    ):
        as_run = [get_run(t) for t in finished]
        ends = [get_run(t) for t in complete] + [get_end(to_end[t.name]) for t in pruned]
        if any(v is None for v in as_run + ends):
            out[key] = None
            continue
        a, e = float(sum(as_run)), float(sum(ends))
        out[key] = {"as_run": a, "to_end": e, "saved": e - a, "share": (e - a) / e if e else 0.0}
    sign = 1.0 if maximize else -1.0
    best = max(complete, key=lambda t: (sign * t.value, -t.number)) if complete else None
    out["best"] = (best.number, best.name, best.value) if best else None
    ends = {t.name: to_end[t.name].metric(objective) for t in pruned}
    ends = {n: v for n, v in ends.items() if v is not None}
    out["ends"] = ends
    if best is None or not ends:
        out["regret"], out["beaten"] = 0.0 if best else None, []
        return out
    top = max(ends, key=lambda n: sign * ends[n])
    out["regret"] = max(0.0, sign * (ends[top] - best.value))
    out["beaten"] = sorted(n for n, v in ends.items() if sign * (v - best.value) > 0)
    return out


# ---------------------------------------------------------------- stage 4: best against recipe


def best_params(study) -> tuple[str, dict] | None:
    """(name, params) of the study's best complete trial; None before one completed."""
    from realm_jax.sweep import table

    best = table.best_trial(study)
    return (best.user_attrs.get("name", ""), dict(best.params)) if best else None


def compare_jobs(setup: Setup, best: tuple[str, dict], seeds: list[int]) -> list[Job]:
    """The recipe and the best trial's params at each seed: ROOT/compare/<arm>-s<seed>. At
    seed 0 the best arm is the study's own finished trial (ROOT/study/<name>) where it is
    there: the same command on the same world and seeds (the sweep passes seed 0's flags),
    so it is not trained a second time."""
    from realm_jax.sweep import space

    name, params = best
    jobs = []
    for seed in seeds:
        w = setup.seed(seed)
        for arm, over in (("recipe", []), (name, space.overrides(params))):
            wd = os.path.join(setup.root, "compare", f"{arm}-s{seed}")
            trial_wd = os.path.join(setup.prefix, name)
            if seed == 0 and arm == name and done(trial_wd):
                wd = trial_wd
            args = ["local", "--config", setup.realm, "--workdir", wd]
            args += flags([*w.realm_flags, *over])
            log = setup.logs(f"compare-{arm}-s{seed}")
            jobs.append(Job(f"{arm}-s{seed}", args, wd, log, key=(arm, seed)))
    return jobs


def paired(results: dict, arms: tuple[str, str], seeds: list[int]) -> dict:
    """results {(arm, seed): {"recall@k": value}} -> per k: each arm's mean, the paired
    differences (second arm - first) per seed, their mean, min and max, and the same over the
    seeds other than 0 (those the search never saw)."""
    first, second = arms
    out = {}
    for k in KS:
        key = f"recall@{k}"
        d = {s: results[second, s][key] - results[first, s][key] for s in seeds}
        unseen = [d[s] for s in seeds if s != 0]
        out[key] = {
            "mean": {a: sum(results[a, s][key] for s in seeds) / len(seeds) for a in arms},
            "diff": d,
            "mean_diff": sum(d.values()) / len(d),
            "range": (min(d.values()), max(d.values())),
            "unseen_mean_diff": sum(unseen) / len(unseen) if unseen else None,
        }
    return out


# ---------------------------------------------------------------- stage 5: the README


def per_seed(diff: dict) -> str:
    """{seed: difference} -> 'seed 0 +43.8, seed 1 +1.2, ...' (points)."""
    return ", ".join(f"seed {sd} {100 * d:+.1f}" for sd, d in sorted(diff.items()))


def better(diff: dict) -> str:
    """How many seeds the best arm won at: with 3 seeds, a sign count is the honest test (all 3
    ahead happens by chance with probability 1/8 under no difference)."""
    n, won = len(diff), sum(d > 0 for d in diff.values())
    return f"ahead at {won} of {n} seeds (sign test p = {sign_p(won, n):.3g}, one-sided)"


def sign_p(won: int, n: int) -> float:
    """One-sided sign test: P(at least `won` of `n` fair coin flips)."""
    from math import comb

    return sum(comb(n, i) for i in range(won, n + 1)) / 2**n


def pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.1f}"


def minutes(s: float | None) -> str:
    if s is None:
        return ""
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s"


def short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def params_text(params: dict) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={short(v)}" for k, v in params.items())


@dataclasses.dataclass(frozen=True)
class Objective:
    """The study's objective as the README writes it: a share (recall, accuracy) in percent
    and its differences in points, anything else (a loss) as it is."""

    key: str = "eval/title_recall@5"

    @property
    def name(self) -> str:
        return self.key.removeprefix("eval/").replace("title_", "")

    @property
    def share(self) -> bool:
        return "recall" in self.key or "accuracy" in self.key

    @property
    def head(self) -> str:
        return f"{self.name} (%)" if self.share else self.name

    def cell(self, v: float | None) -> str:
        return pct(v) if self.share else ("" if v is None else f"{v:.4g}")

    def text(self, v: float | None) -> str:
        return f"{pct(v)}%" if self.share else self.cell(v)

    def diff(self, d: float) -> str:
        return f"{100 * d:+.1f} points" if self.share else f"{d:+.4g}"


def trials_table(trials: list[Trial], keys: list[str], obj: Objective = Objective()) -> str:
    """One row per trial: its state, params, the objective (at its end, or where it was
    pruned), the steps it trained and its wall."""
    head = ["trial", "state", *keys, obj.head, "steps", "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in trials:
        state = f"PRUNED at step {t.step}" if t.state == "PRUNED" else t.state
        cells = [str(t.number), state, *(short(t.params.get(k, "")) for k in keys)]
        cells += [obj.cell(t.value), "" if t.step is None else str(t.step), minutes(t.wall_s)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rel(text: str) -> str:
    """Paths in `text` relative to the repository root, as a user there types them."""
    return text.replace(REPO + os.sep, "")


def study_section(
    setup: Setup, study, trials: list[Trial], plots: list[str], workers: int = 2
) -> str:
    from realm_jax.sweep import space, table

    attrs = study_attrs(study)
    sweep = space.load(os.path.join(REPO, attrs.get("spec", setup.realm)), attrs.get("extra", []))
    keys = list(sweep.params)
    obj = Objective(attrs.get("objective", sweep.objective))  # what the study ran on
    count = {s: sum(t.state == s for t in trials) for s in ("COMPLETE", "PRUNED", "FAIL")}
    examples = next((t.examples for t in trials if t.examples), None)
    per = f" (one sentence: {100 / examples:.2f} points)" if examples and obj.share else ""
    best = table.best_trial(study)
    finished = count["COMPLETE"] + count["PRUNED"]
    body = [
        f"`{rel(sweep_job(setup, finished, workers).line())}` (the sweep's own table: "
        f"`{rel(setup.prefix)}/sweep.md`): {sweep.sampler} over "
        + ", ".join(f"`{k}`" for k in keys)
        + f", objective `{obj.key}` ({study.direction.name.lower()}) on "
        + (f"{int(examples)} held-out sentences{per}" if examples else "the held-out sentences")
        + f", pruner {sweep.pruner} {sweep.pruner_args}. {len(trials)} trials: "
        + f"{count['COMPLETE']} complete, {count['PRUNED']} pruned, {count['FAIL']} failed. "
        f"{obj.name} is the trial's value at its end, or where it was pruned; wall is the "
        f"worker's, start to end, {workers} trials at a time on the machine's cores.",
        "",
        trials_table(trials, keys, obj),
    ]
    if best is not None:
        line = rel(shlex.join(table.best_command(attrs, setup.prefix, best.params)))
        body += [
            "",
            f"Best: trial {best.number} ({params_text(dict(best.params))}), {obj.name} "
            f"{obj.text(best.value)}. The recipe's own values: "
            + params_text(recipe_params(setup, keys))
            + ". The best trial's config, trained again:",
            "",
            f"```\n{line}\n```",
        ]
    if plots:
        body += ["", " ".join(f"![{p}]({p})" for p in plots)]
    return "\n".join(body)


def recipe_params(setup: Setup, keys: list[str]) -> dict:
    from realm_jax.config import load_config

    c = load_config(os.path.join(REPO, setup.realm))
    out = {}
    for k in keys:
        v = c
        for part in k.split("."):
            v = v[part]
        out[k] = v
    return out


def pruning_section(trials: list[Trial], to_end: dict[str, Run], s: dict, objective: str) -> str:
    obj = Objective(objective)
    pruned = [t for t in trials if t.state == "PRUNED"]
    head = f"| trial | pruned at step | {obj.head} there | its run to the end at that step "
    head += f"| its run to the end: {obj.head} | steps | wall | beyond the study's best? |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    best_value = s["best"][2] if s["best"] else None
    for t in pruned:
        r = to_end[t.name]
        end = r.metric(objective)
        again = r.curve.get(t.step) if t.step is not None else None
        again_cell = obj.cell(again) if r.from_step is None else "continued from there"
        above = "yes" if t.name in s["beaten"] else "no"
        if best_value is None or end is None:
            above = ""
        lines.append(
            f"| {t.number} | {t.step} | {obj.cell(t.value)} | {again_cell} | "
            f"{obj.cell(end)} | {r.step} "
            f"| {minutes(r.wall_s)} | {above} |"
        )
    out = [
        "Every pruned trial trained again from step 0 to the end with its params and no pruning "
        "(`python -m realm_jax local --config ... --workdir ROOT/unpruned/<trial> "
        "--config.<param>=...`, as many at once as the study's workers). The same trials all "
        "run to the end are the study without pruning, as far as its trials go: without "
        "pruning TPE would have seen other values and proposed other points. A trial whose "
        "checkpoint at the step it was pruned was still on the machine (pruned in the session "
        "that ran this stage) was instead continued from it, in a copy of its workdir: the "
        "same trial run on, its wall the trial's to there plus the continuation's.",
        "",
        "\n".join(lines) if pruned else "No trial was pruned.",
        "",
    ]
    st, wall = s["steps"], s["wall_s"]
    out.append(
        f"- Steps: {int(st['as_run'])} as the study ran its {s['trials']} trials "
        f"({s['complete']} complete, {s['pruned']} pruned), {int(st['to_end'])} all run to the "
        f"end: pruning saved {int(st['saved'])} steps, {100 * st['share']:.0f}%."
    )
    if wall:
        out.append(
            f"- Wall (each run's, start to end, summed): {minutes(wall['as_run'])} against "
            f"{minutes(wall['to_end'])}: {minutes(wall['saved'])} saved, "
            f"{100 * wall['share']:.0f}% (the machine is shared: steps are the exact measure)."
        )
    if s["best"] is None:
        out.append("- No complete trial: no best to weigh the pruned trials' ends against.")
    elif s["beaten"]:
        out.append(
            f"- Regret: pruning stopped {len(s['beaten'])} trial(s) whose end beats the study's "
            f"best (trial {s['best'][0]}, {obj.text(s['best'][2])}): "
            + ", ".join(f"{n} ({obj.text(s['ends'][n])})" for n in s["beaten"])
            + f"; the study's best with them: {obj.diff(s['regret'])}."
        )
    else:
        out.append(
            f"- Regret: none. No pruned trial, run to the end, beats the study's best (trial "
            f"{s['best'][0]}, {obj.text(s['best'][2])})."
        )
    return "\n".join(out)


def compare_section(
    results: dict,
    arms: tuple[str, str],
    seeds: list[int],
    p: dict,
    spec: str = REALM,
    reused: bool = False,
) -> str:
    first, second = arms
    lines = [
        f"| seed | {first}: recall@1 | {first}: recall@5 | best: recall@1 | best: recall@5 "
        "| difference @1 | difference @5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in seeds:
        a, b = results[first, s], results[second, s]
        d1, d5 = p["recall@1"]["diff"][s], p["recall@5"]["diff"][s]
        seen = " (the search's world)" if s == 0 else ""
        lines.append(
            f"| {s}{seen} | {pct(a['recall@1'])} | {pct(a['recall@5'])} | {pct(b['recall@1'])} "
            f"| {pct(b['recall@5'])} | {100 * d1:+.1f} | {100 * d5:+.1f} |"
        )
    m1, m5 = p["recall@1"], p["recall@5"]
    lines.append(
        f"| mean | {pct(m1['mean'][first])} | {pct(m5['mean'][first])} | "
        f"{pct(m1['mean'][second])} | {pct(m5['mean'][second])} | {100 * m1['mean_diff']:+.1f} "
        f"| {100 * m5['mean_diff']:+.1f} |"
    )
    reuse = (
        f" At seed 0 the best arm is the study's own trial (`ROOT/study/{second}`): the same "
        "command on the same world and seeds, not trained twice."
        if reused
        else ""
    )
    out = [
        f"The study's best trial ({second}) and the recipe (`{spec}` as it is), each trained "
        "to the end at each seed (`ROOT/compare/<arm>-s<seed>`); a seed is the world "
        "study's: its own world, held-out people, ICT warm start and initialisation "
        "(world.seed, data.seed, train.seed). Held-out title recall@k (%) at the last step."
        + reuse,
        "",
        "\n".join(lines),
        "",
    ]
    for k in ("recall@5", "recall@1"):
        q = p[k]
        unseen = (
            f"; over the seeds the search never saw: {100 * q['unseen_mean_diff']:+.1f}"
            if q["unseen_mean_diff"] is not None
            else ""
        )
        out.append(
            f"- best - recipe, {k}: {100 * q['mean_diff']:+.1f} points "
            f"({per_seed(q['diff'])}){unseen}; {better(q['diff'])}."
        )
    return "\n".join(out)


def copy_plots(setup: Setup) -> list[str]:
    """The study's plots copied beside the README (each under MAX_PLOT_BYTES); their names."""
    folder = os.path.join(setup.prefix, "plots")
    out = []
    if not os.path.isdir(folder):  # a study restored from kept/ (its plots are not kept)
        from realm_jax.sweep import table

        study = open_study(setup)
        if study is None or not table.write_plots(study, setup.prefix):
            return out
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.endswith(".png"):
            continue
        if os.path.getsize(path) >= MAX_PLOT_BYTES:
            print(f"report: {path} is {os.path.getsize(path)} bytes: not copied", flush=True)
            continue
        shutil.copyfile(path, os.path.join(setup.plots_to, name))
        out.append(name)
    return out


def ran_line(s: dict, seeds: list[int], workers: int) -> str:
    return (
        f"`sweep` of `{REALM}`'s search, {s['trials']} trials ({s['complete']} complete, "
        f"{s['pruned']} pruned), {workers} workers; the {s['pruned']} pruned trials run again to "
        f"the end; the best trial and the recipe over seeds {','.join(map(str, seeds))}."
    )


def found_line(
    best_name: str, label: str, s: dict, p: dict, seeds: list[int], obj: Objective = Objective()
) -> str:
    """The summary's figures; `best_name` is the best arm's key in `p`, `label` its text."""
    q5 = p["recall@5"]
    unseen = (
        f", {100 * q5['unseen_mean_diff']:+.1f} on the worlds it never saw"
        if q5["unseen_mean_diff"] is not None
        else ""
    )
    regret = (
        "no pruned trial would have beaten the best"
        if not s["beaten"]
        else f"regret {obj.diff(s['regret'])} ({len(s['beaten'])} pruned trial(s) "
        "ended above the best)"
    )
    return (
        f"Best trial ({label}) against the recipe, held-out recall@5 over seeds "
        f"{','.join(map(str, seeds))}: {pct(q5['mean'][best_name])}% against "
        f"{pct(q5['mean']['recipe'])}%, {100 * q5['mean_diff']:+.1f} points "
        f"({per_seed(q5['diff'])}){unseen}; pruning saved "
        f"{100 * s['steps']['share']:.0f}% of the steps against the same trials run to the end, "
        f"{regret}."
    )


def summary(doc: str, *names: str) -> dict:
    """The README summary's lines named (of the five under its title), as set_summary sets them."""
    import re

    out = {}
    for line in open(doc).read().split("\n")[2:7]:
        m = re.match(r"- \*\*(\w+):\*\* (.*)", line)
        if m and m.group(1) in names:
            out[m.group(1)] = m.group(2)
    return out


def set_summary(doc: str, **text: str) -> None:
    """The README summary's lines named in `text` (Ran=..., Found=..., When=...: of the five
    under its title)."""
    import re

    lines = open(doc).read().split("\n")
    for i in range(2, min(7, len(lines))):
        m = re.match(r"- \*\*(\w+):\*\* ", lines[i])
        if m and m.group(1) in text:
            lines[i] = f"- **{m.group(1)}:** {text[m.group(1)]}"
    with open(doc, "w") as f:
        f.write("\n".join(lines))


def report(setup: Setup, seeds: list[int], workers: int = 2) -> None:
    """The README's sections from what has been measured (module docstring: report)."""
    study = open_study(setup)
    if study is None:
        print("report: no study yet", flush=True)
        return
    attrs = study_attrs(study)
    objective = attrs.get("objective", "eval/title_recall@5")
    maximize = study.direction.name == "MAXIMIZE"
    trials = study_trials(study, setup.prefix)
    plots = copy_plots(setup)
    body = study_section(setup, study, trials, plots, workers)
    changed = write_section(SECTIONS[0], body, doc=setup.doc)
    to_end = {j.name: read_run(j.workdir, objective) for j in unpruned_jobs(setup, study)}
    to_end = {n: r for n, r in to_end.items() if r is not None}
    s = None
    try:
        s = savings(trials, to_end, objective, maximize)
    except KeyError as e:
        print(f"report: pruning not measured yet: {e}", flush=True)
    if s is not None:
        body = pruning_section(trials, to_end, s, objective)
        changed |= write_section(SECTIONS[1], body, doc=setup.doc)
    best = best_params(study)
    if best is None:
        print("report: no complete trial: nothing to compare", flush=True)
        return
    results, reused = {}, False
    for j in compare_jobs(setup, best, seeds):
        reused |= j.workdir.startswith(setup.prefix + os.sep)
        r = read_run(j.workdir, objective)
        if r is not None:
            results[j.key] = {f"recall@{k}": r.metric(f"eval/title_recall@{k}") for k in KS}
    arms = ("recipe", best[0])
    if not all((a, sd) in results for a in arms for sd in seeds):
        print(f"report: best against recipe: {len(results)} of {2 * len(seeds)} runs", flush=True)
        return
    p = paired(results, arms, seeds)
    body = compare_section(results, arms, seeds, p, setup.realm, reused)
    changed |= write_section(SECTIONS[2], body, doc=setup.doc)
    if s is not None and os.path.exists(setup.doc):
        from experiments.tools.stage_stamp import commit

        label = params_text(best[1])
        lines = {
            "Ran": ran_line(s, seeds, workers),
            "Found": found_line(best[0], label, s, p, seeds, Objective(objective)),
        }
        if changed or summary(setup.doc, *lines) != lines:  # new figures: When says when
            lines["When"] = time.strftime("%Y-%m-%d", time.gmtime()) + f" (commit {commit()})"
        set_summary(setup.doc, **lines)


# ---------------------------------------------------------------- the kept state

KEPT = os.path.join(HERE, "kept")  # the real study's kept state, committed with the study
KEPT_CURVE = "kept_curve.json"  # a restored run's objective curve (its TensorBoard is not kept)


def finished_workdirs(setup: Setup, study) -> list[str]:
    """The workdirs whose ends the report reads, as paths under ROOT: the study's complete and
    pruned trials', and the unpruned and compare stages' finished runs."""
    out = []
    if study is None:
        return out
    for t in study.get_trials(deepcopy=False):
        wd = trial_workdir(t, setup.prefix)
        if t.state.name in ("COMPLETE", "PRUNED") and wd.startswith(setup.root + os.sep):
            out.append(wd)
    jobs = unpruned_jobs(setup, study)
    best = best_params(study)
    if best is not None:
        jobs += compare_jobs(setup, best, [0, 1, 2])
    return out + [j.workdir for j in jobs if done(j.workdir) and j.workdir not in out]


def keep(setup: Setup) -> None:
    """Copy what the report reads into setup.kept: the study's storage (SQLite's backup, so a
    consistent copy) and each finished run's metrics.json, its wall (<workdir>.run.json) and
    objective curve, a few KB each. Training workdirs (checkpoints, hundreds of MB) are not
    kept: this machine's runs/ does not outlive it, the repository does, so a study of several
    sessions resumes from here (restore())."""
    import sqlite3

    if not setup.kept or open_study(setup) is None:
        return
    study = open_study(setup)
    os.makedirs(setup.kept, exist_ok=True)
    tmp = os.path.join(setup.kept, "study.db.tmp")
    src, dst = sqlite3.connect(os.path.join(setup.prefix, "study.db")), sqlite3.connect(tmp)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    os.replace(tmp, os.path.join(setup.kept, "study.db"))
    objective = study_attrs(study).get("objective", "eval/title_recall@5")
    n = 0
    for wd in finished_workdirs(setup, study):
        to = os.path.join(setup.kept, "runs", os.path.relpath(wd, setup.root))
        if not os.path.exists(os.path.join(wd, "metrics.json")):
            continue  # a trial that ended before its first evaluation
        os.makedirs(to, exist_ok=True)
        shutil.copyfile(os.path.join(wd, "metrics.json"), os.path.join(to, "metrics.json"))
        if os.path.exists(wd + ".run.json"):
            shutil.copyfile(wd + ".run.json", to + ".run.json")
        r = read_run(wd, objective)
        if r is not None and r.curve:
            with open(os.path.join(to, KEPT_CURVE), "w") as f:
                json.dump({str(k): v for k, v in sorted(r.curve.items())}, f)
        n += 1
    print(f"kept: the study and {n} finished runs' ends in {rel(setup.kept)}", flush=True)


def restore(setup: Setup) -> None:
    """What keep() copied, put back where ROOT lacks it: the study's storage (so the sweep
    resumes: a trial that was running is failed by its heartbeat and retried) and the finished
    runs' ends (so they are not run again; their checkpoints are gone)."""
    kept_db = os.path.join(setup.kept, "study.db") if setup.kept else ""
    if not kept_db or not os.path.exists(kept_db):
        return
    n = 0
    if not os.path.exists(os.path.join(setup.prefix, "study.db")):
        os.makedirs(setup.prefix, exist_ok=True)
        shutil.copyfile(kept_db, os.path.join(setup.prefix, "study.db"))
        n += 1
    runs = os.path.join(setup.kept, "runs")
    for here, _, files in os.walk(runs):
        if "metrics.json" not in files:
            continue
        wd = os.path.join(setup.root, os.path.relpath(here, runs))
        if os.path.exists(os.path.join(wd, "metrics.json")):
            continue
        os.makedirs(wd, exist_ok=True)
        for name in ("metrics.json", KEPT_CURVE):
            if name in files:
                shutil.copyfile(os.path.join(here, name), os.path.join(wd, name))
        if os.path.exists(here + ".run.json"):
            shutil.copyfile(here + ".run.json", wd + ".run.json")
        n += 1
    if n:
        print(f"restored from {rel(setup.kept)}: {n} of the study's parts", flush=True)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=None, help="folder of the study's runs (from the repo)")
    p.add_argument("--trials", type=int, default=None, help="the search's trials (default 12)")
    p.add_argument("--workers", type=int, default=2, help="sweep workers, and runs at once")
    p.add_argument("--seeds", default=None, help="best against recipe: comma list (0,1,2)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--plan", action="store_true", help="print each stage's runs; run nothing")
    p.add_argument("--smoke", action="store_true", help="the chain, tiny (module docstring)")
    p.add_argument(
        "--kept",
        default=None,
        help="where the study's state is kept between machines (keep()): default "
        "experiments/sweep_world/kept for the study in its default --root, ROOT/kept for "
        "--smoke or another --root; '' for none",
    )
    a = p.parse_args(argv)
    stages = [s for s in a.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"unknown stages {unknown}: choose from {', '.join(STAGES)}")
    try:
        seeds = [int(s) for s in (a.seeds or ("0" if a.smoke else "0,1,2")).split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: a comma list of integers, e.g. 0,1,2")
    trials = a.trials or (4 if a.smoke else 12)
    if trials < 1 or a.workers < 1:
        p.error("--trials and --workers: at least 1")
    default_root = "runs/sweep-world-smoke" if a.smoke else "runs/sweep-world"
    root = a.root or default_root
    root = root if os.path.isabs(root) else os.path.join(REPO, root)
    kept = a.kept
    if kept is None:
        mine = not a.smoke and root == os.path.join(REPO, default_root)
        kept = KEPT if mine else os.path.join(root, "kept")
    setup = Setup(root, kept=kept and os.path.join(REPO, kept))
    if a.smoke:
        setup = Setup(
            root,
            realm=SMOKE_REALM,
            ict_extra=list(SMOKE_ICT),
            smoke=True,
            doc=os.path.join(root, "README.md"),
            plots_to=root,
            kept=setup.kept,
        )
    os.makedirs(root, exist_ok=True)
    restore(setup)  # --plan too: on a machine that lost ROOT it plans from the kept state
    if a.plan:
        return stages_of(setup, stages, trials, seeds, a)
    # a SIGTERM (a session's end) ends the stages as an exception does, so the state is kept
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return stages_of(setup, stages, trials, seeds, a)
    finally:
        keep(setup)


def needs_world(setup: Setup, stages, trials: int, seed: int, best=None) -> bool:
    """Whether a chosen stage still has a run on `seed`'s world to do."""
    study = open_study(setup)
    if seed == 0:
        if "study" in stages and not study_finished(study, trials):
            return True
        if "unpruned" in stages and study is not None:
            if any(not done(j.workdir) for j in unpruned_jobs(setup, study)):
                return True
    if "compare" in stages and study is not None:
        best = best or best_params(study)
        if best is None:  # compare's runs come from the best trial, not known yet
            return seed == 0 and "study" in stages
        return any(not done(j.workdir) for j in compare_jobs(setup, best, [seed]))
    return False


def stages_of(setup: Setup, stages: list[str], trials: int, seeds: list[int], a) -> int:
    """Run (or with a.plan, print) the chosen stages in order; a world only where a run that
    has not finished needs it (a study restored from its kept state may need none)."""
    if "world" in stages:
        if needs_world(setup, stages, trials, 0):
            make_world(setup, 0, a.plan)
        else:
            print("world s0: not needed (every run on it has finished)", flush=True)
    if "study" in stages:
        run_sweep(setup, trials, a.workers, a.plan)
    study = open_study(setup)
    if "unpruned" in stages:
        if study is None:
            print("unpruned: no study yet (the study stage first)", flush=True)
        else:
            run_jobs(unpruned_jobs(setup, study), a.workers, a.plan)
    if "compare" in stages:
        best = best_params(study) if study is not None else None
        if best is None:
            print("compare: no complete trial yet (the study stage first)", flush=True)
        else:
            for seed in seeds:
                if needs_world(setup, ["compare"], trials, seed, best):
                    make_world(setup, seed, a.plan)
            run_jobs(compare_jobs(setup, best, seeds), a.workers, a.plan)
    if "report" in stages and not a.plan:
        report(setup, seeds, a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
