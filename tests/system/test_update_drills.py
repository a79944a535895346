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


def test_update_on_gcs(tmp_path_factory, tmp_path):
    """A workdir on gs:// (a local GCS server): the version is written in place with its
    manifest last, and read back whole (its blocks, its index, its ScaNN rows)."""
    import os

    import numpy as np

    from acceptance import update_drills
    from tests.support import fake_gcs

    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    local = update_drills.base_workdir(str(tmp_path))
    changes = update_drills.write_changes(str(tmp_path), local)
    with fake_gcs.module_server(tmp_path_factory, "realm-test"):
        from realm_jax import fs
        from realm_jax.config import load_config
        from realm_jax.data import versions
        from realm_jax.index import store

        work = "gs://realm-test/w"
        fs.upload_tree(local, work)
        env = update_drills._env(**{k: os.environ[k] for k in fake_gcs.ENV_KEYS if k in os.environ})
        p = update_drills.cli("update", "--workdir", work, "--corpus", changes, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "published corpus version 1: 3 added, 2 replaced, 2 deleted" in p.stdout
        cfg = load_config(os.path.join(REPO, update_drills.CONFIG), [])
        v = versions.open_view(cfg, work)
        emb = store.load_embeddings(store.latest_valid(v.index_dir)[1])
        assert v.version == 1 and len(emb) == len(v) and v.text(v.row(len(v) - 1))[0]
        assert sorted(v.scann_rows.tolist()) == v.rows.tolist()
        assert np.isfinite(emb).all()
