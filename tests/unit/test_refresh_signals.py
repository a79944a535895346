"""The refresh job's SIGTERM handler must not deadlock when the signal lands while the main
thread holds the stop Event's lock (inside Event.wait): a handler calling Event.set directly
waits for itself forever, which left `local`'s refresher orphaned after a kill -9."""

import subprocess
import sys

CHILD = r"""
import signal, threading
from realm_jax.index.refresher import stop_on_signals
stop = threading.Event()
stop_on_signals(stop)
with stop._cond:  # what the main thread holds between the steps of stop.wait()
    signal.raise_signal(signal.SIGTERM)  # the handler runs here, on this thread
assert stop.wait(10), "SIGTERM did not set stop"
print("stopped")
"""


def test_sigterm_while_the_main_thread_holds_the_stop_lock():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "stopped" in out.stdout, out.stderr
