"""Issue 48's stopped refresher: `local`'s refresh job is SIGSTOPped once it has published an
index (its process alive, its watchdog thread frozen with it). The trainer keeps training and
warns that its index is stale; `local` kills the stopped job after refresh.stopped_grace_s and
starts another, which publishes again; the run ends normally."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from realm_jax import workdir as paths
from tests.conftest import REPO, prepare_sample_head
from tests.support.runs import REALM_OVERRIDES, realm_config

pytestmark = pytest.mark.system

RUN = [o for o in REALM_OVERRIDES if not o.startswith(("refresh.mode=", "train.steps="))] + [
    "refresh.mode=external",
    "refresh.every=4",
    "refresh.poll_seconds=0.5",
    "refresh.max_staleness=8",
    "refresh.stopped_grace_s=8",
    "refresh.build_scann=false",
    "train.steps=120",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_sample_head(tmp_path_factory, realm_config, 60)


def _versions(work: str) -> list[int]:
    d = paths.index_dir(work)
    return (
        sorted(int(n.split("_")[1]) for n in os.listdir(d) if n.startswith("step_"))
        if os.path.isdir(d)
        else []
    )


def test_a_stopped_refresher_is_restarted_and_training_goes_on(data_dir, tmp_path):
    work, log = str(tmp_path / "run"), tmp_path / "local.log"
    cmd = [
        *(sys.executable, "-m", "realm_jax", "local", "--workdir", work),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *[f"--config.{o}" for o in RUN],
        f"--config.data.data_dir={data_dir}",
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 400
        while not _versions(work) or "started refresher (pid" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        pid = int(re.search(r"started refresher \(pid (\d+)\)", log.read_text()).group(1))
        os.kill(pid, signal.SIGSTOP)
        stopped_at = max(_versions(work))
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert re.search(r"index staleness \d+ steps exceeds refresh.max_staleness 8", text), text[
        -4000:
    ]
    restart = re.search(
        rf"the refresh job \(pid {pid}\) has been stopped \(state T\) for \d+ s: restarting it",
        text,
    )
    assert restart, text[-4000:]
    new = re.findall(r"started refresher \(pid (\d+)\)", text)
    assert len(new) == 2 and int(new[1]) != pid
    assert max(_versions(work)) > stopped_at  # the new job published again
