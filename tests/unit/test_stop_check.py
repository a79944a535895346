"""The loop's stop check (issue 58): on several processes the collective runs on a schedule,
every train.stop_check_every steps and at checkpoint steps; on one it is an Event read."""

import threading

import numpy as np

from realm_jax.train import loop


def _gathers(monkeypatch, processes: int) -> list[int]:
    """Fake `processes` JAX processes; returns the list process_allgather appends to."""
    calls: list[int] = []

    def allgather(x):
        calls.append(1)
        return np.array([x, False])

    monkeypatch.setattr(loop.jax, "process_count", lambda: processes)
    monkeypatch.setattr(loop.multihost_utils, "process_allgather", allgather)
    return calls


def test_several_processes_check_on_the_schedule_and_at_checkpoints(monkeypatch):
    calls = _gathers(monkeypatch, 2)
    stop = loop.StopSignal(threading.Event())
    seen = []
    for s in range(1, 26):  # checkpoints every 4 steps, checks every 10
        before = len(calls)
        assert not stop.check(s, s % 4 == 0, 10)
        if len(calls) > before:
            seen.append(s)
    assert seen == [4, 8, 10, 12, 16, 20, 24]
    stop.event.set()  # requested: seen at the next scheduled step, not before
    assert not stop.check(11, False, 10) and stop.check(20, False, 10)


def test_one_process_reads_its_flag_at_every_step_without_a_collective(monkeypatch):
    calls = _gathers(monkeypatch, 1)
    stop = loop.StopSignal(threading.Event())
    assert not any(stop.check(s, False, 10) for s in range(1, 5))
    stop.event.set()
    assert stop.check(5, False, 10)
    assert calls == []
