"""`realm-jax sweep`: a config's sweep() as an Optuna study, run by N worker processes.

    sweep --config FILE:VARIANT --workdir PREFIX [--workers N] [--trials N] [--storage URL]
          [--study NAME] [--tpu NAME:ZONE[,...]] [--dry_run] [--config.k=v ...]

The sweep is checked first (space.load: one error line, nothing run). Then the study is created
in the storage, or loaded (the same study name and storage resume it: finished trials are never
repeated), a grid's points not yet run are enqueued (a failed point again), the data is prepared
once per distinct data section (locally), and the workers start: worker.py, each in its own
session with its devices (devices.py) or its TPU slice (--tpu: worker i on slice i), dying with
this process. Ctrl-C reaches them as one SIGINT each (their trainers checkpoint), exit 130; the
same command resumes. At the end PREFIX/sweep.md, sweep.csv and plots/ are written (table.py)
and the best trial's command printed. Exit status 1 when a trial of this run failed and was not
run again to the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys

from realm_jax import fs
from realm_jax.config import ConfigError, load_config
from realm_jax.sweep import devices, space, storage, table
from realm_jax.sweep.launch import Plan, data_folder, die_with_parent, prepare_command

STUDY = "sweep"  # --study's default


def parse_slices(text: str) -> list[list[str]]:
    """ "a:us-central2-b,b:europe-west4-a" -> [["a", "us-central2-b"], ["b", ...]]."""
    out = []
    for part in text.split(","):
        name, _, zone = part.strip().partition(":")
        if not name or not zone:
            raise ConfigError(f"--tpu {text}: each slice is NAME:ZONE (comma-separated)")
        out.append([name, zone])
    if len({n for n, _ in out}) != len(out):
        raise ConfigError(f"--tpu {text}: a slice is named twice")
    return out


def _summary(sweep: space.Study, trials: int, workers: int) -> str:
    what = (
        f"a grid of {len(sweep.points)} points"
        if sweep.kind == "grid"
        else f"a {sweep.sampler} search of {trials} trials over {', '.join(sweep.params)}"
    )
    return (
        f"{what}, objective {sweep.objective} ({sweep.direction}), pruner {sweep.pruner}, "
        f"{workers} worker{'s' * (workers > 1)}"
    )


def _open_study(sweep: space.Study, url: str, name: str):
    """The study, created or loaded; ConfigError when the one there is another sweep's."""
    import optuna

    st = storage.open_storage(url, create=True)
    study = storage.retrying(
        lambda: optuna.create_study(
            storage=st, study_name=name, direction=sweep.direction, load_if_exists=True
        ),
        "opening the study",
    )
    attrs = sweep.to_attrs()
    have = study.user_attrs.get("realm_jax")
    if study.direction.name.lower() != sweep.direction:
        raise ConfigError(
            f"study {name!r} in {storage.redact(url)} has direction "
            f"{study.direction.name.lower()}; this sweep {sweep.direction}"
        )
    if have and have != attrs:
        diff = [k for k in attrs if have.get(k) != attrs[k]]
        raise ConfigError(
            f"study {name!r} in {storage.redact(url)} is another sweep's (its "
            + ", ".join(f"{k} {have.get(k)!r}" for k in diff)
            + "): pass the same config and overrides to resume it, or --study NEW"
        )
    if not have:
        study.set_user_attr("realm_jax", attrs)
    return study


def _enqueue_grid(sweep: space.Study, study) -> int:
    """Enqueue the grid's points without a complete, pruned, running or waiting trial (a
    failed point is run again, `rerun_of` its last failed trial). Returns how many."""
    n = 0
    for point in sweep.points:
        trials = study.get_trials(deepcopy=False)
        same = [t for t in trials if table.trial_params(t) == point]
        if any(t.state.name in ("COMPLETE", "PRUNED", "RUNNING", "WAITING") for t in same):
            continue
        failed = [t.number for t in same if t.state.name == "FAIL"]
        study.enqueue_trial(point, user_attrs={"rerun_of": failed[-1]} if failed else None)
        n += 1
    return n


def _data_folders(sweep: space.Study, prefix: str) -> dict[str, dict]:
    """{data folder: a point that prepares it}: a grid's points' folders, a search's base
    config's (a trial whose params change its data section prepares its own)."""
    base = load_config(sweep.spec, sweep.extra)
    points = sweep.points if sweep.kind == "grid" else [{}]
    out: dict[str, dict] = {}
    for point in points:
        config = space.point_config(sweep, point) if point else base
        out.setdefault(data_folder(config, base, prefix), point)
    return out


def _check_tpu_data(folders: dict[str, dict]) -> None:
    from realm_jax.data.datasets import SUMMARY

    missing = [f for f in folders if not fs.exists(fs.join(f, SUMMARY))]
    if missing:
        raise ConfigError(
            f"--tpu: no prepared data in {', '.join(missing)}: prepare it first "
            "(tpu/launch.sh --prepare NAME ZONE WORKDIR SPEC --config.data.data_dir=FOLDER ...)"
        )


def run(args, overrides: list[str]) -> int:
    """The sweep command (module docstring)."""
    sweep = space.load(args.config, overrides)
    prefix = fs.abspath(args.workdir)
    url = args.storage or storage.default_url(prefix)
    slices = parse_slices(args.tpu) if args.tpu else []
    storage.check(url, prefix, bool(slices))
    workers = args.workers or len(slices) or 1
    if slices and workers != len(slices):
        raise ConfigError(f"--workers {workers} with {len(slices)} TPU slices: one worker a slice")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: at least 1")
    if slices:  # the TPU VMs run the config by its path in their copy of the repo
        from realm_jax.sweep.launch import REPO

        path = sweep.spec.rsplit(":", 1)[0]
        if os.path.relpath(os.path.abspath(path), REPO).startswith(".."):
            raise ConfigError(f"{path}: a TPU sweep's config must be inside the repo ({REPO})")
    if not 0 < args.heartbeat_s < args.grace_s:
        raise ConfigError(
            f"--heartbeat_s {args.heartbeat_s:g} and --grace_s {args.grace_s:g}: "
            "need 0 < heartbeat_s < grace_s"
        )
    if sweep.kind == "grid" and args.trials:
        raise ConfigError(
            f"--trials bounds a search; this sweep is a grid of {len(sweep.points)} points"
        )
    trials = args.trials or sweep.trials
    envs = [{}] * workers
    if not slices:
        info = devices.platform_info()
        envs = [devices.worker_env(i, workers, info) for i in range(workers)]
    folders = _data_folders(sweep, prefix)
    plan = Plan(
        spec=sweep.spec,
        extra=list(sweep.extra),
        prefix=prefix,
        storage=url,
        study=args.study or STUDY,
        workers=workers,
        trials=trials,
        cpu_devices=args.cpu_devices,
        heartbeat_s=args.heartbeat_s,
        grace_s=args.grace_s,
    )
    print(
        f"sweep: {_summary(sweep, trials, workers)}; study {plan.study!r} in {storage.redact(url)}",
        flush=True,
    )
    if args.dry_run:
        return _dry_run(sweep, plan, folders, slices, envs)
    fs.check_buckets([prefix, *folders])
    if slices:
        _check_tpu_data(folders)
    fs.makedirs(prefix)
    study = _open_study(sweep, url, plan.study)
    storage.fail_stale(study, plan.grace_s)  # a crashed earlier run's trials
    plan.first_number = len(study.get_trials(deepcopy=False))  # this run's trials: from here
    if sweep.kind == "grid":
        n = _enqueue_grid(sweep, study)
        print(f"sweep: {n} of {len(sweep.points)} grid points to run", flush=True)
    if not _pending(sweep, study, trials):
        print("sweep: every trial of the study is finished", flush=True)
        return _finish(study, plan, 0)
    if not slices:
        for folder, point in folders.items():
            cmd = prepare_command(plan, point, folder)
            print(f"sweep: {shlex.join(cmd)}", flush=True)
            if subprocess.call(cmd, stdin=subprocess.DEVNULL) != 0:
                raise ConfigError(f"preparing {folder} failed (above); nothing trained")
            plan.prepared.append(folder)
    rc = _run_workers(plan, slices, envs)
    return _finish(study, plan, rc)


def _pending(sweep: space.Study, study, trials: int) -> bool:
    """Whether the study has trials left to run (waiting, running, or a search's budget)."""
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    if "WAITING" in states or "RUNNING" in states:
        return True
    done = states.count("COMPLETE") + states.count("PRUNED")
    return sweep.kind == "search" and done < trials


def _worker_plans(plan: Plan, slices, envs) -> list[tuple[Plan, dict]]:
    out = []
    for i in range(plan.workers):
        p = dataclasses.replace(plan, worker=i, tpu=slices[i] if slices else None)
        out.append((p, envs[i]))
    return out


def _run_workers(plan: Plan, slices, envs) -> int:
    """Start the workers, wait for them; Ctrl-C: one SIGINT each, wait, 130."""
    procs = []
    for p, env in _worker_plans(plan, slices, envs):
        cmd = [sys.executable, "-m", "realm_jax.sweep.worker", json.dumps(dataclasses.asdict(p))]
        procs.append(
            subprocess.Popen(
                cmd,
                env=dict(os.environ, **env),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        )

    def stop(signum, _frame):  # SIGTERM as Ctrl-C: the workers stop their trials cleanly
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, stop), signal.getsignal(signal.SIGINT)
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        print(
            "sweep: interrupted: the trials in progress checkpoint and stop",
            file=sys.stderr,
            flush=True,
        )
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C: still wait for them
            signal.signal(sig, signal.SIG_IGN)
        for p in procs:
            p.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    if any(c == 130 for c in codes):
        return 130
    for i, c in enumerate(codes):
        if c < 0:  # killed: its trial, failed by the others' heartbeat check, ran again
            print(f"sweep: worker {i} was killed (signal {-c})", file=sys.stderr, flush=True)
    bad = [i for i, c in enumerate(codes) if c > 0]
    if bad:
        print(
            f"sweep: worker(s) {', '.join(map(str, bad))} exited with "
            f"{', '.join(str(codes[i]) for i in bad)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def _finish(study, plan: Plan, rc: int) -> int:
    """The table and plots, the best command, the failures of this run."""
    line = table.write(study, plan.prefix)
    trials = study.get_trials(deepcopy=False)
    retried = table._retried_by(trials)
    ok = {t.number for t in trials if t.state.name in ("COMPLETE", "PRUNED")}

    def settled(n: int) -> bool:  # ended well, or run again and that one ended well
        seen = set()
        while n not in ok and n in retried and n not in seen:
            seen.add(n)
            n = retried[n]
        return n in ok

    failed = [
        t
        for t in trials
        if t.number >= plan.first_number and t.state.name == "FAIL" and not settled(t.number)
    ]
    print(f"sweep: wrote {fs.join(plan.prefix, 'sweep.md')}, sweep.csv and plots/", flush=True)
    if line:
        print(f"sweep: the best trial's config: {line}", flush=True)
    if rc == 130:
        print("sweep: interrupted; re-run the same command to go on", file=sys.stderr)
        return 130
    if failed:
        print(
            "sweep: failed trials: "
            + ", ".join(f"{t.number} ({t.user_attrs.get('fail_reason', '')})" for t in failed),
            file=sys.stderr,
        )
        return 1
    return rc


def _dry_run(sweep: space.Study, plan: Plan, folders, slices, envs) -> int:
    """Print what would run: the prepares, and per worker its environment and trial commands (a
    grid's points; a search's with its params to be sampled)."""
    from realm_jax.sweep.launch import trial_command

    if not slices:
        for folder, point in folders.items():
            print(shlex.join(prepare_command(plan, point, folder)))
    points = (
        sweep.points
        if sweep.kind == "grid"
        else [{k: f"<{p.kind}>" for k, p in sweep.params.items()}]
    )
    base = load_config(sweep.spec, sweep.extra)
    for i, (p, env) in enumerate(_worker_plans(plan, slices, envs)):
        where = (
            f"slice {':'.join(p.tpu)}" if p.tpu else " ".join(f"{k}={v}" for k, v in env.items())
        )
        print(f"# worker {i}{': ' + where if where else ''}")
        for j, point in enumerate(points):
            if sweep.kind == "grid" and j % plan.workers != i:
                continue  # the points are shared out as the workers ask (here: round robin)
            name = space.run_name(point)
            config = space.point_config(sweep, point) if sweep.kind == "grid" else base
            folder = data_folder(config, base, plan.prefix)
            link = "{...}"  # REALM_JAX_TRIAL: the trial's link to the study (sweep/trial.py)
            cmd = trial_command(
                p, sweep.task, name, fs.join(plan.prefix, name), point, folder, link
            )
            print(shlex.join(cmd))
    return 0


def table_command(args) -> int:
    """`sweep --table PREFIX`: rewrite the table and plots from the study."""
    import optuna

    prefix = fs.abspath(args.table)
    if fs.is_remote(prefix) and not args.storage:
        raise ConfigError(f"--table {prefix}: name the study's database with --storage URL")
    fs.check_buckets([prefix])  # a bucket that is not there: one line, before the database
    url = args.storage or storage.default_url(prefix)
    if url.startswith("sqlite:") and not fs.exists(url.split("sqlite:///", 1)[-1]):
        raise ConfigError(
            f"{url.split('sqlite:///', 1)[-1]} not found: not a sweep's prefix "
            "(or pass --storage URL)"
        )
    st = storage.open_storage(url)
    name = args.study or STUDY
    try:
        study = optuna.load_study(study_name=name, storage=st)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(st)]
        raise ConfigError(
            f"no study {name!r} in {storage.redact(url)} (it has: {', '.join(names) or 'none'})"
        ) from None
    if not fs.isdir(prefix):
        fs.makedirs(prefix)
    line = table.write(study, prefix)
    print(f"wrote {fs.join(prefix, 'sweep.md')}, sweep.csv and plots/")
    if line:
        print(f"the best trial's config: {line}")
    return 0
