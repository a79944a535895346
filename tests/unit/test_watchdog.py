"""The progress watchdog (watchdog.py): its bounds against hand-computed values, and a
stall that fires with the stage named and every thread's stack, in process (a fake exit)."""

import tempfile
import threading
import time

import pytest

from realm_jax import watchdog as wd_lib


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
