"""Host-side retrieval with the latest published index: the dense retriever of a pre-training
workdir's `ask` (the command itself, with --retriever bm25 and hybrid through the Python API's
retrievers, is an entry point: api.ask_command).

The query embedder comes from the newest checkpoint (a partial restore); the search runs on
the host with the index's serialised ScaNN searcher (exact numpy search when none was built).
The workdir may be gs://: every path here goes through realm_jax.fs.
"""

from __future__ import annotations

import jax
import numpy as np

from realm_jax import checkpoint, fs, sharding, validation
from realm_jax import workdir as paths
from realm_jax.data import versions
from realm_jax.index import store
from realm_jax.index.embedding import abstract_params, embed_query_tokens
from realm_jax.tokenization import encode_query

# The query embedder comes from a training checkpoint, the index from the refresh job that
# embeds it: `local` runs both; `train` alone publishes no index.
TRAIN_FIRST = "train first (`realm-jax local`, or `train` with `refresh`)"


def _query_params(config, workdir: str, mesh):
    model, abstract = abstract_params(config, mesh, "query_embedder")
    mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
    step = mgr.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {paths.checkpoint_dir(workdir)}: {TRAIN_FIRST}")
    return model, checkpoint.restore_params_subtree(mgr, step, "query_embedder", abstract)


def ask(config, workdir: str, question: str, top_k: int = 5):
    """[(title, text, score)] of the top_k blocks for a question or masked sentence."""
    validation.question(question)
    top_k = validation.top_k(top_k, "--top_k")
    view = versions.open_view(config, workdir)  # one corpus version: its blocks, its index
    top_k = min(top_k, len(view))  # never pad rows
    found = store.latest_valid(view.index_dir)
    if found is None:
        trained = fs.isdir(paths.checkpoint_dir(workdir)) and (
            checkpoint.manager(workdir, with_data=False, read_only=True).latest_step() is not None
        )
        hint = (
            "publish one from the newest checkpoint with `realm-jax refresh --max_versions 1`"
            if trained  # trained with refresh.mode=amortized: nothing published
            else TRAIN_FIRST
        )
        raise FileNotFoundError(f"no valid index in {view.index_dir}: {hint}")
    _, path = found
    # one device of this process (jax.devices()[0] is process 0's): every process answers alone
    mesh = sharding.inference_mesh(config.mesh, devices=jax.local_devices()[:1])
    model, params = _query_params(config, workdir, mesh)
    ids = encode_query(question, config.data.query_len)[None]
    q = sharding.to_host(embed_query_tokens(model, {"query_embedder": params}, ids))
    scann_dir = fs.join(path, store.SCANN_DIR)  # on gs:// load_searcher downloads it first
    if fs.isdir(scann_dir):
        from realm_jax.index import scann as scann_index

        hits, scores = scann_index.search(scann_index.load_searcher(scann_dir), q, top_k)
        # datapoint -> block id (an update's upserts and deletes reorder them)
        rows = view.scann_rows if view.scann_rows is not None else view.rows
    else:
        emb = store.load_embeddings(path)
        s = q @ emb.T
        hits = np.argsort(-s, axis=1)[:, :top_k]
        scores = np.take_along_axis(s, hits, axis=1)
        rows = view.rows  # position -> block id
    return [(*view.text(int(rows[i])), float(s)) for i, s in zip(hits[0], scores[0]) if i >= 0]


def one_line(text: str, width: int = 200) -> str:
    """`text` on one line for a terminal: control characters and runs of whitespace as one
    space, cut to `width` characters (an ellipsis marks a cut)."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= width else text[: width - 1].rstrip() + "\u2026"
