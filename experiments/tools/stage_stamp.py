"""Stage stamps for multi-stage benchmarks (experiments/squad_qa/squad_qa.py): a stage's workdir is
reused only when it was made by the same config and the same code, else it is set aside and the
stage runs again. A stage's stamp includes the stamps of the stages it builds on, so a re-run ICT
makes REALM, fine-tuning and the evaluations run again too.

The stamp is the sha256 of: the resolved config (every field, after the variant and overrides),
the contents of every .py file under realm_jax/ and configs/ (the code as it is on disk,
committed or not), and the upstream stamps. It is written to <workdir>/stage.json once the
stage has finished; the commit it was made at is recorded beside it (with "+dirty" when the
tree had uncommitted changes), so a doc can say which commit produced its table.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAMP = "stage.json"


def code_digest() -> str:
    """sha256 over every .py file of the package and the configs (path and contents)."""
    h = hashlib.sha256()
    for top in ("realm_jax", "configs"):
        for dirpath, dirs, names in sorted(os.walk(os.path.join(ROOT, top))):
            dirs.sort()
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def commit() -> str:
    """The HEAD commit, with '+dirty' when package or config files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "realm_jax", "configs"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def stamp(config_spec: str, overrides: list[str], upstream: list[str]) -> str:
    """The stage's identity: resolved config + code + upstream stamps."""
    from realm_jax.config import load_config

    config = load_config(config_spec, overrides).to_json(sort_keys=True)
    h = hashlib.sha256(config.encode() + b"\0" + code_digest().encode())
    for up in upstream:
        h.update(b"\0" + up.encode())
    return h.hexdigest()


def _read(workdir: str) -> dict:
    path = os.path.join(workdir, STAMP)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def current(workdir: str, want: str) -> bool:
    """Whether `workdir` holds a finished stage made with stamp `want`."""
    record = _read(workdir)
    return record.get("stamp") == want and bool(record.get("finished"))


def started(workdir: str, want: str) -> bool:
    """Whether `workdir` holds an unfinished run of the same stage (resumable as it is)."""
    record = _read(workdir)
    return record.get("stamp") == want and not record.get("finished")


def made_at(workdir: str) -> str:
    """The commit recorded in a finished stage's stamp ('unknown' without one)."""
    return _read(workdir).get("commit", "unknown")


def write(workdir: str, want: str, finished: bool = True) -> None:
    """Record the stage's stamp: before it runs (finished=False: a resumable start) and when
    it has finished."""
    os.makedirs(workdir, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = {"stamp": want, "commit": commit(), "finished": now if finished else None}
    with open(os.path.join(workdir, STAMP), "w") as f:
        json.dump(record, f, indent=2)


def begin(name: str, workdir: str, want: str) -> bool:
    """Whether stage `name` must run in `workdir` for stamp `want`: False when a finished run
    with that stamp is there; else an unfinished run with it is resumed as it is, and anything
    else is set aside before the unfinished stamp is written."""
    if current(workdir, want):
        print(f"{name}: done already by this config and code ({workdir})", flush=True)
        return False
    if not started(workdir, want):
        moved = set_aside(workdir)
        if moved:
            print(f"{name}: {workdir} was made by another config or code: moved to {moved}")
        write(workdir, want, finished=False)
    return True


def set_aside(workdir: str) -> str | None:
    """Move a stale workdir out of the way (never deleted): <workdir>.stale-<UTC time>."""
    if not os.path.exists(workdir):
        return None
    when = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    dest = f"{workdir}.stale-{when}"
    os.rename(workdir, dest)
    return dest


def run(args: list[str]) -> dict:
    """Run `python -m realm_jax ARGS` from the repository root (a stage of a multi-stage
    benchmark); its wall and CPU seconds (children's rusage)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    print("+ python -m realm_jax " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "realm_jax", *args], cwd=ROOT, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_seconds": time.perf_counter() - t0, "cpu_seconds": cpu}
