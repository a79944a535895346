"""REALM's retrieval and reading for the train step: embed the queries, search the index, re-embed
the hits with live parameters, read every candidate. Pure; the step (step.py) jits it.

Shapes: B queries, K candidates (candidate 0 = the null document, K-1 retrieved), P masked
positions per query, Lq/Lb/Lj query/block/joint lengths, D = proj_size, H the reader's width."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from realm_jax.index.embedding import embed_block_tokens, embed_query_tokens
from realm_jax.model.inputs import (
    NULL_BLOCK,
    build_joint,
    dropout_kwargs,
    null_block_tokens,
    null_reader_input,
)
from realm_jax.model.realm import RealmModel
from realm_jax.ops import mips
from realm_jax.pretrain.step_config import StepConfig

ABSENT = -1e9  # the score of a candidate slot that holds no block (its prior is 0)


def retrieve(params, batch, index_emb, index_tokens, **kw):
    """Embed queries, search the index, re-embed the hits with live params: `retrieve_embedded`
    without the candidates' embeddings, (q_emb [B, D], relevance [B, K], candidate tokens
    [B, K, Lb], retrieved ids [B, K-1])."""
    q_emb, _, relevance, cands, ids = retrieve_embedded(
        params, batch, index_emb, index_tokens, **kw
    )
    return q_emb, relevance, cands, ids


def retrieve_embedded(
    params,
    batch,
    index_emb,
    index_tokens,
    *,
    model: RealmModel,
    mesh: Mesh,
    cfg: StepConfig,
    rng=None,
    inject=None,
    extra=None,
):
    """Embed queries, search the index, re-embed the hits with live params.

    extra [B, m] (block ids, -1 none): a second retriever's blocks joined to the dense top-k
    (join_extra; train.bm25_candidates), K = num_candidates + m; a slot whose block repeats
    another scores ABSENT.

    cfg.fixed_null: the null document's prior is 1/K whatever the query (train.null_doc
    "fixed"), its score that of the retrieved blocks' mean probability, without gradient.

    inject [B] (block ids, -1 none): a block put among query b's candidates in place of its
    lowest-scored retrieved one when the search did not find it (train.own_block_steps'
    copying curriculum for a separate text: the sentence's document's block; realm_loss).

    Returns (q_emb [B, D], the retrieved candidates' live embeddings [B, K-1, D], relevance
    [B, K], candidate tokens [B, K, Lb], retrieved ids [B, K-1], -1 for an empty slot).
    Candidate 0 is the null document, as in the release
    (example_generator.py prepends an empty Document; model.py scores every candidate with
    one einsum): the empty block `[CLS] [SEP] [SEP]` embedded by the live document embedder,
    so its score and gradient are those of any candidate. (A constant score of 0 took all the
    probability whenever an untrained projection scored every retrieved block below 0, and
    the retriever's gradient vanished for good.)
    """
    q_ids = batch["query_ids"]  # [B, Lq]
    q_emb = embed_query_tokens(model, params, q_ids, rng)  # [B, D]
    k = cfg.num_candidates - 1
    _, ids, tokens = mips.search_and_fetch(
        mesh,
        jax.lax.stop_gradient(q_emb),
        index_emb,
        index_tokens,
        batch["block_id"],
        k=k,
        num_valid=cfg.num_valid,
    )  # ids [B, k], tokens [B, k, Lb]
    if inject is not None:
        put = (inject >= 0) & ~(ids == inject[:, None]).any(1)  # [B]
        ids = ids.at[:, -1].set(jnp.where(put, inject, ids[:, -1]))
        gold = mips.fetch_rows(mesh, index_tokens, jnp.maximum(inject, 0)[:, None])[:, 0]
        tokens = tokens.at[:, -1].set(jnp.where(put[:, None], gold, tokens[:, -1]))
    if extra is not None:  # a second retriever's blocks join the dense ones
        ids, tokens = join_extra(mesh, index_tokens, ids, tokens, extra)
    B, k, Lb = tokens.shape
    flat = tokens.reshape(B * k, Lb)
    d_emb = embed_block_tokens(model, params, flat, rng).reshape(B, k, -1)  # live params: grads
    # The null block embedded at its own length (3): padding is masked and positions are
    # absolute, so this equals embedding it padded to Lb (tested), at a fraction of the cost.
    # One row per query, so each gets its own dropout mask, as the release's per-example
    # candidates do.
    null_emb = embed_block_tokens(
        model,
        params,
        null_block_tokens(B, len(NULL_BLOCK)),
        None if rng is None else jax.random.fold_in(rng, 4),
    )  # [B, D]
    relevance = score_candidates(q_emb, null_emb, d_emb, ids, cfg.fixed_null)
    cands = jnp.concatenate([null_block_tokens(B, Lb)[:, None].astype(tokens.dtype), tokens], 1)
    return q_emb, d_emb, relevance, cands, ids


def score_candidates(q_emb, null_emb, hits, ids, fixed_null: bool):
    """The prior's scores [B, K]: q_emb [B, D] against the null document's embedding [B, D]
    and the retrieved candidates' hits [B, K-1, D]; ABSENT where ids [B, K-1] is -1 (an empty
    slot), and with fixed_null the null document's the retrieved blocks' mean probability."""
    d_emb = jnp.concatenate([null_emb[:, None], hits], axis=1)  # [B, K, D]
    relevance = jnp.einsum("bd,bkd->bk", q_emb, d_emb)
    valid = ids >= 0  # [B, K-1]: a joined candidate that repeats another (or none) is out
    relevance = relevance.at[:, 1:].set(jnp.where(valid, relevance[:, 1:], ABSENT))
    if fixed_null:
        rest = jnp.where(valid, relevance[:, 1:], -jnp.inf)
        null = jax.nn.logsumexp(rest, axis=1) - jnp.log(valid.sum(1).astype(rest.dtype))
        relevance = relevance.at[:, 0].set(jax.lax.stop_gradient(null))
    return relevance


def join_extra(mesh: Mesh, index_tokens, ids, tokens, extra):
    """The dense top-k (ids [B, k], tokens [B, k, Lb]) joined by a second retriever's blocks
    extra [B, m] (-1: none; train.bm25_candidates): (ids [B, k + m], tokens [B, k + m, Lb]),
    an extra block already among the dense ones, or earlier among the extras, given id -1.
    Every joined block is then embedded with the live parameters and scored by the query
    like the dense ones (`retrieve`), so REALM's prior and posterior cover them all."""
    m = extra.shape[1]
    earlier = jnp.tril(jnp.ones((m, m), bool), -1)  # [m, m]: j < i
    repeat = (extra[:, :, None] == ids[:, None, :]).any(-1)  # [B, m]
    repeat |= ((extra[:, :, None] == extra[:, None, :]) & earlier).any(-1)
    extra = jnp.where(repeat | (extra < 0), -1, extra).astype(ids.dtype)
    rows = mips.fetch_rows(mesh, index_tokens, jnp.maximum(extra, 0))  # [B, m, Lb]
    return jnp.concatenate([ids, extra], 1), jnp.concatenate([tokens, rows.astype(tokens.dtype)], 1)


def read_candidates(model: RealmModel, params, query_ids, cands, positions, length: int, rng=None):
    """The reader's MLM features at the masked positions for every candidate.

    query_ids [B, Lq], cands [B, K, Lb] (candidate 0 the null document), positions [B, P] ->
    (features [B, K, P, H], word embeddings [V, H], decoder bias [V]). The retrieved blocks
    are read as [CLS] x [SEP] title [SEP] body [SEP] of `length` tokens (the release leaves
    the title out; we keep it); the null document as `null_reader_input`, [B, Lq + 1]."""
    B, K, _ = cands.shape
    j_ids, j_segs, j_mask = build_joint(query_ids, cands[:, 1:], length)
    n = B * (K - 1)

    def read(ids, segs, mask, pos, i):
        return model.apply(
            {"params": params},
            ids,
            segs,
            mask,
            pos,
            method=RealmModel.mlm_features,
            **dropout_kwargs(rng, i),
        )

    hits, table, bias = read(
        j_ids.reshape(n, length),
        j_segs.reshape(n, length),
        j_mask.reshape(n, length),
        jnp.repeat(positions, K - 1, axis=0),
        2,
    )  # [B * (K-1), P, H]
    null, _, _ = read(*null_reader_input(query_ids), positions, 3)  # [B, P, H]
    hits = hits.reshape(B, K - 1, *hits.shape[1:])
    return jnp.concatenate([null[:, None], hits], axis=1), table, bias


class Candidates(NamedTuple):
    """What retrieve_and_read gives REALM's loss and the experimental terms (terms.py)."""

    q_emb: jax.Array  # [B, D] the queries' embeddings
    hits: jax.Array  # [B, K-1, D] the retrieved candidates' live embeddings
    relevance: jax.Array  # [B, K] the prior's scores, candidate 0 the null document
    features: jax.Array  # [B, K, P, H] the reader's features at the masked positions
    table: jax.Array  # [V, H] the word embeddings (the tied decoder)
    bias: jax.Array  # [V] the decoder's bias
    ids: jax.Array  # [B, K-1] the retrieved block ids, -1 an empty slot
    cands: jax.Array  # [B, K, Lb] the candidates' tokens


def retrieve_and_read(params, batch, index_emb, index_tokens, *, model, mesh, cfg, rng=None):
    """`retrieve_embedded` then `read_candidates`: the batch's "inject" [B] put among the
    candidates (the copying curriculum), its "extra_ids" [B, m] (a second retriever's blocks,
    train.bm25_candidates) joined to them. Returns Candidates."""
    q_emb, hits, relevance, cands, ids = retrieve_embedded(
        params,
        batch,
        index_emb,
        index_tokens,
        model=model,
        mesh=mesh,
        cfg=cfg,
        rng=rng,
        inject=batch.get("inject"),
        extra=batch.get("extra_ids"),
    )
    features, table, bias = read_candidates(
        model, params, batch["query_ids"], cands, batch["mlm_positions"], cfg.length, rng
    )
    return Candidates(q_emb, hits, relevance, features, table, bias, ids, cands)
