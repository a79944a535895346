"""Host-side retrieval with the latest published index: the `ask` command.

The query embedder comes from the newest checkpoint (a partial restore); the search runs on
the host with the index's serialised ScaNN searcher (exact numpy search when none was built).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from realm_jax import checkpoint, index, sharding
from realm_jax.models import RealmModel
from realm_jax.tokenization import encode_query


def _query_params(config, workdir: str, mesh):
    from realm_jax.train_step import abstract_params

    model, abstract = abstract_params(config, mesh, "query_embedder")
    mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
    step = mgr.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoint.checkpoint_dir(workdir)}")
    return model, checkpoint.restore_params_subtree(mgr, step, "query_embedder", abstract)


def ask(config, workdir: str, question: str, top_k: int = 5):
    """[(title, text, score)] of the top_k blocks for a question or masked sentence."""
    from realm_jax.data import prepare
    from realm_jax.refresh import index_dir

    found = index.latest_valid(index_dir(workdir))
    if found is None:
        raise FileNotFoundError(f"no valid index in {index_dir(workdir)}: run `realm-jax refresh`")
    _, path = found
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
    model, params = _query_params(config, workdir, mesh)
    ids = encode_query(question, config.data.query_len)[None]
    q = np.asarray(
        model.apply(
            {"params": {"query_embedder": params}},
            ids,
            np.zeros_like(ids),
            (ids != 0).astype(np.int32),
            method=RealmModel.embed_query,
        )
    )
    scann_dir = os.path.join(path, "scann")
    if os.path.isdir(scann_dir):
        from realm_jax import scann_index

        hits, scores = scann_index.search(scann_index.load_searcher(scann_dir), q, top_k)
    else:
        emb = index.load_embeddings(path)
        s = q @ emb.T
        hits = np.argsort(-s, axis=1)[:, :top_k]
        scores = np.take_along_axis(s, hits, axis=1)
    ddir = config.data.data_dir or os.path.join(os.path.abspath(workdir), "data")
    return [(*prepare.block_text(ddir, int(i)), float(s)) for i, s in zip(hits[0], scores[0])]
