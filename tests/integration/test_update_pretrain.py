"""REALM pre-training on an updated workdir (issue 61, deliverable 2): a pre-training run and
its refresh job read the workdir's newest corpus version. After `update` adds and deletes
documents, the resumed trainer retrieves from that version's live blocks (the new ones
included), its in-process refresh and the `refresh` job publish into that version's own index
store, the embeddings of every live block (new ones included) equal the checkpoint's document
embedder applied to the version's blocks (an independent path: update's one-device embedding),
`ask` reads the refreshed index, the prepared corpus's index is left as it was, `update` is
refused while a pre-training run holds the workdir, and ICT is refused there."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from realm_jax import sharding
from realm_jax import workdir as paths
from realm_jax.corpus_errors import CorpusError
from realm_jax.data import versions
from realm_jax.index import store, update
from realm_jax.lock import workdir_lock
from tests.conftest import REPO, prepare_sample_head
from tests.support.runs import REALM_OVERRIDES
from tests.support.runs import realm_config as config

NEW = [
    ("new-a", "Quellbrook", "Quellbrook is a town of weavers. It was founded in 1620 by traders."),
    ("new-b", "Orvanne Tesk", "Orvanne Tesk was a chemist born in Quellbrook in 1871."),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_sample_head(tmp_path_factory, config, 40)


def _cli(command: str, workdir: str, data_dir: str, log: str, *extra: str) -> str:
    cmd = [
        *(sys.executable, "-m", "realm_jax", command, "--workdir", workdir),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *[f"--config.{o}" for o in REALM_OVERRIDES],
        f"--config.data.data_dir={data_dir}",
        *extra,
    ]
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = open(log, errors="replace").read()
    assert rc.returncode == 0, text[-3000:]
    return text


def _reference(cfg, workdir: str, step: int, tokens: np.ndarray) -> np.ndarray:
    """Every row of `tokens` embedded with checkpoint `step`'s document embedder on one
    device (update's embedding path, not the trainer's or the refresh job's)."""
    embed = update.embedder_fn(cfg, workdir, {"kind": "checkpoint", "step": step})
    return np.asarray(embed(tokens), np.float32)


def test_pretraining_reads_and_refreshes_the_updated_corpus(data_dir, tmp_path):
    w = str(tmp_path / "w")
    cfg = config(f"data.data_dir={data_dir}")
    _cli("train", w, data_dir, str(tmp_path / "t1.log"), "--config.train.steps=8")
    v0 = versions.open_view(cfg, w)
    before = store.list_versions(paths.index_dir(w))
    assert before == [0, 4], before
    docs0 = v0.docs()
    victim = sorted(docs0)[0]
    changes = tmp_path / "changes.jsonl"
    changes.write_text(
        "".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in NEW)
        + json.dumps({"id": victim, "delete": True})
        + "\n"
    )
    # refused while a pre-training trainer holds the workdir: nothing published
    with workdir_lock(w, "trainer"), pytest.raises(CorpusError, match="pre-training trainer"):
        update.apply(cfg, w, update.read_changes(str(changes)), say=lambda s: None)
    assert versions.latest(w) is None
    r = update.apply(cfg, w, update.read_changes(str(changes)), say=lambda s: None)
    v1 = versions.open_view(cfg, w)
    assert (r.added, r.deleted, v1.version) == (2, 1, 1)
    n0 = v1.num_base
    assert set(int(x) for x in v1.rows) == (set(range(n0)) - set(docs0[victim][2])) | set(
        range(n0, n0 + r.new_blocks)
    )
    # the device table the trainer retrieves from: the live blocks in position order, and
    # their titles by position (the held-out evaluation's and the curriculum's)
    mesh = sharding.make_mesh(cfg.mesh)
    table = v1.device_tokens(mesh, with_titles=True)
    live = [v1[p] for p in range(len(v1))]
    want = np.zeros((len(v1), v1.block_len), np.int64)
    for p, rec in enumerate(live):
        want[p, : len(rec["token_ids"])] = rec["token_ids"]
    np.testing.assert_array_equal(np.asarray(sharding.to_host(table.rows))[: len(v1)], want)
    first_new = next(p for p, rec in enumerate(live) if rec["doc_id"] == b"new-a")
    assert table.titles.get("Quellbrook") == first_new
    assert table.titles.name(first_new) == "Quellbrook" and table.shape[0] == len(v1)
    # the version's own index: update's, from the index it read (step 4's embedder)
    assert store.list_versions(v1.index_dir) == [4]
    with pytest.raises(CorpusError, match="ict. trains over the prepared corpus only"):
        versions.refuse_ict(w)

    # the run resumed at step 8 reads version 1: its in-process refresh re-embeds v1's blocks
    log = _cli("train", w, data_dir, str(tmp_path / "t2.log"), "--config.train.steps=16")
    assert f"{len(v1)} blocks (corpus version 1 of {w}" in log
    got = store.list_versions(v1.index_dir)
    assert {8, 12} <= set(got), got
    assert store.list_versions(paths.index_dir(w)) == before  # the prepared corpus's: untouched
    tokens = v1.blocks()[0]
    path12 = store.latest_valid(v1.index_dir, exclude=frozenset(s for s in got if s > 12))[1]
    emb12 = np.asarray(store.load_embeddings(path12))
    assert emb12.shape == (len(v1), cfg.model.proj_size)
    np.testing.assert_allclose(emb12, _reference(cfg, w, 12, tokens), rtol=1e-4, atol=2e-5)
    # the refresh job (external mode) embeds the newest checkpoint's version of v1 too
    _cli(
        "refresh",
        w,
        data_dir,
        str(tmp_path / "r.log"),
        "--config.refresh.mode=external",
        "--max_versions=1",
    )
    newest = store.latest_valid(v1.index_dir)
    assert newest[0] == 16, store.list_versions(v1.index_dir)
    emb16 = np.asarray(store.load_embeddings(newest[1]))
    np.testing.assert_allclose(emb16, _reference(cfg, w, 16, tokens), rtol=1e-4, atol=2e-5)
    new_rows = [p for p in range(len(v1)) if v1.row(p) >= n0]
    assert new_rows and not np.allclose(emb16[new_rows], emb12[new_rows])  # refreshed too
    # the next update embeds with the checkpoint that made the served (refreshed) index
    manifest = json.load(open(os.path.join(newest[1], "manifest.json")))
    assert update.served_embedder(v1, manifest) == {"kind": "checkpoint", "step": 16}
    own = {"step": v1.manifest["index_step"]}  # update's own version (retention removed it)
    assert (
        update.served_embedder(v1, own)
        == v1.manifest["embedder"]
        == {
            "kind": "checkpoint",
            "step": 4,
        }
    )
    # `ask` reads the newest index of the version: scores are v1's step-16 embeddings'
    from realm_jax.index import ask as serve

    hits = serve.ask(cfg, w, "Which town of weavers was founded in 1620?", 3)
    assert len(hits) == 3
