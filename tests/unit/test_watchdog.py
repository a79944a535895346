"""The progress watchdog (watchdog.py): its bounds against hand-computed values, and a
stall that fires with the stage named and every thread's stack, in process (a fake exit)."""

import contextlib
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

import ml_collections
import pytest

from realm_jax import watchdog as wd_lib
from realm_jax.config import ConfigError


class _Exit(Exception):
    pass


def _watchdog(**kw):
    fired = threading.Event()
    codes = []

    def fake_exit(code):
        codes.append(code)
        fired.set()

    out = tempfile.TemporaryFile("w+")  # faulthandler needs a real file
    wd = wd_lib.Watchdog("test step", out=out, exit_fn=fake_exit, **kw)
    return wd, out, fired, codes


def test_the_bounds_by_hand():
    wd, _, _, _ = _watchdog(timeout_s=0, floor_s=1.0, first_timeout_s=50.0)
    try:
        assert wd.bound() == 50.0  # before any step: compilation is not a stall
        wd.beat(1)
        assert wd.bound() == 50.0  # one beat: no step time yet
        wd._times, wd._longest = [0.1, 0.1, 0.4], 0.4  # what three beats would record
        # max(floor 1, 20 x mean 0.2 = 4, 3 x longest 0.4 = 1.2)
        assert wd.bound() == pytest.approx(4.0)
        wd._times, wd._longest = [0.01] * 9 + [2.0], 2.0  # dispatch-ahead steps, one sync
        assert wd.bound() == pytest.approx(max(20 * 0.209, 3 * 2.0))
        with wd.stage("evaluation", slow=True):
            assert wd.bound() == 50.0  # a slow stage has the first bound
        assert wd.bound() == pytest.approx(6.0)
    finally:
        wd.close()
    fixed, _, _, _ = _watchdog(timeout_s=7.0, floor_s=1.0, first_timeout_s=50.0)
    fixed.beat(1)
    fixed.beat(2)
    assert fixed.bound() == 7.0
    fixed.close()
    with pytest.raises(ValueError, match="positive"):
        wd_lib.Watchdog("x", floor_s=0)


def test_a_stall_names_its_stage_and_dumps_every_thread():
    wd, out, fired, codes = _watchdog(timeout_s=0.3, floor_s=0.1, first_timeout_s=5.0)
    wd.beat(1)
    wd.beat(2)
    t0 = time.monotonic()
    with wd.stage("data", step=2):
        assert fired.wait(10), "the watchdog never fired"
    took = time.monotonic() - t0
    assert codes == [wd_lib.EXIT_STALLED] and wd.fired
    assert 0.3 <= took < 3.0
    out.seek(0)
    text = out.read()
    first = text.splitlines()[0]
    assert "stalled: no test step completed for" in first and "(bound 0.3 s;" in first
    assert "stage 'data'" in first and "after step 2" in first
    assert "Thread" in text and "test_a_stall_names_its_stage" in text  # the main thread's stack


def test_steady_beats_never_fire():
    wd, _, fired, _ = _watchdog(timeout_s=0.5, floor_s=0.1, first_timeout_s=5.0)
    for i in range(15):
        wd.beat(i)
        time.sleep(0.05)
    wd.close()
    assert not fired.is_set()


def test_a_slow_stage_is_not_a_stall():
    wd, _, fired, _ = _watchdog(timeout_s=0.3, floor_s=0.1, first_timeout_s=5.0)
    wd.beat(1)
    with wd.stage("checkpoint save", slow=True):
        time.sleep(0.8)  # longer than the step bound, shorter than the first bound
    wd.beat(2)
    wd.close()
    assert not fired.is_set()


def _stall_text(wd, out, fired) -> str:
    assert fired.wait(10), "the watchdog never fired"
    out.seek(0)
    return out.read().splitlines()[0]


def test_the_stall_line_names_the_stage_being_waited_on():
    """A slow (storage) stage, the innermost of nested stages, the stage that ended last when
    the main thread is outside every stage, and a stall before any stage: never 'start'."""
    wd, out, fired, _ = _watchdog(timeout_s=0.3, floor_s=0.1, first_timeout_s=0.4)
    with wd.stage("checkpoint save", slow=True, step=4):  # stalls past the slow bound
        first = _stall_text(wd, out, fired)
    assert "stage 'checkpoint save'" in first and "(bound 0.4 s;" in first

    wd, out, fired, _ = _watchdog(timeout_s=0.3, floor_s=0.1, first_timeout_s=5.0)
    wd.beat(1)
    wd.beat(2)
    with wd.stage("index swap"):
        with wd.stage("step results"):
            pass
        first = _stall_text(wd, out, fired)  # the outer stage again once the inner ended
    assert "in stage 'index swap'" in first

    wd, out, fired, _ = _watchdog(timeout_s=0.3, floor_s=0.1, first_timeout_s=5.0)
    wd.beat(1)
    wd.beat(2)
    with wd.stage("checkpoint restore", slow=True):
        with wd.stage("data"):
            first = _stall_text(wd, out, fired)
    assert "in stage 'data'" in first

    wd, out, fired, _ = _watchdog(timeout_s=0.3, floor_s=0.1, first_timeout_s=5.0)
    wd.beat(1)
    wd.beat(2)
    with wd.stage("checkpoint save", slow=True):
        pass
    first = _stall_text(wd, out, fired)  # e.g. a metrics write between two stages
    assert "outside every stage (the last, 'checkpoint save', ended" in first
    assert "'start'" not in first

    wd, out, fired, _ = _watchdog(first_timeout_s=0.3)
    first = _stall_text(wd, out, fired)
    assert "has entered no stage yet" in first and "after 0 completed" in first


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -1.0, 0.5, "soon"])
@pytest.mark.parametrize("field", ["stall_timeout_s", "stall_floor_s", "first_step_timeout_s"])
def test_a_config_bound_that_cannot_work_is_refused_naming_its_field(field, bad):
    section = {"stall_timeout_s": 0.0, "stall_floor_s": 300.0, "first_step_timeout_s": 3600.0}
    section[field] = bad  # "soon": no number at all
    if not isinstance(bad, str):  # a ConfigDict as the commands pass (config.train)
        section = ml_collections.ConfigDict(section)
    with pytest.raises(ConfigError) as err:
        wd_lib.from_config(section, "test step").close()  # closed at once were it accepted
    message = str(err.value)
    assert f"train.{field}={bad!r}" in message and "finite number of seconds >= 1" in message
    assert message.count("train.") == 1  # the one bad field, named once


def test_config_bounds_zero_automatic_several_bad_fields_and_the_constructor():
    ok = {"stall_timeout_s": 0, "stall_floor_s": 1, "first_step_timeout_s": 60}
    assert wd_lib.config_bounds(ok) == (0.0, 1.0, 60.0)  # 0: automatic; 1 s: the least
    with pytest.raises(ConfigError) as err:  # every bad field in one error
        wd_lib.config_bounds({"stall_floor_s": 0, "first_step_timeout_s": math.inf}, "refresh")
    assert "refresh.stall_floor_s=0" in str(err.value)
    assert "refresh.first_step_timeout_s=inf" in str(err.value)
    for kw in ({"timeout_s": math.nan}, {"first_timeout_s": math.inf}, {"floor_s": -1.0}):
        with pytest.raises(ValueError, match="finite and positive"):
            wd_lib.Watchdog("x", **kw).close()


def _full_pipe() -> tuple[int, int]:
    """(read end, write end) of a pipe filled to capacity, its write end blocking again."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(w, b"x" * 65536)
    os.set_blocking(w, True)
    return r, w


def test_the_report_reaches_a_pipe_and_leaves_its_description_blocking():
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    wd = wd_lib.Watchdog("test step", first_timeout_s=0.3, out=out, exit_fn=lambda code: None)
    wd._thread.join(10)
    assert wd.fired and os.get_blocking(w)  # the report did not change the shared flag
    out.close()
    with os.fdopen(r) as reader:
        text = reader.read()
    assert text.startswith("realm-jax: stalled: no test step completed") and "Thread" in text


def test_a_full_pipe_does_not_delay_the_exit_in_process():
    """The report to a pipe nobody reads: dropped, and the exit comes at once."""
    r, w = _full_pipe()
    out = os.fdopen(w, "w")
    wd, _, fired, codes = _watchdog(first_timeout_s=0.3)
    wd.out = out
    t0 = time.monotonic()
    assert fired.wait(10), "the watchdog blocked on the full pipe and never exited"
    assert codes == [wd_lib.EXIT_STALLED] and time.monotonic() - t0 < 2.0
    out.close()
    os.close(r)


_CHILD = """
import contextlib, os, sys, threading
from realm_jax import watchdog
wd = watchdog.Watchdog("drill step", first_timeout_s={bound})
if {block_in_write}:  # the main thread is blocked writing 1 MB that nobody reads
    sys.stdout.write("x" * (1 << 20))
    sys.stdout.flush()
else:  # the pipe filled to capacity, then a hang in a storage stage
    os.set_blocking(1, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(1, b"x" * 65536)
    os.set_blocking(1, True)
    with wd.stage("checkpoint save", slow=True):
        threading.Event().wait()
"""


@pytest.mark.parametrize("block_in_write", [True, False], ids=["blocked-in-write", "pipe-full"])
def test_a_process_whose_output_pipe_is_full_still_exits(block_in_write):
    """The hand drill: stdout and stderr into one pipe that nobody reads. The old watchdog
    blocked writing its own stall line and the process lived on; now it exits 75 within its
    bound plus EXIT_GRACE_S (the log line to the same pipe is what waits out the grace)."""
    bound = 1.0
    code = _CHILD.format(bound=bound, block_in_write=block_in_write)
    t0 = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        rc = child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail("the stalled process stayed alive: its watchdog blocked on the full pipe")
    finally:
        child.stdout.close()
    took = time.monotonic() - t0
    assert rc == wd_lib.EXIT_STALLED
    assert bound <= took < bound + wd_lib.EXIT_GRACE_S + 10  # + the interpreter's start
