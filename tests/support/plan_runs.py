"""`realm-jax plan` in a fresh process, for the tests that read its figures."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def run_plan(tmp_path, *args, name="plan.json", timeout=600):
    """The plan command in a fresh process (it fixes the number of fake CPU devices);
    (returncode, stdout, stderr, the JSON figures or None)."""
    out_json = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run(
        [sys.executable, "-m", "realm_jax", "plan", *args, "--json", str(out_json)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    figures = json.loads(out_json.read_text()) if out_json.exists() else None
    return p.returncode, p.stdout, p.stderr, figures
