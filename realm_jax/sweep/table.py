"""A sweep's table, PREFIX/sweep.md and PREFIX/sweep.csv, from what its runs left on disk.

One row per point: its name and overrides, its status (done, failed, skipped: done before
this sweep ran, pending: not run or not finished), the final step, the final train metrics
and the latest held-out evaluation (WORKDIR/metrics.json, written by the training loop) and
the wall time (the DONE or FAILED record the local runner and tpu/sweep.sh write: markers.py).
The CSV has every metric a run wrote; the markdown the ones its task prints on the console.
PREFIX/sweep.json (the plan: config spec, common overrides, points) lets `sweep --table
PREFIX` redo it later, e.g. after a TPU sweep (older tpu/sweep.sh DONE files hold only a
date). PREFIX may be a gs:// URL: every file here is read and written through realm_jax.fs,
each written whole.
"""

from __future__ import annotations

import csv
import io
import json

from realm_jax import fs
from realm_jax.config import ConfigError
from realm_jax.workdir import metrics_path

DONE = "DONE"  # a finished point (markers.py; tpu/sweep.sh skips it too)
FAILED = "FAILED"  # the last run of the point failed
PLAN = "sweep.json"


def save_plan(prefix: str, spec: str, extra, points) -> None:
    """PREFIX/sweep.json: what the sweep runs, so its table can be rebuilt from disk."""
    plan = {"config": spec, "overrides": list(extra)}
    plan["points"] = [{"name": name, "overrides": list(o)} for name, o in points]
    fs.write_text(fs.join(prefix, PLAN), json.dumps(plan, indent=2))


def load_plan(prefix: str) -> dict:
    path = fs.join(prefix, PLAN)
    try:
        plan = json.loads(fs.read_bytes(path))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} not found: not a sweep's workdir prefix; pass --config FILE[:VARIANT] "
            f"--workdir {prefix} --table_only"
        ) from None
    plan["points"] = [(p["name"], p["overrides"]) for p in plan["points"]]
    return plan


def _read_json(path: str) -> dict | None:
    """A JSON record, {} for a marker that is not JSON (an older tpu/sweep.sh's DONE: a date),
    None if absent."""
    try:
        value = json.loads(fs.read_bytes(path))
        return value if isinstance(value, dict) else {}
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def row(prefix: str, name: str, overrides, status: str | None = None) -> dict:
    """One point's row (values as read: numbers stay numbers)."""
    workdir = fs.join(prefix, name)
    done = _read_json(fs.join(workdir, DONE))
    failed = _read_json(fs.join(workdir, FAILED))
    if status is None:
        status = "done" if done is not None else "failed" if failed is not None else "pending"
    record = done if done is not None else failed or {}
    metrics = _read_json(metrics_path(workdir)) or record.get("metrics") or {}
    out = {
        "name": name,
        "overrides": " ".join(o.removeprefix("--config.") for o in overrides),
        "status": status,
        "step": metrics.get("step", record.get("step")),
    }
    out.update({f"train/{k}": v for k, v in metrics.get("train", {}).items()})
    if "eval" in metrics:
        out["eval_step"] = metrics.get("eval_step")
        out.update({f"eval/{k}": v for k, v in metrics["eval"].items()})
    out["wall_s"] = record.get("wall_s")
    keys = metrics.get("console_keys", {})
    out["_shown"] = [f"train/{k}" for k in keys.get("train", [])]
    out["_shown"] += [f"eval/{k}" for k in keys.get("eval", [])]
    return out


def rows(prefix: str, points, status: dict[str, str] | None = None) -> list[dict]:
    status = status or {}
    return [row(prefix, name, overrides, status.get(name)) for name, overrides in points]


def _columns(table: list[dict], shown_only: bool) -> list[str]:
    """name, overrides, status, step, train/*, eval_step, eval/*, wall_s (as first seen)."""
    seen: dict[str, None] = {}
    for r in table:
        for k in r:
            if not k.startswith("_"):
                seen.setdefault(k)
    metric_cols = [k for k in seen if k.startswith(("train/", "eval/"))]
    if shown_only:  # the task's console keys, in its order
        shown = list(dict.fromkeys(k for r in table for k in r["_shown"]))
        if shown:
            metric_cols = [k for k in shown if k in seen]
    train = [k for k in metric_cols if k.startswith("train/")]
    evals = [k for k in metric_cols if k.startswith("eval/")]
    return [
        "name",
        "overrides",
        "status",
        "step",
        *train,
        *(["eval_step"] if "eval_step" in seen else []),
        *evals,
        "wall_s",
    ]


def _md_value(key: str, v) -> str:
    if v is None:
        return ""
    if key == "wall_s":
        m, s = divmod(int(round(v)), 60)
        return f"{m}m{s:02d}s"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def markdown(table: list[dict]) -> str:
    cols = _columns(table, shown_only=True)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table:
        lines.append("| " + " | ".join(_md_value(c, r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def csv_text(table: list[dict]) -> str:
    cols = _columns(table, shown_only=False)
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(cols)
    for r in table:
        w.writerow(["" if r.get(c) is None else r[c] for c in cols])
    return out.getvalue()


def write(prefix: str, table: list[dict], plan: dict | None = None) -> None:
    """PREFIX/sweep.md (headed by the plan's config and overrides) and PREFIX/sweep.csv, each
    replaced whole."""
    md = markdown(table)
    if plan is not None:
        common = " ".join(f"--config.{o}" for o in plan["overrides"])
        md = f"# Sweep `{plan['config']}`{f' `{common}`' if common else ''}\n\n" + md
    for name, text in (("sweep.md", md), ("sweep.csv", csv_text(table))):
        fs.write_text(fs.join(prefix, name), text)
