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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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


def vocab_logsumexp(h: Array, table: Array, bias: Array, chunk: int) -> Array:
    """logsumexp_v(h @ table.T + bias) for h [N, H], table [V, H], bias [V] -> [N] float32,
    walking the vocabulary `chunk` rows at a time (chunk <= 0: all at once). Pass 1 of
    fused_marginal_loss, which differentiates the loss as a whole rather than through this."""
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
    (m, s), _ = jax.lax.scan(body, init, jnp.arange(n))
    return m + jnp.log(s)


def _softmax_pass(h, table, bias, lse, pz, coef, chunk):
    """Pass 2 over the vocabulary. h [N, H] with rows candidate-major, N = K * M for M = B * P
    (row k * M + m is candidate k of position m); lse [N]; pz [K, M], p(z_k | x) per row.

    Returns (argmax over the vocabulary of the marginal sum_k pz p(v | x, z_k), [M] int32,
    and with coef [N] given, the softmax part of the gradient: sum_v coef p[:, v] table[v]
    [N, H], and per vocabulary row sum_n coef p[n, v] h[n] [V, H] and sum_n coef p[n, v] [V],
    all float32)."""
    c, n = _num_chunks(table.shape[0], chunk)
    K, M = pz.shape
    N, H = h.shape
    f32 = jnp.float32
    h_t, table_t = h.T, table.T  # [H, N], [H, V]

    def body(carry, i):
        best, arg, dh_t = carry
        rows, b, mask, start = _vocab_chunk(table, bias, i, c)
        p = jnp.exp(_chunk_logits(h_t, rows, b, mask) - lse)  # [c, N]; 0 where masked
        # The marginal over candidates: K contiguous [c, M] slabs, weighted and added.
        marginal = sum(p[:, k * M : (k + 1) * M] * pz[k] for k in range(K))  # [c, M]
        top = marginal.max(0)
        arg = jnp.where(top > best, marginal.argmax(0).astype(jnp.int32) + start, arg)
        best = jnp.maximum(best, top)
        if coef is None:
            return (best, arg, dh_t), None
        g = (p * coef).astype(h.dtype)  # [c, N]
        rows_t = jax.lax.dynamic_slice_in_dim(table_t, start, c, axis=1).astype(h.dtype)
        dh_t = dh_t + jnp.einsum("hv,vn->hn", rows_t, g, preferred_element_type=f32)
        dt = jnp.einsum("vn,nh->vh", g, h, preferred_element_type=f32)  # [c, H]
        return (best, arg, dh_t), (dt, g.astype(f32).sum(1))

    init = (
        jnp.full((M,), -jnp.inf, f32),
        jnp.zeros((M,), jnp.int32),
        jnp.zeros((H, N), f32) if coef is not None else jnp.zeros((), f32),
    )
    (_, arg, dh_t), per_chunk = jax.lax.scan(body, init, jnp.arange(n))
    if coef is None:
        return arg, None
    v = table.shape[0]
    return arg, (dh_t.T, _unchunk(per_chunk[0], v), _unchunk(per_chunk[1], v))


def _fused_forward(log_pz, features, table, bias, targets, weights, chunk, with_grad):
    """(loss, log p(y|x,z) [B, K, P], predicted [B, P]) and, with_grad, the gradient of the
    loss with respect to (log_pz, features, table, bias)."""
    B, K, P, H = features.shape
    f32 = jnp.float32

    def rows_first(x):  # [B, K, P, ...] -> candidate-major rows [K * B * P, ...]
        return jnp.swapaxes(x, 0, 1).reshape(K * B * P, *x.shape[3:])

    h = rows_first(features)  # [N, H]
    lse_rows = vocab_logsumexp(h, table, bias, chunk)  # [N]
    lse = jnp.swapaxes(lse_rows.reshape(K, B, P), 0, 1)  # [B, K, P]
    tgt_rows = table[targets].astype(features.dtype)  # [B, P, H]
    target_logits = jnp.einsum(
        "bkph,bph->bkp", features, tgt_rows, preferred_element_type=f32
    ) + bias[targets][:, None].astype(f32)
    log_py = target_logits - lse  # [B, K, P]
    joint = log_pz[:, :, None] + log_py  # [B, K, P]
    marginal = jax.nn.logsumexp(joint, axis=1)  # [B, P]
    w = weights.astype(f32) / jnp.maximum(weights.astype(f32).sum(), 1.0)
    loss = -(marginal * w).sum()
    # d loss / d logit[b,k,p,v] = coef[b,k,p] (softmax[v] - [v == target]).
    coef = jnp.exp(joint - marginal[:, None]) * w[:, None] if with_grad else None  # [B, K, P]
    pz = jnp.broadcast_to(jnp.exp(log_pz).T[:, :, None], (K, B, P)).reshape(K, B * P)
    c = None if coef is None else rows_first(coef)  # [N]
    predicted, soft = _softmax_pass(h, table, bias, lse_rows, pz, c, chunk)
    predicted = predicted.reshape(B, P)
    if not with_grad:
        return (loss, log_py, predicted), None
    dh, dtable, dbias = soft
    # The [v == target] part of the gradient, on the target rows.
    dh = dh - c[:, None] * rows_first(jnp.broadcast_to(tgt_rows[:, None], features.shape))
    flat_tgt = rows_first(jnp.broadcast_to(targets[:, None], (B, K, P)))  # [N]
    dtable = dtable.at[flat_tgt].add(-c[:, None] * h.astype(f32))
    dbias = dbias.at[flat_tgt].add(-c)
    dh = jnp.swapaxes(dh.reshape(K, B, P, H), 0, 1).astype(features.dtype)
    dlog_pz = -coef.sum(-1)  # d loss / d log p(z|x) [B, K]
    return (loss, log_py, predicted), (
        dlog_pz,
        dh,
        dtable.astype(table.dtype),
        dbias.astype(bias.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused_mlm(log_pz, features, table, bias, targets, weights, chunk):
    return _fused_forward(log_pz, features, table, bias, targets, weights, chunk, False)[0]


def _fused_mlm_fwd(log_pz, features, table, bias, targets, weights, chunk):
    out, grads = _fused_forward(log_pz, features, table, bias, targets, weights, chunk, True)
    return out, (grads, weights)


def _fused_mlm_bwd(chunk, residuals, cotangents):
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
):
    """`marginal_loss` from the tied decoder's inputs instead of logits.

    features [B, K, P, H] (Reader.mlm_features), table [V, H] (word embeddings), bias [V];
    logits would be features @ table.T + bias. Same loss, gradients and metrics as
    `marginal_loss` on those logits (tested), without materialising [B, K, P, V].
    """
    log_pz = jax.nn.log_softmax(relevance.astype(jnp.float32), axis=-1)
    loss, log_py, predicted = _fused_mlm(log_pz, features, table, bias, targets, weights, chunk)
    sg = jax.lax.stop_gradient
    _, metrics = marginal_metrics(sg(log_pz), sg(log_py), sg(predicted), targets, weights)
    metrics["loss"] = loss
    return loss, metrics
