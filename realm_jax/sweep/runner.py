"""Run a sweep's points one after another on this machine, each as its own `python -m
realm_jax` process in PREFIX/<point>, or hand them to tpu/sweep.sh for a TPU VM.

Locally: every point's config is loaded and validated first (nothing runs if one fails); the
data is prepared once per distinct `data` section into a folder the points share (or the
config's own data.data_dir); then each point trains, its output streamed with a
`[point i/n NAME]` prefix and kept in PREFIX/<point>/sweep.log. A point that exits 0 having
reached train.steps gets PREFIX/<point>/DONE (JSON: final step, metrics, wall time) and is
skipped when the sweep is re-run; one that fails gets FAILED and the sweep goes on.
PREFIX/sweep.md and sweep.csv are rewritten after every point (table.py).

PREFIX may be a gs:// URL: the markers, sweep.json and the table are read and written through
realm_jax.fs (each file whole), and the points' commands get the URL unchanged. A point's
sweep.log is appended line by line as it runs, which an object store cannot do: with a gs://
PREFIX it is kept on this machine (log_path()) and copied to PREFIX/<point>/sweep.log when the
point ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time

from realm_jax import fs
from realm_jax.config import ConfigError, load_config, validate
from realm_jax.sweep import markers, table
from realm_jax.sweep.points import resolve_spec, sweep_points
from realm_jax.workdir import data_dir

# The command that trains a config's task (cli.TASK_COMMANDS): REALM's `local` runs the
# refresh job beside the trainer (none with refresh.mode=inprocess or amortized).
RUN_COMMAND = {"realm": "local", "ict": "train", "qa": "finetune"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_json(path: str, value: dict) -> None:
    fs.write_text(path, json.dumps(value, indent=2, sort_keys=True))


def _minutes(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


class Point:
    """One point: its name, its own overrides, its full config and where it runs."""

    def __init__(self, name: str, overrides: list[str], config, prefix: str):
        self.name, self.overrides, self.config = name, overrides, config
        self.workdir = fs.join(prefix, name)
        self.data_dir = ""  # the prepared data it trains on (set by _data_groups)

    def done(self) -> bool:
        return markers.is_done(self.workdir)

    def log_path(self) -> str:
        """Where the point's output is appended while it runs: WORKDIR/sweep.log, or for a
        gs:// workdir a local file under fs.cache_root()/sweep-logs/ (copied up at the end)."""
        if not fs.is_remote(self.workdir):
            return fs.join(self.workdir, "sweep.log")
        rel = self.workdir.partition("://")[2]
        return os.path.join(fs.cache_root(), "sweep-logs", *rel.split("/"), "sweep.log")


def load_points(spec: str, prefix: str, extra: list[str]) -> list[Point]:
    """Every point with its config loaded and validated (ConfigError names the point), and a
    task this runner knows how to train."""
    out = []
    for name, overrides in sweep_points(spec, extra):
        own = [o.removeprefix("--config.") for o in overrides]
        try:
            config = load_config(spec, [*extra, *own])
            validate(config)
        except ConfigError as e:
            raise ConfigError(f"sweep point {name}: {e}") from None
        if config.get("task", "realm") not in RUN_COMMAND:
            raise ConfigError(f"sweep point {name}: task={config.task!r} has no training command")
        out.append(Point(name, overrides, config, prefix))
    return out


# data fields that only the reader of a prepared folder uses (the masks drawn at read time,
# grain's worker processes): points differing in them share one prepared folder
READ_TIME_DATA_FIELDS = ("data_dir", "mask_mode", "eval_mask_mode", "worker_count")


def _data_key(config) -> str:
    """What a prepared folder depends on: the `data` section but where it lives and what is
    read-time only (conservative: another field prepare ignores only costs a second prepare)."""
    fields = {k: v for k, v in config.data.to_dict().items() if k not in READ_TIME_DATA_FIELDS}
    return json.dumps(fields, sort_keys=True, default=str)


def _data_groups(points: list[Point], prefix: str) -> dict[str, list[Point]]:
    """{data folder: its points}. A config that names data.data_dir keeps it; otherwise points
    with equal data sections share PREFIX/data (PREFIX/data-<hash> when they differ)."""
    keys = {_data_key(p.config) for p in points if not p.config.data.data_dir}
    groups: dict[str, list[Point]] = {}
    for p in points:
        if p.config.data.data_dir:
            p.data_dir = data_dir(p.config, p.workdir)
        else:
            key = _data_key(p.config)
            suffix = "" if len(keys) == 1 else "-" + hashlib.sha1(key.encode()).hexdigest()[:8]
            p.data_dir = fs.join(prefix, "data" + suffix)
        groups.setdefault(p.data_dir, []).append(p)
    for folder, members in groups.items():
        differ = {_data_key(p.config) for p in members}
        if len(differ) > 1:
            raise ConfigError(
                f"sweep points {', '.join(p.name for p in members)} share data.data_dir={folder} "
                "but not their data fields; let each prepare its own (drop data.data_dir)"
            )
    return groups


def _command(command: str, spec: str, workdir: str, extra, overrides, ddir, cpu_devices):
    cmd = [sys.executable, "-m", "realm_jax", command, "--config", spec, "--workdir", workdir]
    if cpu_devices:
        cmd += ["--cpu_devices", str(cpu_devices)]
    return (
        cmd
        + [f"--config.{o}" for o in extra]
        + list(overrides)
        + [f"--config.data.data_dir={ddir}"]
    )


def _stream(cmd: list[str], label: str, log_path: str | None) -> int:
    """Run cmd, every output line printed as `label line` (and appended to log_path)."""
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    try:
        if log:
            log.write(f"# {markers.now()} {shlex.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        try:
            for line in proc.stdout:
                print(f"{label} {line}", end="", flush=True)
                if log:
                    log.write(line)
            return proc.wait()
        except KeyboardInterrupt:  # the child got the SIGINT too: let it checkpoint and exit
            proc.wait()
            raise
    finally:
        if log:
            log.close()


def _train_point(p: Point, cmd: list[str], label: str) -> tuple[bool, float]:
    """Train one point; DONE (or FAILED) in its workdir says how it ended."""
    fs.makedirs(p.workdir)
    for marker in (table.DONE, table.FAILED):
        fs.remove(fs.join(p.workdir, marker))
    log_path = p.log_path()
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    start = time.time()
    try:
        rc = _stream(cmd, label, log_path)
    finally:  # interrupted too: the log beside the run
        if fs.is_remote(p.workdir):
            fs.write_bytes(fs.join(p.workdir, "sweep.log"), fs.read_bytes(log_path))
    wall = time.time() - start
    record = {"name": p.name, "overrides": p.overrides, "wall_s": wall, "command": cmd}
    return markers.finish(p.workdir, record, rc), wall  # as tpu/sweep.sh's points end


def run_local(spec, prefix, extra, *, cpu_devices=0, dry_run=False, only=()) -> int:
    """Prepare, then train every point not yet done (of `only`'s names when given); exit
    status 1 if any failed, 130 when interrupted (the point in progress stays pending: its
    trainer checkpointed)."""
    spec, prefix = resolve_spec(spec), fs.abspath(prefix)
    points = load_points(spec, prefix, extra)
    unknown = sorted(set(only) - {p.name for p in points})
    if unknown:
        names = ", ".join(p.name for p in points)
        raise ConfigError(f"--only: no sweep point named {', '.join(unknown)} (points: {names})")
    groups = _data_groups(points, prefix)
    pending = [p for p in points if not p.done() and (not only or p.name in only)]
    prepares = [
        (folder, _command("prepare", spec, prefix, extra, members[0].overrides, folder, 0))
        for folder, members in groups.items()
        if any(p in pending for p in members)
    ]
    runs = [
        (p, _command(RUN_COMMAND[p.config.task], spec, p.workdir, extra, p.overrides,
                     p.data_dir, cpu_devices))
        for p in pending
    ]  # fmt: skip
    if dry_run:
        for _, cmd in prepares + runs:
            print(shlex.join(cmd))
        return 0
    fs.check_buckets([prefix])
    fs.makedirs(prefix)
    table.save_plan(prefix, spec, extra, [(p.name, p.overrides) for p in points])
    status = {p.name: "skipped" for p in points if p not in pending and p.done()}
    status |= {p.name: "pending" for p in points if p not in pending and not p.done()}
    for name, why in status.items():
        if why == "skipped":
            print(f"sweep: skipping {name}: {fs.join(prefix, name, table.DONE)} exists")
        else:
            print(f"sweep: leaving {name} pending (not in --only)")
    try:
        _run_points(points, prepares, runs, status, prefix)
    except KeyboardInterrupt:
        status.update({p.name: "pending" for p in pending if p.name not in status})
        rewrite_table(prefix, status)
        print("sweep: interrupted; re-run the same command to go on", file=sys.stderr)
        return 130
    rewrite_table(prefix, status)
    failed = [name for name, s in status.items() if s == "failed"]
    print(f"sweep: wrote {fs.join(prefix, 'sweep.md')} and sweep.csv", flush=True)
    if failed:
        print(f"sweep: failed points: {' '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _run_points(points, prepares, runs, status: dict, prefix: str) -> None:
    """Prepare each data folder, then train the points in turn (status[name] as each ends),
    with the progress and ETA after each point and the table rewritten."""
    unprepared = set()
    for folder, cmd in prepares:
        if _stream(cmd, f"[prepare {fs.basename(folder)}]", None) != 0:
            print(f"sweep: preparing {folder} failed; its points fail", file=sys.stderr)
            unprepared.add(folder)
    t0, walls, n = time.time(), [], len(points)
    for k, (p, cmd) in enumerate(runs):
        i = points.index(p) + 1
        if p.data_dir in unprepared:
            fs.makedirs(p.workdir)
            record = {"name": p.name, "overrides": p.overrides, "finished": markers.now()}
            record["error"] = f"preparing {p.data_dir} failed"
            _write_json(fs.join(p.workdir, table.FAILED), record)
            status[p.name] = "failed"
            continue
        print(f"sweep: point {i}/{n} {p.name}: {shlex.join(cmd)}", flush=True)
        ok, wall = _train_point(p, cmd, f"[point {i}/{n} {p.name}]")
        walls.append(wall)
        status[p.name] = "done" if ok else "failed"
        if not ok:
            print(f"sweep: point {p.name} failed (log {p.log_path()})", file=sys.stderr)
        left = sum(q.data_dir not in unprepared for q, _ in runs[k + 1 :])
        print(
            f"sweep: {k + 1}/{len(runs)} points run in {_minutes(time.time() - t0)}, "
            f"{sum(s == 'failed' for s in status.values())} failed; "
            f"ETA {_minutes(sum(walls) / len(walls) * left)}",
            flush=True,
        )
        rewrite_table(prefix, status)


def rewrite_table(prefix: str, status: dict[str, str] | None = None) -> None:
    """PREFIX/sweep.md and sweep.csv from PREFIX/sweep.json and the points' workdirs."""
    plan = table.load_plan(prefix)
    table.write(prefix, table.rows(prefix, plan["points"], status), plan)


def run_tpu(spec, prefix, extra, tpu, *, prepare=False, dry_run=False) -> int:
    """tpu/sweep.sh NAME ZONE PREFIX SPEC: one tpu/launch.sh job per point (the points come
    from `python -m realm_jax.sweep`, as here). Returns its exit status."""
    spec = resolve_spec(spec)
    points = sweep_points(spec, extra)  # fail here, before a pod is touched
    path, variant = spec.rsplit(":", 1)
    rel = os.path.relpath(os.path.abspath(path), REPO)
    if rel.startswith(".."):
        raise ConfigError(f"{path}: a TPU sweep's config must be inside the repo ({REPO})")
    spec = f"{rel}:{variant}"  # as tpu/sweep.sh and the workers see it
    cmd = [os.path.join(REPO, "tpu", "sweep.sh")]
    cmd += ["--dry-run"] * dry_run + ["--prepare"] * prepare
    cmd += [*tpu, prefix, spec, *(f"--config.{o}" for o in extra)]
    # gs://, or the shared filesystem mounted here too: record the plan for `sweep --table`
    if not dry_run and (fs.is_remote(prefix) or os.path.isdir(prefix)):
        fs.check_buckets([prefix])
        table.save_plan(prefix, spec, extra, points)
    return subprocess.call(cmd, cwd=REPO)
