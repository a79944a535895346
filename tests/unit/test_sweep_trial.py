"""REALM_JAX_TRIAL, the link a sweep's worker gives a trial's trainer (realm_jax/sweep/trial.py):
what it reads, and one error naming the variable for each way it can be wrong. Its runs:
tests/integration/test_trial_pruning.py."""

import json
import shlex
import threading

import pytest

from realm_jax.config import ConfigError
from realm_jax.sweep import trial as trial_link


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"storage": "sqlite:///s.db"}', "study missing; trial_id missing; objective missing"),
        (
            '{"storage": "s.db", "study": "s", "trial_id": "7", "objective": "eval/x", '
            '"direction": "up", "retry_s": 0, "extra": 1}',
            "unknown field 'extra'; storage 's.db': not a database URL (sqlite:///..., "
            "grpc://...); trial_id must be an integer >= 0, got '7'; direction must be one of "
            "maximize, minimize, got 'up'; retry_s must be a positive number of seconds, got 0",
        ),
        (
            '{"storage": "grpc://host", "study": "s", "trial_id": 1, "objective": "eval/x", '
            '"direction": "maximize", "pruner": {"name": "asha"}}',
            "storage 'grpc://host': a gRPC proxy is grpc://HOST:PORT; pruner must be",
        ),
        (
            '{"storage": "sqlite:///s.db", "study": "s", "trial_id": 1, "objective": "eval/x", '
            '"direction": "maximize", "pruner": {"name": "median", "n_warmup": 1}}',
            "n_warmup",
        ),
    ],
)
def test_a_malformed_link_is_one_error_naming_the_variable(value, message):
    with pytest.raises(ConfigError) as e:
        trial_link.TrialLink.from_env({trial_link.ENV: value})
    text = str(e.value)
    assert text.startswith(f"{trial_link.ENV}") and message in text and "\n" not in text


def test_the_link_reads_the_contract_and_names_a_missing_objective():
    assert trial_link.TrialLink.from_env({}) is None
    link = trial_link.TrialLink.from_env(
        {
            trial_link.ENV: '{"storage": "grpc://10.0.0.2:13000", "study": "s", "trial_id": 4, '
            '"objective": "title_recall@5", "direction": "maximize"}'
        }
    )
    assert (link.objective, link.retry_s, link.pruner) == (
        "eval/title_recall@5",
        300.0,
        {"name": "median"},
    )
    with pytest.raises(
        ConfigError, match=r"eval/title_recall@5 is not .* eval/accuracy, eval/loss"
    ):
        link.report(2, {"eval/loss": 1.0, "eval/accuracy": 0.5, "step": 2})


class _Clock:
    """time.monotonic and time.sleep for the retries, without waiting."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def _a_link(retry_s=5.0):
    return trial_link.TrialLink("sqlite:///s.db", "s", 1, "eval/x", "maximize", retry_s=retry_s)


def test_storage_failures_back_off_then_reporting_stops_with_one_warning(monkeypatch, caplog):
    clock = _Clock()
    monkeypatch.setattr(trial_link.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(trial_link.time, "sleep", clock.sleep)
    link, calls = _a_link(retry_s=5.0), []

    def down():
        calls.append(clock.now)
        raise OSError("connection refused\nmore")

    assert link._with_retries("report at step 2", down) is None
    assert clock.sleeps == [1.0, 2.0, 2.0]  # doubling, cut to what is left of retry_s
    assert calls == [0.0, 1.0, 3.0, 5.0] and link.disabled
    retried = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retried) == 3 and "(OSError: connection refused); retrying in 1.0 s" in retried[0]
    assert sum("without reporting" in r.getMessage() for r in caplog.records) == 1
    assert link.report(4, {"eval/x": 0.5}) is False and len(calls) == 4  # no more calls

    flaky, link = iter([OSError("a"), OSError("b"), True]), _a_link()

    def comes_back():
        answer = next(flaky)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert link._with_retries("report", comes_back) is True and not link.disabled


def test_a_finished_trial_or_a_storage_that_hangs_stops_reporting(caplog):
    import optuna

    link = _a_link()

    def finished():
        raise optuna.exceptions.UpdateFinishedTrialError("trial 1 is FAIL")

    assert link._with_retries("report", finished) is None and link.disabled
    assert "already finished" in caplog.text and "retrying" not in caplog.text

    link = _a_link(retry_s=1.0)  # a call that never answers: a failure after retry_s
    assert link._with_retries("report", lambda: threading.Event().wait(30)) is None
    assert link.disabled and "TimeoutError: no answer in 1 s" in caplog.text


def test_a_password_in_the_storage_url_is_never_shown():
    url = "postgresql+psycopg2://sweep:s3cr:et@db.internal:5432/study"
    assert trial_link.shown(url) == "postgresql+psycopg2://sweep:***@db.internal:5432/study"
    assert trial_link.shown("sqlite:////tmp/a:b@c/study.db") == "sqlite:////tmp/a:b@c/study.db"
    # a trial's command as the worker prints and logs it: the link's JSON, shell-quoted
    link = json.dumps({"storage": url, "study": "s", "trial_id": 3})
    line = shlex.join(["python", "-m", "realm_jax", "train", f"REALM_JAX_TRIAL={link}"])
    shown = trial_link.shown(line)
    assert "s3cr" not in shown and "sweep:***@db.internal" in shown
