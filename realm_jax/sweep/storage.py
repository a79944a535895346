"""Where a sweep's Optuna study lives, and the workers' heartbeats in it.

--storage URL:
  (default)            sqlite:///PREFIX/study.db: a file beside the trials, nothing to start;
                       for workers on this machine only (a gs:// PREFIX or --tpu: a server below)
  postgresql://..., mysql://..., any SQLAlchemy URL: Optuna's RDBStorage (a database server
                       every worker reaches)
  grpc://HOST:PORT     Optuna's gRPC storage proxy (`python -m realm_jax.sweep.proxy --storage
                       postgresql://... --port 13000`): the workers and trainers need no database
                       driver nor its password, and the database one connection pool
SQLite waits up to SQLITE_TIMEOUT_S for a lock another worker (or a reader) holds.

Heartbeats: a worker records the time in its running trial's system attrs every heartbeat_s
(HEARTBEAT); a running trial whose heartbeat is older than grace_s (its worker was killed, its
host lost) is failed by whichever worker looks first (set_trial_state_values is atomic: one
wins) and enqueued again once with the same params (Optuna's RetryHeartbeatStaleTrialCallback,
max_retry=1), so the retry trains in the same folder and resumes from the dead trial's
checkpoint. This is Optuna's heartbeat scheme, kept in trial attributes rather than RDBStorage's
heartbeat table because Optuna's gRPC proxy client has no heartbeat: one mechanism through every
storage. Storage calls of the workers are retried with backoff (`retrying`), so a database that
is briefly unreachable or locked delays a sweep and loses nothing.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from typing import Any

from realm_jax import fs
from realm_jax.config import ConfigError

log = logging.getLogger("realm_jax.sweep")

DB_NAME = "study.db"
HEARTBEAT = "realm_jax_heartbeat"  # trial system attr: unix time of the worker's last beat
SQLITE_TIMEOUT_S = 60.0
HEARTBEAT_S, GRACE_S = 30.0, 120.0  # the defaults of --heartbeat_s and --grace_s
RETRY_S = 300.0  # how long a worker retries a storage call before it gives up
MAX_RETRY = 1  # a lost trial is retried once


def default_url(prefix: str) -> str:
    return f"sqlite:///{os.path.join(os.path.abspath(prefix), DB_NAME)}"


def redact(text: str) -> str:
    """A URL (or a command holding one) with its password as *** (for printing)."""
    from realm_jax.sweep.trial import shown

    return shown(text)


def check(url: str, prefix: str, tpu: bool) -> None:
    """A storage the sweep's workers (and trainers) can all reach: SQLite is a file on this
    machine, for a local prefix and local workers only."""
    if url.startswith("grpc://"):
        if not re.fullmatch(r"grpc://[^/:]+:\d+/?", url):
            raise ConfigError(f"--storage {url}: a gRPC storage proxy is grpc://HOST:PORT")
        return
    if "://" not in url:
        raise ConfigError(
            f"--storage {redact(url)}: not a database URL (sqlite:///PATH, "
            "postgresql://USER:PASSWORD@HOST/DB, grpc://HOST:PORT)"
        )
    if url.startswith("sqlite:"):
        if tpu:
            raise ConfigError(
                f"--tpu needs --storage naming a server the TPU VMs reach (postgresql://... or "
                f"grpc://HOST:PORT of `python -m realm_jax.sweep.proxy`), not {redact(url)}"
            )
        if fs.is_remote(prefix):
            raise ConfigError(
                f"a {prefix.split('://')[0]}:// workdir needs --storage naming a database server "
                "(postgresql://... or grpc://HOST:PORT of `python -m realm_jax.sweep.proxy`): "
                "SQLite is a local file"
            )


def open_storage(url: str, create: bool = False):
    """The Optuna storage of `url` (ConfigError, one line, when it cannot be opened). create:
    the sweep's first process makes the tables; workers and trainers only open them."""
    import optuna

    if url.startswith("grpc://"):
        host, _, port = url[len("grpc://") :].rstrip("/").rpartition(":")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.GrpcStorageProxy(host=host, port=int(port))
        try:
            storage.wait_server_ready(timeout=30)
        except Exception as e:  # grpc's FutureTimeoutError
            raise ConfigError(
                f"no Optuna storage proxy answers at {host}:{port} in 30 s ({type(e).__name__}); "
                "start one: python -m realm_jax.sweep.proxy --storage URL --port PORT"
            ) from None
        return storage
    if url.startswith("sqlite:"):
        kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    else:
        kwargs = {"pool_pre_ping": True}  # a server that dropped an idle connection: reconnect
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_table_creation=not create)
    except ModuleNotFoundError as e:  # the database's driver
        raise ConfigError(f"--storage {redact(url)} needs {e.name}: pip install it") from None
    except Exception as e:  # sqlalchemy's OperationalError, ArgumentError, ...
        line = " ".join(str(e).split())[:300]
        raise ConfigError(f"--storage {redact(url)}: {type(e).__name__}: {line}") from None


def retrying(call: Callable[[], Any], what: str, retry_s: float = RETRY_S) -> Any:
    """call() retried with backoff (1 s doubling to 30 s) for up to retry_s after its first
    failure, one log line per failure; the last error is raised past it. Optuna's answers that a
    trial is already finished are not retried (they are answers)."""
    import optuna

    deadline, wait = None, 1.0
    while True:
        try:
            return call()
        except (optuna.exceptions.UpdateFinishedTrialError, KeyError, ValueError):
            raise
        except Exception as e:  # the database: OperationalError, locked, unreachable, ...
            now = time.monotonic()
            deadline = deadline or now + retry_s
            if now >= deadline:
                raise
            line = " ".join(str(e).split())[:200]
            log.warning(
                "sweep: %s failed (%s: %s); retrying in %.0f s", what, type(e).__name__, line, wait
            )
            time.sleep(min(wait, max(deadline - now, 0.1)))
            wait = min(2 * wait, 30.0)


def beat(storage, trial_id: int) -> None:
    """Record that the trial's worker is alive (now)."""
    storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())


def last_beat(trial) -> float:
    """A frozen trial's last sign of life (unix time): its last heartbeat or its start (a retry
    carries its dead trial's heartbeat until its own first)."""
    start = (trial.datetime_start or datetime.datetime.now()).timestamp()
    return max(float(trial.system_attrs.get(HEARTBEAT, 0.0)), start)


def fail_stale(study, grace_s: float) -> list[int]:
    """Fail the running trials whose heartbeat is older than grace_s and enqueue each once more
    (same params); returns the numbers of the trials this process failed."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage  # the study's (cached) storage: the one its trials are read from
    now, failed = time.time(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        silent = now - last_beat(t)
        if silent <= grace_s:
            continue
        note = f"no heartbeat for {silent:.0f} s (its worker was lost)"
        try:  # why, written while it can be (a finished trial's attrs are frozen) ...
            storage.set_trial_user_attr(t._trial_id, "fail_reason", note)
            # ... then the decision: of the workers that look, one fails it
            if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first, or it just ended
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        frozen = copy.deepcopy(storage.get_trial(t._trial_id))
        frozen.user_attrs.pop("fail_reason", None)  # the retry's own are the rest
        retried = len(frozen.system_attrs.get("retry_history", [])) < MAX_RETRY
        retry(study, frozen)
        print(
            f"sweep: trial {t.number} failed: {note}"
            + ("; enqueued again with the same params" if retried else "; not retried again"),
            flush=True,
        )
        failed.append(t.number)
    return failed
