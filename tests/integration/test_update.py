"""`update` (issue 61): a trained workdir's corpus changed without training.

On two sample articles with the tiny networks: the published index after an update equals every
live block of the edited corpus embedded afresh (an independent path: the whole table through
the embedding pass fine-tuning uses), block ids stay stable across updates, a version being
read is never changed by the next, ScaNN's in-place upsert/delete returns what exact search over
the live blocks returns, and every kind of bad change is one error naming its line with nothing
written."""

import json
import os

import numpy as np
import pytest

from realm_jax import sharding
from realm_jax.corpus_errors import CorpusError
from realm_jax.data import versions
from realm_jax.index import scann as scann_index
from realm_jax.index import store, update
from realm_jax.qa import commands as qa_commands
from realm_jax.qa.evaluation import FrozenIndex
from tests.support.runs import qa_config

NEW = [
    {
        "id": "new-a",
        "title": "Quellbrook",
        "text": "Quellbrook is a town of weavers. It was founded in 1620 by river traders.",
    },
    {
        "id": "new-b",
        "title": "Orvanne Tesk",
        "text": "Orvanne Tesk was a chemist born in Quellbrook in 1871. She studied salts.",
    },
]


def _embed_all(cfg, tokens):
    """Every row of a token table embedded with the warm start's document embedder, through
    fine-tuning's own embedding pass (FrozenIndex.embed), not update's."""
    mesh = sharding.make_mesh(cfg.mesh)
    model, params = qa_commands.initial_params(cfg, mesh)
    _, emb = FrozenIndex.embed(mesh, model, params, tokens, 8)
    return np.asarray(sharding.to_host(emb))[: len(tokens)]


@pytest.fixture(scope="module")
def work(qa_files, tmp_path_factory):
    """A QA workdir with the frozen index fine-tuning publishes (the warm start's embedder)."""
    root, ddir = qa_files
    w = str(tmp_path_factory.mktemp("upd") / "w")
    cfg = qa_config(root, ddir, "refresh.build_scann=true")
    mesh = sharding.make_mesh(cfg.mesh)
    model, params = qa_commands.initial_params(cfg, mesh)
    tokens = versions.open_view(cfg, w).blocks()[0]
    qa_commands.frozen_index(cfg, w, mesh, model, params, tokens)
    return cfg, w


def _tree(w):
    return sorted(os.path.relpath(os.path.join(d, f), w) for d, _, fs_ in os.walk(w) for f in fs_)


def test_update_then_reads_follow(work, tmp_path):
    cfg, w = work
    v0 = versions.open_view(cfg, w)
    n0 = len(v0)
    docs0 = v0.docs()
    victim, replaced = sorted(docs0)[0], sorted(docs0)[1]
    title = v0.record(docs0[replaced][2][0])["title"].decode()
    changes = [
        update.Change("t:1", NEW[0]["id"], NEW[0]["title"], NEW[0]["text"]),
        update.Change("t:2", replaced, title, "A replaced text about materialism and matter."),
        update.Change("t:3", victim, delete=True),
    ]
    r = update.apply(cfg, w, changes, say=lambda s: None, initial=qa_commands.initial_params)
    assert (r.added, r.replaced, r.deleted) == (1, 1, 1)
    v1 = versions.open_view(cfg, w)
    assert v1.version == r.version == 1
    dead = set(docs0[victim][2]) | set(docs0[replaced][2])
    # stable ids: old live rows keep their ids, dropped rows are gone, new rows come after
    assert set(v1.rows) == (set(v0.rows) - dead) | set(range(n0, n0 + r.new_blocks))
    assert list(v1.rows) == sorted(v1.rows)
    assert v1.text(n0)[0] == "Quellbrook"
    assert v1.text(docs0[victim][2][0]) == v0.text(docs0[victim][2][0])  # tombstone still reads
    # the index equals the edited corpus embedded afresh, row for row
    tokens, doc_ids, _ = v1.blocks()
    emb = store.load_embeddings(store.latest_valid(v1.index_dir)[1])
    np.testing.assert_allclose(emb, _embed_all(cfg, tokens), rtol=1e-4, atol=1e-5)
    assert victim not in doc_ids and doc_ids.count(NEW[0]["id"]) >= 1
    # its ScaNN searcher (updated in place), read as `ask` reads it: datapoints mapped to
    # block ids through scann_rows, the same top 5 as exact search over the live blocks
    searcher = scann_index.load_searcher(
        os.path.join(store.latest_valid(v1.index_dir)[1], store.SCANN_DIR)
    )
    # queries off the blocks' common direction (random-init embeddings nearly share one):
    # scores then differ well above float32's resolution, so the order is not ties
    c = emb.mean(0) / np.linalg.norm(emb.mean(0))
    d = emb[[0, len(emb) // 2, len(emb) - 1]] - emb.mean(0)
    q = (d - (d @ c)[:, None] * c[None]) * 100
    ids, _ = scann_index.search(searcher, q, 5)
    exact = v1.rows[np.argsort(-(q @ emb.T), axis=1, kind="stable")[:, :5]]
    assert r.scann == "upsert" and (v1.scann_rows[ids] == exact).all()
    # the same changes again: nothing new; a prepared document given as it is: unchanged
    assert (
        update.apply(
            cfg, w, changes, say=lambda s: None, initial=qa_commands.initial_params
        ).version
        == 1
    )
    keep = sorted(set(docs0) - {victim, replaced})[0]
    recs = [v0.record(i) for i in docs0[keep][2]]
    same = update.Change("t:1", keep, recs[0]["title"].decode(), "")
    same.text = " ".join(x["text"].decode() for x in recs)
    plan = update.diff(v1, [same])
    assert (plan.unchanged, plan.new_blocks, plan.dead) == (1, [], [])
    # a reader pinned to version 1 still reads it whole after version 2 is published
    r2 = update.apply(
        cfg,
        w,
        [update.Change("t:1", NEW[1]["id"], NEW[1]["title"], NEW[1]["text"])],
        say=lambda s: None,
        initial=qa_commands.initial_params,
    )
    assert r2.version == 2
    assert len(store.load_embeddings(store.latest_valid(v1.index_dir)[1])) == len(v1)
    v2 = versions.open_view(cfg, w)
    assert v2.num_rows == v1.num_rows + r2.new_blocks and v2.row(len(v2) - 1) == v1.num_rows
    with pytest.raises(CorpusError, match="trains over the prepared corpus only"):
        versions.refuse_ict(w)


def test_scann_upsert_and_delete_match_exact_search():
    """ScaNN's native delete/upsert on a loaded tree + AH searcher, through update's
    bookkeeping of datapoint -> row: deleted rows never come back, an upserted row is its own
    nearest neighbour, and a brute-force searcher updated the same way agrees with numpy."""
    rng = np.random.default_rng(0)
    db = rng.standard_normal((3000, 16)).astype(np.float32)
    rows = np.arange(3000)
    new = rng.standard_normal((40, 16)).astype(np.float32) * 3
    dead = sorted(rng.choice(3000, 60, replace=False).tolist())
    live = np.array([r for r in rows if r not in set(dead)] + list(range(3000, 3040)))
    full = np.concatenate([db, new])
    for params in ({"brute_force": True}, {"brute_force": False, "num_leaves": 20}):
        s = scann_index.build_searcher(db, k=10, **params)
        plan = update.Plan({}, dead, [type("B", (), {"block_id": 3000 + i}) for i in range(40)])
        d = f"/tmp/scann-{os.getpid()}-{params['brute_force']}"
        scann_index.save_searcher(s, d)

        got, srows, mode, _ = _upsert(d, rows, plan, new, live)
        assert mode == "upsert" and sorted(srows) == sorted(live)
        q = np.concatenate([new[:5], rng.standard_normal((20, 16)).astype(np.float32)])
        ids, _ = scann_index.search(got, q, 5)
        found = srows[ids]
        assert not np.isin(found, dead).any()
        assert (found[:5, 0] == np.arange(3000, 3005)).all()  # an upserted row finds itself
        if params["brute_force"]:
            exact = live[np.argsort(-(q @ full[live].T), axis=1)[:, :5]]
            assert (found == exact).all()


def _upsert(sdir, rows, plan, new, live):
    """update.update_searcher's upsert path on a searcher saved in sdir/scann."""
    import shutil

    parent = sdir + "-v"
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(os.path.join(parent, "scann")):
        shutil.rmtree(os.path.join(parent, "scann"))
    shutil.move(sdir, os.path.join(parent, "scann"))
    try:
        return update.update_searcher(None, parent, rows, plan, new, None, live, 1.0, 0)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


BAD = [
    ('{"id": "x", "title": "T", "text": "ok"\n', "malformed JSON"),
    (
        '{"id": "x", "title": "T", "text": "one"}\n{"id": "x", "title": "T", "text": "two"}\n',
        "duplicate id 'x'",
    ),
    ('{"id": "nope-never", "delete": true}\n', "unknown id 'nope-never' to delete"),
    ('{"id": "x", "title": "T", "text": "   "}\n', "empty text"),
    ('{"id": "x", "title": "T", "text": "a\\u0000b"}\n', "binary text"),
    ('{"id": "x", "delete": true, "text": "t"}\n', "a delete line with 'title' or 'text'"),
    (b'{"id": "x", "title": "T", "text": "\xff\xfe"}\n', "invalid UTF-8"),
]


@pytest.mark.parametrize("content,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_changes_are_one_error_and_change_nothing(work, tmp_path, content, message):
    cfg, w = work
    path = tmp_path / "changes.jsonl"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    before = _tree(w)
    with pytest.raises(CorpusError, match=message) as e:
        update.apply(cfg, w, update.read_changes(str(path)), say=lambda s: None)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert "nothing was changed" in str(e.value)
    assert _tree(w) == before


def test_fine_tuning_that_refreshes_trains_the_document_embedder(qa_files):
    """qa.train_doc_embedder: the reader beam's blocks embedded again in the step. With the
    index embedded by the same parameters the loss is the frozen-index loss exactly, the query
    embedder's and reader's gradients are the same, and the document embedder gets one (none
    without the option), which the optimizer then applies."""
    import functools

    import jax
    import optax

    from realm_jax.data import datasets
    from realm_jax.qa import data as qa_data
    from realm_jax.qa import step as qa_step

    root, ddir = qa_files
    cfg = qa_config(root, ddir, "qa.train_doc_embedder=true")
    mesh = sharding.make_mesh(cfg.mesh)
    model, params = qa_commands.initial_params(cfg, mesh)
    tokens = datasets.load_blocks(ddir)[0]
    index, _ = FrozenIndex.embed(mesh, model, params, tokens, 8)
    _, arrays = qa_data.training_questions(cfg, ddir)
    batch = {k: v[:8] for k, v in arrays.items()}
    kw = qa_step.step_kwargs(cfg, mesh, len(tokens))
    assert kw["fresh"] == cfg.qa.reader_beam_size > 0
    out = {}
    for fresh in (0, kw["fresh"]):
        fn = functools.partial(qa_step.qa_loss, model=model, rng=None, **(kw | {"fresh": fresh}))
        (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(
            params, batch, index.emb, index.tokens
        )
        out[fresh] = (float(loss), sharding.to_host(grads))
    (l0, g0), (l1, g1) = out[0], out[kw["fresh"]]
    assert np.isclose(l0, l1, rtol=1e-5) and l0 > 0
    for name in ("query_embedder", "reader"):
        for a, b in zip(jax.tree.leaves(g0[name]), jax.tree.leaves(g1[name]), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)
    assert float(optax.tree.norm(g0["doc_embedder"])) == 0.0
    assert float(optax.tree.norm(g1["doc_embedder"])) > 0.0
    assert qa_step.frozen_networks(cfg) == () and qa_step.frozen_networks(qa_config(root, ddir))


def test_replace_all_diffs_a_whole_corpus_against_the_prepared_one(work, qa_files, tmp_path):
    """--replace_all: the corpus the workdir was prepared from, one document edited and one
    left out. The prepared documents (no raw text kept) are matched by their blocks, cut as
    `prepare` cut them: everything else is unchanged."""
    root, ddir = qa_files
    cfg, w = work
    with open(root / "corpus.jsonl") as f:
        docs = [json.loads(line) for line in f]
    docs[0]["text"] += " One sentence more."
    gone = docs.pop(1)
    path = tmp_path / "new.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    base = versions.View(w, ddir, 0, None)  # the prepared corpus (version 0)
    changes, by_line = update.whole_corpus(str(path), base.docs().keys())
    plan = update.diff(base, changes, by_line)
    assert (plan.added, plan.replaced, plan.deleted) == (0, 1, 1)
    assert plan.unchanged == len(docs) - 1
    assert set(plan.dead) == set(base.docs()[gone["id"]][2]) | set(base.docs()[docs[0]["id"]][2])
