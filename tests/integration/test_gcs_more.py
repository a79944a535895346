"""More gs:// user paths, against fake-gcs-server (tests/support/fake_gcs.py): `ask` with a
pre-training config (its "train first" check and the index's ScaNN searcher on gs://), the
training loop's train.record_example_ids file on a gs:// workdir (a local copy uploaded at
every checkpoint save and at the end), ScaNN searchers saved to and loaded from gs://, and
`plan --json gs://...`."""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import checkpoint, fs, sharding
from realm_jax import workdir as paths
from realm_jax.config import load_config
from tests.conftest import REPO
from tests.support import fake_gcs
from tests.support.realm_fixtures import TINY_NETWORKS

BUCKET = "realm-test"
ROOT = f"gs://{BUCKET}"
REALM = os.path.join(REPO, "configs", "realm.py")
TITLES = ("Materialism", "Political philosophy")  # two small articles of data/sample
REALM_OVERRIDES = TINY_NETWORKS + [
    "model.proj_dropout=0",
    "data.block_len=64",
    "data.query_len=24",
    "data.max_predictions=5",
    "data.masking=random",  # no spaCy
    "data.eval_fraction=0.0",
    "train.batch_size=8",
]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server for the module (tests/support/fake_gcs.py: environment and cache set)."""
    with fake_gcs.module_server(tmp_path_factory, BUCKET) as server:
        yield server


def _realm_config(*extra):
    return load_config(f"{REALM}:smoke", REALM_OVERRIDES + list(extra))


# --------------------------------------------------------------------------------- ask


def test_ask_reads_a_gcs_workdir(gcs, tmp_path, monkeypatch):
    """A gs:// pre-training workdir with a checkpoint but no index is told to publish one (not
    to train first); with a published index `ask` answers through the version's ScaNN
    searcher, copied from gs:// and removed once loaded, as exact search over a version
    without one does."""
    from realm_jax.data import prepare
    from realm_jax.index import ask, store
    from realm_jax.index import scann as scann_index
    from realm_jax.index.embedding import abstract_params

    corpus = tmp_path / "corpus.jsonl"
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        corpus.write_text("".join(line for line in f if json.loads(line)["title"] in TITLES))
    work = f"{ROOT}/ask/run"
    config = _realm_config(f"data.corpus={corpus}", f"data.data_dir={ROOT}/ask/data")
    prepare.prepare(config, config.data.data_dir)

    with pytest.raises(FileNotFoundError, match="train first"):
        ask.ask(config, work, "Who wrote the Republic?", 3)
    mesh = sharding.make_mesh(config.mesh)
    _, target = abstract_params(config, mesh, "query_embedder")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), target)
    mgr = checkpoint.manager(work, with_data=False)
    checkpoint.save(mgr, 3, {"params": {"query_embedder": params}})
    mgr.wait_until_finished()
    with pytest.raises(FileNotFoundError, match="refresh --max_versions 1"):
        ask.ask(config, work, "Who wrote the Republic?", 3)

    num_blocks = json.loads(fs.read_bytes(f"{ROOT}/ask/data/summary.json"))["counts"]["blocks"]
    emb = rng.normal(size=(num_blocks, config.model.proj_size)).astype(np.float32)
    store.publish_index(paths.index_dir(work), 3, emb)  # exact search: no searcher
    exact = ask.ask(config, work, "Who wrote the Republic?", 3)
    searcher = scann_index.build_searcher(emb, 10)
    store.publish_index(paths.index_dir(work), 4, emb, searcher=searcher)
    loaded = []
    load = scann_index.load_searcher
    monkeypatch.setattr(scann_index, "load_searcher", lambda d: loaded.append(d) or load(d))
    hits = ask.ask(config, work, "Who wrote the Republic?", 3)
    assert loaded == [f"{paths.index_dir(work)}/step_00000004/scann"]
    assert [h[:2] for h in hits] == [h[:2] for h in exact] and len(hits) == 3
    np.testing.assert_allclose([h[2] for h in hits], [h[2] for h in exact], rtol=1e-5)
    assert not [n for n in os.listdir(fs.cache_root()) if n.startswith("scann-")]


def test_scann_searcher_saved_to_and_loaded_from_gcs(gcs):
    """save_searcher/load_searcher take gs:// folders; the loaded searcher answers as the one
    saved, and its download is gone once loaded."""
    from realm_jax.index import scann as scann_index

    rng = np.random.default_rng(1)
    db = rng.normal(size=(300, 16)).astype(np.float32)
    queries = rng.normal(size=(4, 16)).astype(np.float32)
    searcher = scann_index.build_searcher(db, 5)
    folder = f"{ROOT}/scann/s1"
    scann_index.save_searcher(searcher, folder)
    assert "scann_assets.pbtxt" in fs.listdir(folder)
    want = scann_index.search(searcher, queries, 5)
    got = scann_index.search(scann_index.load_searcher(folder), queries, 5)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    assert not [n for n in os.listdir(fs.cache_root()) if n.startswith("scann-")]
    with pytest.raises(FileNotFoundError, match="not a saved searcher"):
        scann_index.load_searcher(f"{ROOT}/scann/none")


# ---------------------------------------------------------------- train.record_example_ids


def _lines(path: str) -> list[dict]:
    return [json.loads(x) for x in fs.read_text(path).splitlines()]


def test_example_ids_log_on_a_gcs_workdir(gcs, tmp_path, monkeypatch):
    """The log starts from the bucket's file (a cut last line kept alone), is uploaded whole on
    upload() and close(), and a copy on another host (another cache) goes on from the bucket's
    file, not from what this host wrote after its last upload."""
    from realm_jax.train import loop

    config = _realm_config("train.record_example_ids=true")
    work = f"{ROOT}/ids/run"
    path = paths.example_ids_path(work)
    fs.write_text(path, '{"step": 1, "example_ids": [1, 2]}\n{"step": 2, "exa')  # a killed run
    log = loop._example_ids_log(config, work)
    assert not log.local.startswith("gs:") and log.local.startswith(fs.cache_root())
    log.write(2, np.array([3, 4]))
    log.upload()
    lines = fs.read_text(path).splitlines()
    assert lines[1] == '{"step": 2, "exa' and json.loads(lines[2])["example_ids"] == [3, 4]
    log.write(3, np.array([5, 6]))  # not uploaded yet: this "host" is lost now

    monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path / "another-host"))
    again = loop._example_ids_log(config, work)
    assert again.local.startswith(str(tmp_path / "another-host"))
    again.write(3, np.array([7, 8]))
    again.close()
    assert [json.loads(x)["step"] for x in fs.read_text(path).splitlines()[2:]] == [2, 3]
    assert json.loads(fs.read_text(path).splitlines()[-1]) == {"step": 3, "example_ids": [7, 8]}
    log.file.close()

    local = tmp_path / "local-run"  # a local workdir: the file itself, appended, as before
    local.mkdir()
    log = loop._example_ids_log(config, str(local))
    assert log.local == paths.example_ids_path(str(local)) and log.remote is None
    log.write(1, np.array([9]))
    log.close()
    assert (local / "example_ids.jsonl").read_text() == '{"step": 1, "example_ids": [9]}\n'
    assert loop._example_ids_log(load_config(f"{REALM}:smoke"), work) is None  # off


class _Saves:
    """Stands in for a CheckpointManager: records the steps saved."""

    def __init__(self):
        self.steps = []

    def save(self, step, **_kw) -> bool:
        self.steps.append(step)
        return True

    def wait_until_finished(self) -> None:
        pass

    def latest_step(self):
        return self.steps[-1] if self.steps else None


class _NoMetrics:
    """Stands in for the TensorBoard writer: tensorboardX's gs:// writer uploads again when it
    is garbage-collected, which at exit, with the fake server gone, retries for 120 s."""

    def __init__(self, logdir: str):
        pass

    def scalars(self, step: int, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


def test_training_loop_uploads_example_ids_at_each_checkpoint(gcs, monkeypatch):
    """loop.run on a gs:// workdir with a stand-in task: the bucket's example_ids.jsonl holds
    every step up to the latest checkpoint while the run goes on, and every step at the end."""
    from realm_jax.train import loop

    monkeypatch.setattr(loop, "MetricWriter", _NoMetrics)

    config = _realm_config(
        "train.record_example_ids=true",
        "train.steps=5",
        "train.checkpoint_every=2",
        "train.log_every=1",
        "train.eval_every=0",
    )
    work = f"{ROOT}/ids/loop"
    path = paths.example_ids_path(work)
    seen = []  # the bucket's lines as each step starts

    def step(state, batch):
        seen.append(len(_lines(path)) if fs.exists(path) else 0)
        return state + 1, {"loss": jnp.float32(1.0)}

    def batches():
        for s in range(5):
            yield {"x": np.zeros((8, 1), np.float32), "example_id": np.arange(8) + 8 * s}

    mgr = _Saves()
    task = loop.Task(name="fake", step=step)
    loop.run(config, work, task, jnp.int32(0), batches(), mgr, 0, lambda it: None)
    assert mgr.steps == [2, 4, 5]
    assert seen == [0, 0, 2, 2, 4]
    lines = _lines(path)
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    assert lines[4]["example_ids"] == list(range(32, 40))


# --------------------------------------------------------------------------------- plan


def test_plan_json_goes_to_gcs(gcs, monkeypatch, tmp_path):
    """`plan --json gs://...` writes the figures there (a local path as before); a bucket that
    does not exist fails before anything is compiled."""
    from realm_jax import plan

    head, results = {"target": "cpu:8", "config": ""}, [{"program": "train_step", "fits": True}]
    monkeypatch.setattr(plan, "plan", lambda *a: (dict(head), list(results)))  # no compiling
    monkeypatch.setattr(plan, "format_report", lambda h, r: "report")
    args = argparse.Namespace(
        topology="cpu:8", hbm_gib=0.0, workdir="", num_blocks=100, config="c.py:smoke"
    )
    config = _realm_config()
    assert plan.command(config, argparse.Namespace(**vars(args), json=f"{ROOT}/plan/p.json")) == 0
    written = json.loads(fs.read_text(f"{ROOT}/plan/p.json"))
    assert written == {"header": {**head, "config": "c.py:smoke"}, "programs": results}
    local = argparse.Namespace(**vars(args), json=str(tmp_path / "p.json"))
    assert plan.command(config, local) == 0
    assert json.loads((tmp_path / "p.json").read_text()) == written

    monkeypatch.setattr(plan, "plan", lambda *a: pytest.fail("compiled before the check"))
    with pytest.raises(fs.StorageError, match="bucket gs://no-such-bucket does not exist"):
        plan.command(config, argparse.Namespace(**vars(args), json="gs://no-such-bucket/p.json"))
