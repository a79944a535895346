"""The trainer's side of a sweep trial: each held-out evaluation reported to the trial's Optuna
study, and the pruner's answer, so that a trial falling behind stops at that step.

The sweep's worker starts a trial's training processes with REALM_JAX_TRIAL, a JSON object:

    {"storage": URL, "study": NAME, "trial_id": INT, "objective": "eval/...",
     "direction": "maximize" | "minimize", "retry_s": 300, "pruner": {"name": "median", ...}}

storage: any SQLAlchemy URL (sqlite:///PREFIX/study.db, postgresql://...) or grpc://HOST:PORT
(Optuna's gRPC storage proxy). objective: a key of the task's evaluation, "eval/" optional, "@"
also spelled "_at_" as TensorBoard's tags have it (eval/accuracy or eval/title_recall@5 for
realm, eval/recall@5 for ict, eval/exact_match for qa). pruner (optional; default {"name":
"median"}, Optuna's default): its name (median, halving, hyperband, none) and the keyword
arguments of its Optuna class. A study's pruner lives in the process that asks, not in the
storage: the trainer builds the worker's (`make_pruner`, which the worker may share).

The training loop (train/loop.py) calls `TrialLink.report` after each evaluation: process 0
reports the objective's value at that step and asks the pruner; the answer goes to every
process, so all stop at the same step. The trainer sends no heartbeat (the worker does).

A storage that does not answer is retried with exponential backoff, one log line a failure, for
up to retry_s seconds from the first failure (each call also bounded by what is left of it, so a
connection that hangs counts as a failure); past that, one warning and the run trains on
without reporting: an outage never loses a run. Nothing here imports Optuna until a trial is
linked: a run without REALM_JAX_TRIAL pays nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from realm_jax import fs
from realm_jax import workdir as paths
from realm_jax.config import ConfigError

log = logging.getLogger("realm_jax.sweep")

ENV = "REALM_JAX_TRIAL"
DIRECTIONS = ("maximize", "minimize")
PRUNERS = {  # name -> the Optuna class (in optuna.pruners)
    "median": "MedianPruner",
    "halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "none": "NopPruner",
}
DEFAULT_RETRY_S = 300.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0


def make_pruner(spec: Mapping[str, Any]):
    """An Optuna pruner from {"name": ..., **its keyword arguments} (ValueError/TypeError when
    the name or an argument is not one)."""
    import optuna

    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in PRUNERS:
        raise ValueError(f"pruner name {name!r}: must be one of {', '.join(PRUNERS)}")
    return getattr(optuna.pruners, PRUNERS[name])(**spec)


def open_storage(url: str):
    """The study's storage: grpc://HOST:PORT through Optuna's gRPC proxy client, any other URL
    as an RDB (SQLAlchemy) without heartbeats or table creation (the sweep made the study)."""
    import optuna

    if url.startswith("grpc://"):
        host, _, port = url[len("grpc://") :].rstrip("/").rpartition(":")
        with warnings.catch_warnings():  # experimental in Optuna 5: said once in the docs
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.GrpcStorageProxy(host=host, port=int(port))
    return optuna.storages.RDBStorage(url, skip_table_creation=True)


def _parse(text: str) -> dict:
    """REALM_JAX_TRIAL's fields, checked: one ConfigError naming the variable and every
    problem."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{ENV} is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{ENV} must be a JSON object, got {text[:200]!r}")
    problems = []
    required = ("storage", "study", "trial_id", "objective", "direction")
    known = (*required, "retry_s", "pruner")
    problems += [f"{k} missing" for k in required if k not in raw]
    problems += [f"unknown field {k!r}" for k in raw if k not in known]
    for k in ("storage", "study", "objective"):
        if k in raw and not (isinstance(raw[k], str) and raw[k]):
            problems.append(f"{k} must be a non-empty string, got {raw[k]!r}")
    storage = raw.get("storage")
    if isinstance(storage, str) and storage.startswith("grpc://"):
        port = storage[len("grpc://") :].rstrip("/").rpartition(":")[2]
        if not port.isdigit():
            problems.append(f"storage {storage!r}: a gRPC proxy is grpc://HOST:PORT")
    elif isinstance(storage, str) and storage and "://" not in storage:
        problems.append(f"storage {storage!r}: not a database URL (sqlite:///..., grpc://...)")
    trial_id = raw.get("trial_id", 0)
    if isinstance(trial_id, bool) or not isinstance(trial_id, int) or trial_id < 0:
        problems.append(f"trial_id must be an integer >= 0, got {trial_id!r}")
    if "direction" in raw and raw["direction"] not in DIRECTIONS:
        problems.append(
            f"direction must be one of {', '.join(DIRECTIONS)}, got {raw['direction']!r}"
        )
    retry = raw.get("retry_s", DEFAULT_RETRY_S)
    if isinstance(retry, bool) or not isinstance(retry, int | float) or not 0 < retry < 1e7:
        problems.append(f"retry_s must be a positive number of seconds, got {retry!r}")
    pruner = raw.get("pruner", {"name": "median"})
    if not isinstance(pruner, dict) or pruner.get("name") not in PRUNERS:
        problems.append(f'pruner must be {{"name": {" | ".join(PRUNERS)}, ...}}, got {pruner!r}')
    if problems:
        raise ConfigError(f"{ENV}: {'; '.join(problems)}")
    return raw


@dataclasses.dataclass
class TrialLink:
    """One training run's link to its sweep trial (TrialLink.from_env())."""

    storage: str
    study: str
    trial_id: int
    objective: str  # "eval/<metric>", as the loop's evaluation values are keyed
    direction: str
    retry_s: float = DEFAULT_RETRY_S
    pruner: dict = dataclasses.field(default_factory=lambda: {"name": "median"})
    disabled: bool = False  # set past retry_s of failures: the run trains on without reporting
    _trial: Any = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TrialLink | None:
        """The link REALM_JAX_TRIAL describes; None when it is unset or empty. ConfigError
        (naming the variable) when it is malformed or its pruner cannot be built."""
        text = environ.get(ENV, "").strip()
        if not text:
            return None
        raw = _parse(text)
        objective = raw["objective"]
        link = cls(
            storage=raw["storage"],
            study=raw["study"],
            trial_id=raw["trial_id"],
            objective=objective if objective.startswith("eval/") else f"eval/{objective}",
            direction=raw["direction"],
            retry_s=float(raw.get("retry_s", DEFAULT_RETRY_S)),
            pruner=dict(raw.get("pruner", {"name": "median"})),
        )
        try:
            make_pruner(link.pruner)  # a bad argument now, not at the first evaluation
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{ENV}: pruner {link.pruner}: {e}") from None
        return link

    def value(self, values: Mapping[str, Any]) -> float:
        """The objective's value in an evaluation's values ("eval/<k>" keys; "@" in a name may
        be spelled "_at_", as TensorBoard's tags have it: eval/recall_at_5 is eval/recall@5);
        ConfigError naming it and the metrics the evaluation has when it is not one of them."""
        want = _tag(self.objective)
        for k, v in values.items():
            if _tag(k) == want:
                return float(v)
        have = sorted(k for k in values if k.startswith("eval/"))
        raise ConfigError(
            f"the sweep's objective {self.objective} is not a metric this run's evaluation "
            f"gives ({ENV}); it gives: {', '.join(have) or 'nothing'}"
        )

    def report(self, step: int, values: Mapping[str, Any], *, may_prune: bool = True) -> bool:
        """Report the objective's value at `step` to the trial (process 0) and return whether
        the pruner stops the trial here, the same answer on every process. Storage failures are
        retried for up to retry_s; past it, False from then on (one warning)."""
        import jax

        value = self.value(values)  # every process: the same values, the same error
        prune = False
        if jax.process_index() == 0 and not self.disabled:
            answer = self._with_retries(
                f"report at step {step}", lambda: self._ask(step, value, may_prune)
            )
            prune = bool(answer) and may_prune
        if jax.process_count() > 1 and may_prune:  # every process stops at the same step
            import numpy as np
            from jax.experimental import multihost_utils

            prune = bool(multihost_utils.broadcast_one_to_all(np.array(prune)))
        return prune

    def _ask(self, step: int, value: float, may_prune: bool) -> bool:
        """The storage calls of one report (run in _with_retries' thread)."""
        if self._trial is None:
            import optuna

            storage = open_storage(self.storage)
            # the sampler is not used here (Trial's constructor calls its before_trial): a
            # RandomSampler, which does nothing there, rather than the study's
            study = optuna.load_study(
                study_name=self.study,
                storage=storage,
                sampler=optuna.samplers.RandomSampler(),
                pruner=make_pruner(self.pruner),
            )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        self._trial.report(value, step)  # a step already reported (a retry): kept as it was
        return self._trial.should_prune() if may_prune else False

    def _with_retries(self, what: str, call: Callable[[], Any]) -> Any:
        """call() until it returns, with exponential backoff, for up to retry_s after the first
        failure; past it, None and the link disabled (one warning). Each attempt runs in a daemon
        thread bounded by the time left, so a storage that never answers is a failure too."""
        import optuna

        deadline, backoff = None, FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            ok, result = _bounded(call, max((deadline or started + self.retry_s) - started, 1.0))
            if ok:
                return result
            if isinstance(result, optuna.exceptions.UpdateFinishedTrialError):
                self.disabled = True  # the study ended this trial (e.g. its worker was lost)
                log.warning(
                    "sweep trial %d is already finished in the study (%s): training goes on "
                    "without reporting",
                    self.trial_id,
                    _line(result),
                )
                return None
            if deadline is None:  # retry_s from the start of the first failed attempt
                deadline = started + self.retry_s
            left = deadline - time.monotonic()
            if left <= 0:
                self.disabled = True
                log.warning(
                    "sweep trial %d: the study's storage %s failed for %.0f s (retry_s), last: "
                    "%s; training goes on without reporting to the sweep (no pruning)",
                    self.trial_id,
                    shown(self.storage),
                    self.retry_s,
                    _line(result),
                )
                return None
            wait = min(backoff, left)
            log.warning(
                "sweep trial %d: %s failed (%s); retrying in %.1f s (%.0f s left of retry_s)",
                self.trial_id,
                what,
                _line(result),
                wait,
                left,
            )
            time.sleep(wait)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def write_pruned(self, workdir: str, step: int, value: float) -> None:
        """WORKDIR/PRUNED, which tells the sweep's worker the trial was pruned at `step`."""
        record = {
            "step": int(step),
            "value": float(value),
            "objective": self.objective,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        fs.write_text(paths.pruned_path(workdir), json.dumps(record) + "\n")


def _bounded(call: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """(True, call()) or (False, the exception), call run in a daemon thread given `timeout`
    seconds (a call still running then is left behind: TimeoutError)."""
    box: list = []

    def target():
        try:
            box.append((True, call()))
        except Exception as e:  # noqa: BLE001 (any storage error is retried)
            box.append((False, e))

    thread = threading.Thread(target=target, name="sweep-trial-report", daemon=True)
    thread.start()
    thread.join(timeout)
    if box:
        return box[0]
    return False, TimeoutError(f"no answer in {timeout:.0f} s")


def shown(text: str) -> str:
    """A storage URL, or a command or log line holding one, as logs may show it: every
    URL's password as ***."""
    return re.sub(r"(://[^\s/@:'\"]*:)[^\s/@'\"]*@", r"\1***@", text)


def _tag(name: str) -> str:
    return name.replace("@", "_at_")


def _line(error: BaseException) -> str:
    """The error's first line, with its cause's (Optuna wraps the database's own error)."""
    parts = []
    while error is not None and len(parts) < 2:
        if callable(getattr(error, "code", None)) and callable(getattr(error, "details", None)):
            text = [f"{error.code()} {error.details()}"]  # a gRPC error: its status
        else:
            text = str(error).strip().splitlines()
        parts.append(f"{type(error).__name__}: {text[0] if text else ''}")
        error = error.__cause__
    return " <- ".join(parts)[:400]
