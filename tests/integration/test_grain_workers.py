"""grain worker processes (data.worker_count > 0) behind the CLI's runtime.setup: grain reads
absl flags of its own, which realm-jax never parses (argparse), so setup must mark them parsed
or the first batch raises UnparsedFlagAccessError."""

import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO

# Run in a fresh process: absl's flag state is per process, and pytest's must not decide it.
SCRIPT = textwrap.dedent(
    """
    import argparse

    import grain
    import numpy as np

    from realm_jax import runtime
    from realm_jax.data import pipeline


    class Double(grain.transforms.Map):
        def map(self, x):
            return {"x": x["x"] * 2}


    if __name__ == "__main__":
        runtime.setup(argparse.Namespace(
            verbose=False, cpu_devices=0, coordinator=None, num_processes=None,
            process_id=None, multihost=False,
        ))
        source = [{"x": np.int64(i)} for i in range(16)]
        loader = pipeline.shuffled_batches(
            source, Double(), what="records", global_batch_size=4, seed=0, worker_count=1
        )
        it = iter(loader)
        got = sorted(int(v) for _ in range(4) for v in next(it)["x"])
        assert got == list(range(0, 32, 2)), got
        print("ok")
    """
)


def test_cli_setup_lets_grain_start_worker_processes(tmp_path):
    script = tmp_path / "grain_workers.py"  # a file: grain's workers re-import its module
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert "UnparsedFlagAccessError" not in r.stderr
