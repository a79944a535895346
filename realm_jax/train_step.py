"""The REALM train step: retrieve, re-embed, read, marginalise, update. Pure and jitted.

Shapes: B queries, K candidates (candidate 0 = the null document, K-1 retrieved), P masked
positions per query, Lq/Lb/Lj query/block/joint lengths, N blocks (padded), D = proj_size.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import checkpoint, losses, retrieval, sharding
from realm_jax.models import RealmModel, realm_model, tied_decoder_logits
from realm_jax.tokenization import CLS_ID, SEP_ID


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


# ----------------------------------------------------------------------------- optimizer


def warmup_steps(train_cfg) -> int:
    """BERT/REALM warmup: min(10000, max(100, steps / 10)) unless set explicitly."""
    if train_cfg.warmup_steps >= 0:
        return int(train_cfg.warmup_steps)
    return int(min(10_000, max(100, train_cfg.steps // 10)))


def learning_rate(train_cfg) -> optax.Schedule:
    """Linear warmup to lr, then linear decay to 0 at train.steps."""
    warm = warmup_steps(train_cfg)
    decay = max(1, train_cfg.steps - warm)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, train_cfg.lr, max(1, warm)),
            optax.linear_schedule(train_cfg.lr, 0.0, decay),
        ],
        [warm],
    )


def _decay_mask(params):
    """Weight decay on kernels and embeddings only; not on LayerNorm or biases."""

    def keep(path, _):
        names = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
        return not any(n in ("bias", "scale") for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """AdamW as in BERT, with global-norm clipping."""
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(
            learning_rate(train_cfg),
            b1=train_cfg.adam_b1,
            b2=train_cfg.adam_b2,
            eps=train_cfg.adam_eps,
            weight_decay=train_cfg.weight_decay,
            mask=_decay_mask,
        ),
    )


# ----------------------------------------------------------------------------- state


def check_lengths(config, model: RealmModel) -> None:
    """Every input fits its network's position table (a clear error, not an XLA one)."""
    d = config.data
    for name, length, cfg in (
        ("reader input length data.query_len + data.block_len - 1", joint_len(config), model.cfg),
        ("data.block_len", d.block_len, model.ecfg),
        ("data.query_len", d.query_len, model.ecfg),
    ):
        if length > cfg.max_position_embeddings:
            part = "reader" if cfg is model.cfg else "embedder"
            raise ValueError(
                f"{name} = {length} exceeds model.{part}.max_position_embeddings = "
                f"{cfg.max_position_embeddings}"
            )


def init_inputs(lq: int, lb: int, lj: int):
    """Dummy (ids, segs, mask) tuples touching every network, for init/eval_shape."""

    def t(length):
        ids = jnp.ones((1, length), jnp.int32)
        return ids, jnp.zeros_like(ids), ids

    return t(lq), t(lb), t(lj), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, lj), jnp.int32)


def create_state(config, mesh: Mesh, rng, params_hook=None):
    """The train state created sharded: eval_shape -> logical specs -> jit(out_shardings).

    params_hook(params) may replace parameters on the host (weight import) before training.
    Returns (model, optimizer, state, state_shardings).
    """
    model = realm_model(config.model)
    check_lengths(config, model)
    optimizer = make_optimizer(config.train)
    d = config.data
    inputs = init_inputs(d.query_len, d.block_len, joint_len(config))

    def init(rng):
        params = model.init(rng, *inputs)["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
        )

    abstract = jax.eval_shape(init, rng)
    shardings = sharding.logical_shardings(mesh, abstract)
    state = jax.jit(init, out_shardings=shardings)(rng)
    state = nn.meta.unbox(state)
    if params_hook is not None:
        params = params_hook(jax.device_get(state.params))
        params = jax.device_put(params, shardings.params)
        state = state.replace(
            params=params,
            opt_state=jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params),
        )
    return model, optimizer, state, shardings


def abstract_params(config, mesh: Mesh, name: str):
    """(model, ShapeDtypeStructs of params[name] carrying their mesh shardings): the target of
    a partial restore of one network (the refresher's document embedder, `ask`'s query
    embedder), computed without initialising anything."""
    model = realm_model(config.model)
    d = config.data
    inputs = init_inputs(d.query_len, d.block_len, joint_len(config))
    boxed = jax.eval_shape(lambda r: model.init(r, *inputs)["params"], jax.random.key(0))
    shard = sharding.logical_shardings(mesh, boxed)
    return model, checkpoint.abstract_like(nn.meta.unbox(boxed)[name], shard[name])


def joint_len(config) -> int:
    return config.data.query_len + config.data.block_len - 1


# ----------------------------------------------------------------------------- inputs


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


def embed_block_tokens(model, params, tokens, rng=None):
    """Document-embedder output for block token ids [N, Lb] -> [N, D] (segments and mask
    derived from the tokens); dropout when an rng is given."""
    return model.apply(
        {"params": params},
        tokens,
        block_segments(tokens),
        (tokens != 0).astype(jnp.int32),
        method="embed_doc",  # RealmModel's or RetrieverModel's
        **dropout_kwargs(rng, 1),
    )


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


# ----------------------------------------------------------------------------- step


NULL_BLOCK = (CLS_ID, SEP_ID, SEP_ID)  # the release's empty Document: [CLS] title [SEP] body [SEP]


def null_block_tokens(batch: int, length: int):
    """[batch, length] token rows of the null document: `[CLS] [SEP] [SEP]`, zero-padded
    (segments (0, 0, 1) by `block_segments`, as the release's bert_format of ([], []))."""
    row = jnp.zeros((length,), jnp.int32).at[: len(NULL_BLOCK)].set(jnp.array(NULL_BLOCK))
    return jnp.broadcast_to(row, (batch, length))


def retrieve(
    params,
    batch,
    index_emb,
    index_tokens,
    *,
    model: RealmModel,
    mesh: Mesh,
    num_candidates: int,
    num_valid: int,
    rng=None,
):
    """Embed queries, search the index, re-embed the hits with live params.

    Returns (q_emb [B, D], relevance [B, K], candidate tokens [B, K, Lb], retrieved ids
    [B, K-1]). Candidate 0 is the null document, as in the release (example_generator.py
    prepends an empty Document; model.py scores every candidate with one einsum): the empty
    block `[CLS] [SEP] [SEP]` embedded by the live document embedder, so its score and
    gradient are those of any candidate. (A constant score of 0 took all the probability
    whenever an untrained projection scored every retrieved block below 0, and the
    retriever's gradient vanished for good.)
    """
    q_ids = batch["query_ids"]  # [B, Lq]
    q_emb = model.apply(
        {"params": params},
        q_ids,
        jnp.zeros_like(q_ids),
        (q_ids != 0).astype(jnp.int32),
        method=RealmModel.embed_query,
        **dropout_kwargs(rng, 0),
    )  # [B, D]
    k = num_candidates - 1
    _, ids, tokens = retrieval.search_and_fetch(
        mesh,
        jax.lax.stop_gradient(q_emb),
        index_emb,
        index_tokens,
        batch["block_id"],
        k=k,
        num_valid=num_valid,
    )  # ids [B, k], tokens [B, k, Lb]
    B, _, Lb = tokens.shape
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
    d_emb = jnp.concatenate([null_emb[:, None], d_emb], axis=1)  # [B, K, D]
    relevance = jnp.einsum("bd,bkd->bk", q_emb, d_emb)
    cands = jnp.concatenate([null_block_tokens(B, Lb)[:, None].astype(tokens.dtype), tokens], 1)
    return q_emb, relevance, cands, ids


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


def realm_loss(
    params,
    batch,
    index_emb,
    index_tokens,
    *,
    model: RealmModel,
    mesh: Mesh,
    num_candidates: int,
    num_valid: int,
    length: int,
    vocab_chunk: int = 0,
    rng=None,
):
    """REALM's marginal loss for one batch; returns (loss, metrics). Dropout when rng given.

    vocab_chunk: vocabulary rows per step of the fused MLM softmax (losses.fused_marginal_loss;
    0 = the whole vocabulary at once; -1 = materialise the logits, losses.marginal_loss)."""
    _, relevance, cands, ids = retrieve(
        params,
        batch,
        index_emb,
        index_tokens,
        model=model,
        mesh=mesh,
        num_candidates=num_candidates,
        num_valid=num_valid,
        rng=rng,
    )
    features, table, bias = read_candidates(
        model, params, batch["query_ids"], cands, batch["mlm_positions"], length, rng
    )  # features [B, K, P, H]
    targets, weights = batch["mlm_targets"], batch["mlm_weights"]
    if vocab_chunk < 0:  # materialise the [B, K, P, V] logits (the reference path)
        logits = tied_decoder_logits(features, table, bias)
        loss, metrics = losses.marginal_loss(relevance, logits, targets, weights)
    else:
        loss, metrics = losses.fused_marginal_loss(
            relevance, features, table, bias, targets, weights, chunk=vocab_chunk
        )
    metrics["retrieved_ids"] = ids
    return loss, metrics


def train_step(
    state: TrainState,
    batch,
    index_emb,
    index_tokens,
    index_step,
    *,
    model,
    optimizer,
    mesh,
    num_candidates,
    num_valid,
    length,
    vocab_chunk: int = 0,
    seed: int = 0,
):
    """One optimizer step; returns (new state, metrics)."""
    rng = None  # dropout keys depend only on (seed, step): the same on any mesh
    if model.uses_dropout:
        rng = jax.random.fold_in(jax.random.key(seed), state.step)
    loss_fn = functools.partial(
        realm_loss,
        model=model,
        mesh=mesh,
        num_candidates=num_candidates,
        num_valid=num_valid,
        length=length,
        vocab_chunk=vocab_chunk,
        rng=rng,
    )
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, batch, index_emb, index_tokens
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics.pop("retrieved_ids")
    metrics["grad_norm"] = optax.tree.norm(grads)
    for name in grads:
        metrics[f"grad_norm/{name}"] = optax.tree.norm(grads[name])
    metrics["staleness"] = state.step - index_step
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def compile_train_step(config, mesh: Mesh, model, optimizer, state_shardings, num_valid: int):
    """jax.jit of train_step with explicit in/out shardings; the state is donated."""
    fn = functools.partial(
        train_step,
        model=model,
        optimizer=optimizer,
        mesh=mesh,
        num_candidates=config.train.num_candidates,
        num_valid=num_valid,
        length=joint_len(config),
        vocab_chunk=config.train.mlm_vocab_chunk,
        seed=config.train.seed,
    )
    rows = sharding.rows_sharding(mesh)
    return jax.jit(
        fn,
        in_shardings=(
            state_shardings,
            sharding.batch_sharding(mesh),
            rows,
            rows,
            sharding.replicated(mesh),
        ),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )


def compile_loss(config, mesh: Mesh, model, num_valid: int):
    """The forward pass alone (evaluation and tests): (params, batch, emb, tokens) -> metrics."""
    fn = functools.partial(
        realm_loss,
        model=model,
        mesh=mesh,
        num_candidates=config.train.num_candidates,
        num_valid=num_valid,
        length=joint_len(config),
        vocab_chunk=config.train.mlm_vocab_chunk,
    )
    return jax.jit(lambda *a: fn(*a)[1], out_shardings=NamedSharding(mesh, P()))


def embed_blocks_fn(model, mesh: Mesh, batch_size: int):
    """A jitted function embedding every block of a row-sharded token table with live params.

    (params, tokens [N, Lb]) -> embeddings [N, D] sharded like tokens. Used by the in-process
    refresh and the refresh job. Blocks are embedded in chunks of batch_size rows per device.
    """
    rows = sharding.rows_sharding(mesh)

    def embed(params, tokens):
        n_dev = mesh.devices.size
        n = tokens.shape[0]
        per_dev = n // n_dev
        chunk = min(batch_size, per_dev)
        while per_dev % chunk:
            chunk -= 1
        t = tokens.reshape(n_dev, per_dev // chunk, chunk, -1).transpose(1, 0, 2, 3)

        def one(_, tc):  # tc [n_dev, chunk, Lb]
            flat = tc.reshape(n_dev * chunk, -1)
            flat = jax.lax.with_sharding_constraint(flat, rows)
            e = embed_block_tokens(model, params, flat)
            return None, e.reshape(n_dev, chunk, -1)

        _, out = jax.lax.scan(one, None, t)  # [steps, n_dev, chunk, D]
        return out.transpose(1, 0, 2, 3).reshape(n, -1)

    return jax.jit(embed, out_shardings=rows)


def pad_index(emb: np.ndarray | None, tokens: np.ndarray, mesh: Mesh):
    """(embeddings [N, D] float32 or None, tokens [N, Lb] int32) padded with zero rows so
    every device holds the same number; padded rows are never retrieved (num_valid)."""
    tok = sharding.pad_rows(np.asarray(tokens, np.int32), mesh)
    return (None if emb is None else sharding.pad_rows(np.asarray(emb, np.float32), mesh)), tok
