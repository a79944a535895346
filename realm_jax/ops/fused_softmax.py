"""REALM's marginal MLM loss over candidates with a fused, vocabulary-chunked softmax.

REALM scores every masked position against every candidate: B*K*P rows of vocab-sized
logits, 39 MB in float32 at the smoke size (8 x 4 x 10 rows) and 5 GB at REALM's batch 512,
K 8, P 10 (spread over the devices), plus as much again for their log-softmax and gradient.
`fused_marginal_loss` never holds them. It walks the vocabulary `chunk` rows at a time, twice:
  pass 1: the log-normaliser lse [N] of every row (running max and sum, flash-style);
  pass 2: each chunk's softmax p = exp(logits - lse), which gives both the accuracy metric
          (argmax over v of the marginal sum_k p(z_k|x) p(v|x,z_k)) and, when differentiating,
          the whole gradient: d loss / d logit[n, v] = c_n (p[n, v] - [v == y_n]) with
          c_n = (w / num_targets) p(z_k | x, y), the candidate's posterior given the target.
Because the loss is the root of differentiation, its gradient can be formed in the forward
pass (pass 2) and scaled by the incoming cotangent in the backward pass: the logits are
computed twice in all, where autodiff of pass 1 plus a separate argmax pass took three
(benchmarks/train_throughput.py compares against materialising; train.mlm_vocab_chunk=-1).

On a mesh (`mesh=`) the loss runs under shard_map as the design asks (../shared/DESIGN.md
"What each program should communicate"; Megatron-LM's vocabulary-parallel cross-entropy):
rows stay on their data shard, batch-major (each example's K candidates together), and the
vocabulary is split over `model`: each shard walks its own rows of the word-embedding table and
the shards combine only per-row figures: the running max and sum-exp (pass 1), the target
logit, the argmax and the features' gradient (all-reduces over `model` of B x K x P floats, and
of B x K x P x H for the gradient, as a tensor-parallel layer's). The table is never gathered
and nothing is all-to-all'd (tests/integration/test_comms.py reads that from the compiled HLO).
The table's and bias's gradients are summed over `data` inside the loss: their share of the
gradient reduction. A vocabulary that `model` does not divide (BERT's 30,522 on 4) leaves the
parameter replicated (sharding.divisible_spec), and the loss with it: each model shard then
walks the whole vocabulary for its data shard's rows, redundantly but with no table moving
(splitting it would all-gather the table's gradient, V x H a step, to match the parameter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Array = jax.Array


def marginal_metrics(log_pz, log_py, predicted, targets, weights):
    """(loss, metrics) from log p(z|x) [B, K], log p(y_j|x,z) [B, K, P] and the argmax of the
    marginal over the vocabulary [B, P]."""
    weights = weights.astype(jnp.float32)
    num_targets = jnp.maximum(weights.sum(), 1.0)
    marginal = jax.nn.logsumexp(log_pz[:, :, None] + log_py, axis=1)  # [B, P]
    loss = -(marginal * weights).sum() / num_targets
    correct = (predicted == targets).astype(jnp.float32)
    null_log_py = log_py[:, 0]  # the null document's log p(y | x, null) [B, P]
    pz = jnp.exp(log_pz)
    metrics = {
        "loss": loss,
        "accuracy": (correct * weights).sum() / num_targets,
        # REALM release: log p(y|x) minus log p(y|x, null document), per target.
        "retrieval_utility": ((marginal - null_log_py) * weights).sum() / num_targets,
        "retrieval_entropy": -(pz * log_pz).sum(-1).mean(),
        "null_doc_prob": pz[:, 0].mean(),
        "num_targets": weights.sum(),
    }
    return loss, metrics


def _vocab_chunk(table: Array, bias: Array, i: Array, c: int):
    """Chunk i of the vocabulary: (table rows [c, H], bias [c], mask [c], first row).

    The last chunk is shifted back to end at row V, so no copy of the table is ever padded;
    `mask` is False on the rows an earlier chunk already covered."""
    v = table.shape[0]
    start = jnp.minimum(i * c, v - c)
    rows = jax.lax.dynamic_slice_in_dim(table, start, c)
    b = jax.lax.dynamic_slice_in_dim(bias, start, c).astype(jnp.float32)
    return rows, b, start + jnp.arange(c) >= i * c, start


def _num_chunks(v: int, chunk: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks); chunk <= 0 means the whole vocabulary."""
    c = v if chunk <= 0 else min(chunk, v)
    return c, -(-v // c)


def _chunk_logits(h_t: Array, rows: Array, b: Array, mask: Array) -> Array:
    """Transposed logits [c, N] of one chunk from h_t [H, N]. Vocabulary-major, so every
    matmul of both passes reads its operands in row-major order: on XLA:CPU the transposed
    operand of N-major layouts ran at a third of the speed (measured, c = 2048, H = 64)."""
    logits = jnp.einsum(
        "vh,hn->vn", rows.astype(h_t.dtype), h_t, preferred_element_type=jnp.float32
    )
    return jnp.where(mask[:, None], logits + b[:, None], -jnp.inf)


def _unchunk(stacked: Array, v: int) -> Array:
    """Per-chunk rows [n, c, ...] -> [v, ...], dropping the rows the shifted last chunk
    repeats."""
    n, c = stacked.shape[:2]
    head = stacked[: n - 1].reshape((n - 1) * c, *stacked.shape[2:])
    return jnp.concatenate([head, stacked[n - 1, n * c - v :]], axis=0)


def _max_and_sumexp(h: Array, table: Array, bias: Array, chunk: int):
    """(max [N], sum of exp(logit - max) [N]) over this table's rows, float32."""
    c, n = _num_chunks(table.shape[0], chunk)
    h_t = h.T

    def body(carry, i):
        m, s = carry
        rows, b, mask, _ = _vocab_chunk(table, bias, i, c)
        logits = _chunk_logits(h_t, rows, b, mask)  # [c, N]
        m_new = jnp.maximum(m, logits.max(0))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new).sum(0)
        return (m_new, s), None

    rows = h.shape[0]
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    return jax.lax.scan(body, init, jnp.arange(n))[0]


def vocab_logsumexp(h: Array, table: Array, bias: Array, chunk: int) -> Array:
    """logsumexp_v(h @ table.T + bias) for h [N, H], table [V, H], bias [V] -> [N] float32,
    walking the vocabulary `chunk` rows at a time (chunk <= 0: all at once)."""
    m, s = _max_and_sumexp(h, table, bias, chunk)
    return m + jnp.log(s)


def _softmax_pass(h, table, bias, lse, pz, coef, tgt, chunk):
    """Pass 2 over this table's rows. h [N, H] with rows batch-major, N = B * K * P (row
    (b * K + k) * P + p is candidate k of position p of example b); lse [N]; pz [B, K],
    p(z_k | x); tgt [N], each row's target as a row of this table (out of range: elsewhere).

    Returns (the best marginal sum_k pz p(v | x, z_k) [B * P] and its row here [B * P] int32,
    and with coef [N] given, the gradient of the loss: sum_v coef (p[:, v] - [v == tgt])
    table[v] [N, H], and per table row sum_n coef (p[n, v] - [v == tgt_n]) h[n] [V, H] and
    its sum over n [V], all float32)."""
    c, n = _num_chunks(table.shape[0], chunk)
    B, K = pz.shape
    N, H = h.shape
    Pn = N // (B * K)
    f32 = jnp.float32
    h_t, table_t = h.T, table.T  # [H, N], [H, V]

    def body(carry, i):
        best, arg, dh_t = carry
        rows, b, mask, start = _vocab_chunk(table, bias, i, c)
        p = jnp.exp(_chunk_logits(h_t, rows, b, mask) - lse)  # [c, N]; 0 where masked
        marginal = jnp.einsum("cbkp,bk->cbp", p.reshape(c, B, K, Pn), pz).reshape(c, B * Pn)
        top = marginal.max(0)
        arg = jnp.where(top > best, marginal.argmax(0).astype(jnp.int32) + start, arg)
        best = jnp.maximum(best, top)
        if coef is None:
            return (best, arg, dh_t), None
        hit = ((start + jnp.arange(c))[:, None] == tgt[None, :]) & mask[:, None]  # [c, N]
        g = ((p - hit) * coef).astype(h.dtype)  # [c, N]
        rows_t = jax.lax.dynamic_slice_in_dim(table_t, start, c, axis=1).astype(h.dtype)
        dh_t = dh_t + jnp.einsum("hv,vn->hn", rows_t, g, preferred_element_type=f32)
        dt = jnp.einsum("vn,nh->vh", g, h, preferred_element_type=f32)  # [c, H]
        return (best, arg, dh_t), (dt, g.astype(f32).sum(1))

    init = (
        jnp.full((B * Pn,), -jnp.inf, f32),
        jnp.zeros((B * Pn,), jnp.int32),
        jnp.zeros((H, N), f32) if coef is not None else jnp.zeros((), f32),
    )
    (best, arg, dh_t), per_chunk = jax.lax.scan(body, init, jnp.arange(n))
    if coef is None:
        return best, arg, None
    v = table.shape[0]
    return best, arg, (dh_t.T, _unchunk(per_chunk[0], v), _unchunk(per_chunk[1], v))


def _psum(x, axis):
    return x if axis is None else jax.lax.psum(x, axis)


def _shard_forward(
    log_pz, features, table, bias, targets, weights, *, chunk, with_grad, data, model
):
    """The loss on one shard: the examples of a data shard, the vocabulary rows of a model
    shard (data/model: the mesh axes' names under shard_map, None on one device).

    Returns ((loss, log p(y|x,z) [B, K, P], predicted [B, P]), and with_grad the gradient of
    the loss with respect to (log_pz, features, this shard's table rows, its bias))."""
    B, K, P_, H = features.shape
    f32 = jnp.float32
    v_here = table.shape[0]
    offset = 0 if model is None else jax.lax.axis_index(model) * v_here
    h = features.reshape(B * K * P_, H)  # batch-major rows [N, H]
    m, s = _max_and_sumexp(h, table, bias, chunk)  # [N]
    if model is not None:  # combine the shards' running max and sum (flash-style)
        m_all = jax.lax.pmax(m, model)
        s, m = jax.lax.psum(s * jnp.exp(m - m_all), model), m_all
    lse = m + jnp.log(s)  # [N]
    local_tgt = targets - offset  # [B, P]
    here = (local_tgt >= 0) & (local_tgt < v_here)
    safe = jnp.clip(local_tgt, 0, v_here - 1)
    tgt_logits = jnp.einsum(
        "bkph,bph->bkp", features, table[safe].astype(features.dtype), preferred_element_type=f32
    ) + bias[safe][:, None].astype(f32)
    tgt_logits = _psum(jnp.where(here[:, None], tgt_logits, 0.0), model)  # [B, K, P]
    log_py = tgt_logits - lse.reshape(B, K, P_)
    joint = log_pz[:, :, None] + log_py  # [B, K, P]
    marginal = jax.nn.logsumexp(joint, axis=1)  # [B, P]
    w = weights.astype(f32) / jnp.maximum(_psum(weights.astype(f32).sum(), data), 1.0)
    loss = _psum(-(marginal * w).sum(), data)
    # d loss / d logit[b,k,p,v] = coef[b,k,p] (softmax[v] - [v == target]).
    coef = jnp.exp(joint - marginal[:, None]) * w[:, None] if with_grad else None  # [B, K, P]
    tgt_rows = jnp.broadcast_to(local_tgt[:, None], (B, K, P_)).reshape(-1)  # [N]
    best, arg, grads = _softmax_pass(
        h,
        table,
        bias,
        lse,
        jnp.exp(log_pz),
        None if coef is None else coef.reshape(-1),
        tgt_rows,
        chunk,
    )
    arg = arg + offset
    if model is not None:  # the best row over the shards; ties go to the lowest id
        top = jax.lax.pmax(best, model)
        arg = jax.lax.pmin(jnp.where(best >= top, arg, jnp.iinfo(jnp.int32).max), model)
    out = (loss, log_py, arg.reshape(B, P_))
    if not with_grad:
        return out, None
    dh, dtable, dbias = grads
    dh = _psum(dh, model).reshape(B, K, P_, H).astype(features.dtype)
    dlog_pz = -coef.sum(-1)  # d loss / d log p(z|x) [B, K]
    dtable, dbias = _psum(dtable, data), _psum(dbias, data)  # the table's gradient reduction
    return out, (dlog_pz, dh, dtable.astype(table.dtype), dbias.astype(bias.dtype))


def _mesh_axes(mesh):
    """(data axis, model axis) of a mesh, each None when absent or of size 1; (None, None)
    without a mesh."""
    if mesh is None:
        return None, None
    size = dict(mesh.shape)
    return tuple(a if size.get(a, 1) > 1 else None for a in ("data", "model"))


def _fused_forward(log_pz, features, table, bias, targets, weights, chunk, mesh, with_grad):
    """`_shard_forward` on one device, or under shard_map over the mesh's data and model
    axes (the vocabulary split over `model` when it divides it)."""
    data, model = _mesh_axes(mesh)
    fn = functools.partial(_shard_forward, chunk=chunk, with_grad=with_grad)
    if data is None and model is None:
        return fn(log_pz, features, table, bias, targets, weights, data=None, model=None)
    if model is not None and table.shape[0] % mesh.shape[model]:
        model = None  # the parameter is replicated (divisible_spec): so is the loss's work
        fn = functools.partial(_shard_forward, chunk=chunk, with_grad=with_grad)
    rows, vocab = P(data), P(model)
    grads_spec = (rows, rows, vocab, vocab) if with_grad else None
    out, grads = jax.shard_map(
        functools.partial(fn, data=data, model=model),
        mesh=mesh,
        in_specs=(rows, rows, vocab, vocab, rows, rows),
        out_specs=((P(), rows, rows), grads_spec),
        check_vma=False,
    )(log_pz, features, table, bias, targets, weights)
    return out, grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fused_mlm(log_pz, features, table, bias, targets, weights, chunk, mesh):
    return _fused_forward(log_pz, features, table, bias, targets, weights, chunk, mesh, False)[0]


def _fused_mlm_fwd(log_pz, features, table, bias, targets, weights, chunk, mesh):
    out, grads = _fused_forward(log_pz, features, table, bias, targets, weights, chunk, mesh, True)
    return out, (grads, weights)


def _fused_mlm_bwd(chunk, mesh, residuals, cotangents):
    """Only the loss is differentiable: log_py and predicted are metrics (the caller stops
    their gradients), so their cotangents are zero."""
    grads, weights = residuals
    g = cotangents[0]
    return (*(x * g.astype(x.dtype) for x in grads), None, jnp.zeros_like(weights))


_fused_mlm.defvjp(_fused_mlm_fwd, _fused_mlm_bwd)


def fused_marginal_loss(
    relevance: Array,
    features: Array,
    table: Array,
    bias: Array,
    targets: Array,
    weights: Array,
    chunk: int,
    mesh=None,
):
    """`marginal_loss` from the tied decoder's inputs instead of logits.

    features [B, K, P, H] (Reader.mlm_features), table [V, H] (word embeddings), bias [V];
    logits would be features @ table.T + bias. Same loss, gradients and metrics as
    `marginal_loss` on those logits (tested), without materialising [B, K, P, V]. With a
    mesh: data-parallel over its `data` axis, vocabulary-parallel over `model` (module doc).
    """
    log_pz = jax.nn.log_softmax(relevance.astype(jnp.float32), axis=-1)
    loss, log_py, predicted = _fused_mlm(
        log_pz, features, table, bias, targets, weights, chunk, mesh
    )
    sg = jax.lax.stop_gradient
    _, metrics = marginal_metrics(sg(log_pz), sg(log_py), sg(predicted), targets, weights)
    metrics["loss"] = loss
    return loss, metrics
