"""A sweep's results from its study: PREFIX/sweep.md, PREFIX/sweep.csv and PREFIX/plots/*.png.

One row per trial, in trial order: its number and name, its state (COMPLETE, PRUNED at step S,
FAIL with why and the trial that retried it, RUNNING, WAITING), the objective's value, the run's
last step, its params as overrides, its wall time and workdir, then what the run wrote in
WORKDIR/metrics.json: the final train metrics and the latest held-out evaluation (for the last
trial that ran in a workdir only: a failed trial retried in place shows its reason, not its
retry's metrics). The CSV has
every metric; the markdown the ones the task prints on the console. sweep.md ends with the best
trial and its config as a ready command. Plots (optuna.visualization.matplotlib, Agg): the
optimization history, the parameter importances (from 2 complete trials, with more than one
parameter) and the intermediate values (every trial's held-out curve, the pruned ones' cut short).
Everything is read from the storage and the trials' workdirs (fs: gs:// too), so `sweep --table
PREFIX` rewrites it at any time; each file is replaced whole.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import shlex

from realm_jax import fs
from realm_jax.sweep import space
from realm_jax.workdir import metrics_path

log = logging.getLogger("realm_jax.sweep")

BEST = "best"  # the best trial's command trains in PREFIX/best


def _read_json(path: str) -> dict:
    try:
        value = json.loads(fs.read_bytes(path))
        return value if isinstance(value, dict) else {}
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return {}


def trial_params(t) -> dict:
    """A trial's params: set, or fixed for a trial still waiting."""
    return dict(t.params or t.system_attrs.get("fixed_params") or {})


def _retried_by(trials) -> dict[int, int]:
    """{failed trial number: the number of the trial that ran it again}."""
    out = {}
    for t in trials:
        history = t.system_attrs.get("retry_history") or []
        rerun = t.user_attrs.get("rerun_of")
        for n in [*history[-1:], *([rerun] if rerun is not None else [])]:
            out.setdefault(n, t.number)
    return out


def state_text(t, retried_by: dict[int, int]) -> str:
    state = t.state.name
    if state == "PRUNED":
        return f"PRUNED at step {t.last_step}" if t.last_step is not None else "PRUNED"
    if state == "FAIL":
        why = t.user_attrs.get("fail_reason", "")
        again = f"retried as #{retried_by[t.number]}" if t.number in retried_by else ""
        detail = "; ".join(x for x in (again, why) if x)
        return f"FAIL ({detail})" if detail else "FAIL"
    return state


def rows(study, prefix: str) -> list[dict]:
    """One dict per trial (numbers stay numbers)."""
    import datetime

    trials = study.get_trials(deepcopy=False)
    retried_by = _retried_by(trials)
    # the last trial to use a workdir owns what is in it: an earlier one there (a failed trial
    # its retry ran again in place) shows no metrics, not its retry's
    owner = {t.user_attrs.get("workdir", ""): t.number for t in trials}
    out = []
    for t in trials:
        params = trial_params(t)
        workdir = t.user_attrs.get("workdir", "")
        mine = workdir and owner.get(workdir) == t.number
        metrics = _read_json(metrics_path(workdir)) if mine else {}
        end = t.datetime_complete or (datetime.datetime.now() if t.datetime_start else None)
        row = {
            "trial": t.number,
            "name": t.user_attrs.get("name", ""),
            "state": state_text(t, retried_by),
            "value": t.value if t.values else None,
            "step": t.last_step if t.state.name == "PRUNED" else metrics.get("step"),
            "params": " ".join(space.overrides(params)),
        }
        row.update({f"train/{k}": v for k, v in metrics.get("train", {}).items()})
        if "eval" in metrics:
            row["eval_step"] = metrics.get("eval_step")
            row.update({f"eval/{k}": v for k, v in metrics["eval"].items()})
        row["wall_s"] = (end - t.datetime_start).total_seconds() if t.datetime_start else None
        row["workdir"] = workdir
        keys = metrics.get("console_keys", {})
        row["_shown"] = [f"train/{k}" for k in keys.get("train", [])]
        row["_shown"] += [f"eval/{k}" for k in keys.get("eval", [])]
        out.append(row)
    return out


def _columns(table: list[dict], shown_only: bool) -> list[str]:
    """trial, name, state, value, step, train/*, eval_step, eval/*, wall_s, params, workdir."""
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
    head = ["trial", "name", "state", "value", "step", *train]
    return [
        *head,
        *(["eval_step"] if "eval_step" in seen else []),
        *evals,
        "wall_s",
        "params",
        "workdir",
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


def best_trial(study):
    """The best complete trial, None before the first."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete:
        return None
    pick = max if study.direction.name == "MAXIMIZE" else min
    return pick(complete, key=lambda t: (t.value, -t.number))


def best_command(attrs: dict, prefix: str, params: dict) -> list[str]:
    """The best trial's config as a command that trains it (in PREFIX/best)."""
    command = space.RUN_COMMAND.get(attrs.get("task", "realm"), "local")
    cmd = ["python", "-m", "realm_jax", command, "--config", attrs["spec"]]
    cmd += ["--workdir", fs.join(prefix, BEST)]
    return cmd + [f"--config.{o}" for o in [*attrs.get("extra", []), *space.overrides(params)]]


def write(study, prefix: str, header: str = "") -> str | None:
    """PREFIX/sweep.md, sweep.csv and plots/ from the study; returns the best command's line
    (None before a trial completed)."""
    attrs = study.user_attrs.get("realm_jax", {})
    table = rows(study, prefix)
    best = best_trial(study)
    md = [f"# Sweep `{attrs.get('spec', '?')}`", ""]
    if header:
        md += [header, ""]
    md.append(markdown(table))
    line = None
    if best is not None:
        line = shlex.join(best_command(attrs, prefix, best.params))
        md += [
            f"Best: trial {best.number} ({best.user_attrs.get('name', '')}), "
            f"{attrs.get('objective', 'value')} = {best.value:.6g}. Its config, trained again:",
            "",
            "```",
            line,
            "```",
            "",
        ]
    plots = write_plots(study, prefix)
    if plots:
        md += ["Plots: " + ", ".join(f"[{p}](plots/{p})" for p in plots), ""]
    fs.write_text(fs.join(prefix, "sweep.md"), "\n".join(md))
    fs.write_text(fs.join(prefix, "sweep.csv"), csv_text(table))
    return line


def write_plots(study, prefix: str) -> list[str]:
    """PREFIX/plots/*.png (Optuna's matplotlib plots); the names written."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    params = {k for t in complete for k in t.params}
    wanted = []
    if complete:
        wanted.append(("optimization_history.png", ovm.plot_optimization_history))
    if len(complete) >= 2 and len(params) > 1:
        wanted.append(("param_importances.png", ovm.plot_param_importances))
    if any(t.intermediate_values and t.state.name != "FAIL" for t in trials):  # Optuna's
        wanted.append(("intermediate_values.png", ovm.plot_intermediate_values))
    done = []
    folder = fs.join(prefix, "plots")
    for name, plot in wanted:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                ax = plot(study)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            plt.close(fig)
        except Exception as e:  # a plot Optuna cannot draw from these trials: the others still
            log.warning("sweep: %s not drawn: %s: %s", name, type(e).__name__, e)
            continue
        fs.makedirs(folder)
        fs.write_bytes(fs.join(folder, name), buf.getvalue())
        done.append(name)
    return done
