"""The studies' way of running realm-jax as a user does: one `python -m realm_jax` process per
stage from the repository root, its output in a log file, and whether a run finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args: list[str], log: str, append: bool = False) -> float:
    """`python -m realm_jax ARGS` from the repository root, its output into `log` (after what
    it holds, with `append`: a resumed run's log keeps the earlier part); raises on a non-zero
    exit. Returns its wall time in seconds."""
    cmd = [sys.executable, "-m", "realm_jax", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    t = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    with open(log, "a" if append else "w") as f:
        subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True)
    print(f"  done in {time.time() - t:.0f} s (log {log})", flush=True)
    return time.time() - t


def done(workdir: str) -> bool:
    """Whether a training run in `workdir` finished (its metrics.json says complete)."""
    path = os.path.join(workdir, "metrics.json")
    return os.path.exists(path) and json.load(open(path)).get("complete", False)


def chosen_arms(parser, text: str, known) -> list[str]:
    """The comma list of a study's --arms, each one of `known`; an unknown one is the
    parser's usage error (exit 2) naming the choices."""
    arms = [x for x in text.split(",") if x]
    unknown = [x for x in arms if x not in known]
    if unknown:
        parser.error(f"unknown arms {unknown}: choose from {', '.join(known)}")
    return arms


class Ledger:
    """A study's finished arms, kept in the repository (one JSON file each under `folder`),
    so a long study accumulates across machines whose runs/ does not last: an arm recorded
    here is read back instead of run again. Each record holds what the arm measured, the
    command that measured it, its commit and its date; delete a record's file to run it again.
    """

    def __init__(self, folder: str):
        self.folder = folder

    def path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.json")

    def get(self, key: str) -> dict | None:
        """The record of `key`, or None where it was not measured."""
        p = self.path(key)
        return json.load(open(p)) if os.path.exists(p) else None

    def put(self, key: str, measured: dict, command: str, seconds: float | None = None) -> dict:
        """Record `measured` for `key` (written whole, then renamed: never half a record)."""
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        record = {
            "measured": measured,
            "command": command,
            "commit": commit or None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seconds": None if seconds is None else round(seconds, 1),
        }
        os.makedirs(self.folder, exist_ok=True)
        tmp = self.path(key) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self.path(key))
        return record
