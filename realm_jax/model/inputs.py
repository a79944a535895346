"""The networks' inputs built on device: block segments, the reader's joint input, the null
document (the release's empty block), dropout keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from realm_jax.tokenization import CLS_ID, SEP_ID


def dummy_input(length: int):
    """A dummy (ids, segs, mask) of one row, for init/eval_shape."""
    ids = jnp.ones((1, length), jnp.int32)
    return ids, jnp.zeros_like(ids), ids


def init_inputs(lq: int, lb: int, lj: int):
    """Dummy inputs touching every network of RealmModel, for init/eval_shape."""
    t = dummy_input
    return t(lq), t(lb), t(lj), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, lj), jnp.int32)


def check_fits(what: str, length: int, cfg, part: str, role: str | None = None) -> None:
    """An input of `length` must fit the network's position table: a clear error naming the
    config fields, not an XLA shape error. An embedder's input (`role` "query" or "doc")
    grows by its prefix's wordpieces (model.query_prefix / doc_prefix)."""
    extra = len(cfg.prefix_ids(role)) if role else 0
    if length + extra > cfg.max_position_embeddings:
        field = {"query": "query_prefix", "doc": "doc_prefix"}.get(role or "")
        plus = f" + {extra} wordpieces of model.{field}" if extra else ""
        raise ValueError(
            f"{what} = {length}{plus} exceeds model.{part}.max_position_embeddings = "
            f"{cfg.max_position_embeddings}"
        )


def joint_len(config) -> int:
    return config.data.query_len + config.data.block_len - 1


def block_segments(tokens):
    """[..., Lb] block ids -> segment ids: 0 up to the title's [SEP], 1 after it."""
    is_sep = tokens == SEP_ID
    seg = (jnp.cumsum(is_sep, axis=-1) - is_sep) >= 1
    return jnp.where(tokens != 0, seg, False).astype(jnp.int32)


def dropout_kwargs(rng, i: int) -> dict:
    """apply() kwargs: dropout on with a per-network key when training (rng given)."""
    if rng is None:
        return {}
    return {"train": True, "rngs": {"dropout": jax.random.fold_in(rng, i)}}


def build_joint(query_ids, block_tokens, length: int):
    """[CLS] x [SEP] title [SEP] body [SEP] for every candidate, built on device.

    query_ids [B, Lq] (padded [CLS] x [SEP]), block_tokens [B, K, Lb] ([CLS] title [SEP] body
    [SEP], all-zero for the null document) -> (ids, segs, mask), each [B, K, length].
    Query tokens keep their positions, so the masked positions carry over unchanged.
    """
    B, K, Lb = block_tokens.shape
    Lq = query_ids.shape[1]
    qlen = (query_ids != 0).sum(-1)[:, None, None]  # [B, 1, 1]
    pos = jnp.arange(length)[None, None, :]  # [1, 1, Lj]
    q_part = jnp.take(query_ids, jnp.minimum(pos[0, 0], Lq - 1), axis=1)[:, None, :]  # [B,1,Lj]
    src = jnp.clip(pos - qlen + 1, 0, Lb - 1)  # skip the block's own [CLS]
    b_part = jnp.take_along_axis(block_tokens, jnp.broadcast_to(src, (B, K, length)), axis=2)
    in_block = (pos >= qlen) & (pos - qlen + 1 < Lb)
    ids = jnp.where(pos < qlen, q_part, jnp.where(in_block, b_part, 0))
    segs = ((pos >= qlen) & (ids != 0)).astype(jnp.int32)
    return ids, segs, (ids != 0).astype(jnp.int32)


NULL_BLOCK = (CLS_ID, SEP_ID, SEP_ID)  # the release's empty Document: [CLS] title [SEP] body [SEP]


def null_block_tokens(batch: int, length: int):
    """[batch, length] token rows of the null document: `[CLS] [SEP] [SEP]`, zero-padded
    (segments (0, 0, 1) by `block_segments`, as the release's bert_format of ([], []))."""
    row = jnp.zeros((length,), jnp.int32).at[: len(NULL_BLOCK)].set(jnp.array(NULL_BLOCK))
    return jnp.broadcast_to(row, (batch, length))


def null_reader_input(query_ids):
    """The reader's input for the null document: `[CLS] x [SEP] [SEP]`, the query joined with
    the empty block (the release's bert_format of (x, [])), segment 1 on the last [SEP].
    query_ids [B, Lq] -> (ids, segs, mask) [B, Lq + 1]: the joint input of the empty block
    without the padding up to the joint length (same outputs, tested)."""
    B, Lq = query_ids.shape
    qlen = (query_ids != 0).sum(-1, keepdims=True)  # [B, 1]
    pos = jnp.arange(Lq + 1)[None, :]
    ids = jnp.concatenate([query_ids, jnp.zeros((B, 1), query_ids.dtype)], axis=1)
    ids = jnp.where(pos == qlen, SEP_ID, ids)
    segs = (pos == qlen).astype(jnp.int32)
    return ids, segs, (ids != 0).astype(jnp.int32)
