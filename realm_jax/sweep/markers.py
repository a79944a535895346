"""A sweep point's end markers, WORKDIR/DONE and WORKDIR/FAILED, read and written through
realm_jax.fs, so that a gs:// workdir works as well as a local one.

The local runner (runner.py) writes them itself; tpu/sweep.sh, which runs on a machine where a
gs:// prefix is no folder, calls

    python -m realm_jax.sweep.markers done WORKDIR     # exit 0: DONE exists, 3: it does not
    python -m realm_jax.sweep.markers finish WORKDIR --name P --returncode RC --wall_s S
                                              # exit 0: the point is done, 3: it is not

`finish` decides as the local runner does: DONE for exit status 0 with the run at train.steps
(WORKDIR/metrics.json's `complete`; a SIGTERM'd trainer checkpoints and exits 0 early), else
FAILED, each a JSON record (the step, the metrics, the wall time) that `sweep --table` reads.
A local WORKDIR that is not a folder here (a shared filesystem mounted only on the workers) is
left alone, as before: `done` answers 3 and `finish` writes nothing (and goes by RC alone).
Exit status 2, one line: a bucket that is missing or cannot be reached, or a marker that
cannot be read or written. (3, not 1, is "no": a Python that cannot even import this module
exits 1, which the script must not take for an answer.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from realm_jax import fs
from realm_jax.sweep.table import DONE, FAILED
from realm_jax.workdir import metrics_path

NOT_DONE = 3  # the exit status for "no" (see above)


def now() -> str:
    """UTC now as the markers record it (2026-01-31T12:00:00Z)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_done(workdir: str) -> bool:
    """Whether the point in `workdir` finished (its DONE marker exists)."""
    return fs.exists(fs.join(workdir, DONE))


def finish(workdir: str, record: dict, returncode: int) -> bool:
    """Write WORKDIR/DONE or WORKDIR/FAILED (and remove the other) for a point whose command
    exited with `returncode`; `record` (name, overrides, wall_s, ...) gets the returncode, the
    time, and the run's metrics.json with its step. Returns whether the point is done: exit
    status 0 and, when the run wrote metrics.json, its last step at train.steps."""
    record = {**record, "returncode": returncode, "finished": now()}
    try:
        record["metrics"] = json.loads(fs.read_bytes(metrics_path(workdir)))
        record["step"] = record["metrics"].get("step")
    except FileNotFoundError:
        pass
    ok = returncode == 0 and record.get("metrics", {}).get("complete", True)
    if returncode == 0 and not ok:  # a SIGTERM'd trainer checkpoints and exits 0 early
        record["error"] = f"stopped at step {record['step']} of {record['metrics']['steps']}"
    fs.write_text(
        fs.join(workdir, DONE if ok else FAILED), json.dumps(record, indent=2, sort_keys=True)
    )
    fs.remove(fs.join(workdir, FAILED if ok else DONE))
    return ok


def _mounted(workdir: str) -> bool:
    """A gs:// workdir always is; a local one when its folder exists on this machine."""
    return fs.is_remote(workdir) or fs.isdir(workdir)


def main(argv: list[str] | None = None) -> int:
    """The command line above (tpu/sweep.sh's); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m realm_jax.sweep.markers",
        description="A sweep point's DONE/FAILED markers, local or gs:// (tpu/sweep.sh).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    done = sub.add_parser("done", help=f"exit 0 if WORKDIR/DONE exists, {NOT_DONE} if not")
    done.add_argument("workdir")
    end = sub.add_parser(
        "finish",
        help=f"write WORKDIR/DONE (exit 0) or FAILED (exit {NOT_DONE}) for a point that ended",
    )
    end.add_argument("workdir")
    end.add_argument("--name", required=True, help="the point's name")
    end.add_argument("--returncode", type=int, required=True, help="its command's exit status")
    end.add_argument("--wall_s", type=float, default=None, help="its wall time in seconds")
    args = parser.parse_args(argv)
    workdir = fs.abspath(args.workdir)
    try:
        fs.check_buckets([workdir])
        if args.action == "done":
            return 0 if _mounted(workdir) and is_done(workdir) else NOT_DONE
        if not _mounted(workdir):
            print(f"{workdir} is not mounted here: no {DONE}/{FAILED} marker written")
            return 0 if args.returncode == 0 else NOT_DONE
        record = {"name": args.name, "wall_s": args.wall_s, "by": "tpu/sweep.sh"}
        ok = finish(workdir, record, args.returncode)
        print(f"wrote {fs.join(workdir, DONE if ok else FAILED)}")
        return 0 if ok else NOT_DONE
    except (fs.StorageError, OSError, ValueError) as e:  # ValueError: a metrics.json not JSON
        print(f"realm_jax.sweep.markers: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
