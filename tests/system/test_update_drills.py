"""`update` killed with SIGKILL after its index is written and after its manifest is written
(the two stages with a half-built version on disk), a reader process reading all along:
acceptance/update_drills.py's checks (the previous version served, the re-run equal to an
uninterrupted update, no temp folder left, every read whole). The full drill, every stage:
`python acceptance/update_drills.py` (docs/reliability.md#update-drills)."""

import subprocess
import sys

from tests.conftest import REPO


def test_update_killed_at_its_last_stages_loses_nothing(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "acceptance/update_drills.py",
            "--root",
            str(tmp_path / "drills"),
            "--stages",
            "index,manifest",
            "--no_doc",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    fails = [ln for ln in p.stdout.splitlines() if ln.startswith("FAIL")]
    assert not fails and p.stdout.count("ok   ") == 8, p.stdout[-3000:]
