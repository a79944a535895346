"""REALM's marginal likelihood, its metrics, and the ORQA reader losses.

The pre-training loss follows the REALM release: per masked position j,
    log p(y_j | x) = logsumexp_z [ log p(z | x) + log p(y_j | x, z) ],
averaged over the real targets and negated. Candidate 0 is the null document.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


def marginal_loss(relevance: Array, mlm_logits: Array, targets: Array, weights: Array):
    """REALM marginal loss and metrics from materialised logits (the readable definition;
    training uses `fused_marginal_loss`, which gives the same values without the logits).

    relevance [B, K] (candidate 0 = null doc), mlm_logits [B, K, P, V], targets [B, P],
    weights [B, P] (1 for real targets). Returns (loss, metrics dict of scalars).
    """
    log_pz = jax.nn.log_softmax(relevance.astype(jnp.float32), axis=-1)  # [B, K]
    # One log-softmax over the vocabulary serves the loss and the accuracy metric.
    log_p_vocab = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), axis=-1)  # [B, K, P, V]
    tgt = jnp.broadcast_to(targets[:, None, :, None], mlm_logits.shape[:-1] + (1,))
    log_py = jnp.take_along_axis(log_p_vocab, tgt, axis=-1)[..., 0]  # [B, K, P]
    # Prediction = argmax of the marginal distribution over the vocabulary (no gradient).
    marginal_vocab = jax.nn.logsumexp(
        jax.lax.stop_gradient(log_pz[:, :, None, None] + log_p_vocab), axis=1
    )  # [B, P, V]
    return _marginal_metrics(log_pz, log_py, jnp.argmax(marginal_vocab, axis=-1), targets, weights)


def _marginal_metrics(log_pz, log_py, predicted, targets, weights):
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


# ----------------------------------------------------------------------------- fused MLM softmax
#
# REALM scores every masked position against every candidate: B*K*P rows of vocab-sized
# logits, 39 MB in float32 at the smoke size (8 x 4 x 10 rows) and 5 GB at REALM's batch 512,
# K 8, P 10 (spread over the devices), plus as much again for their log-softmax and gradient.
# The functions below never hold them: the vocabulary is walked `chunk` rows at a time with a
# running max/sum for the log-normaliser, and the backward pass recomputes each chunk's logits
# (as flash attention does for its scores). The accuracy metric's marginal argmax is a second
# chunked pass. The point is memory; on XLA:CPU it is also faster than materialising
# (bench/train_throughput.py, the -dense-mlm rows; train.mlm_vocab_chunk=-1 selects that path).


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


def _chunk_logits(h: Array, rows: Array, b: Array, mask: Array) -> Array:
    logits = jnp.einsum("nh,vh->nv", h, rows.astype(h.dtype), preferred_element_type=jnp.float32)
    return jnp.where(mask, logits + b, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def vocab_logsumexp(h: Array, table: Array, bias: Array, chunk: int) -> Array:
    """logsumexp_v(h @ table.T + bias) for h [N, H], table [V, H], bias [V] -> [N] float32,
    walking the vocabulary `chunk` rows at a time (chunk <= 0: all at once)."""
    return _lse_fwd(h, table, bias, chunk)[0]


def _lse_fwd(h, table, bias, chunk):
    c, n = _num_chunks(table.shape[0], chunk)

    def body(carry, i):
        m, s = carry
        rows, b, mask, _ = _vocab_chunk(table, bias, i, c)
        logits = _chunk_logits(h, rows, b, mask)
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
        return (m_new, s), None

    rows = h.shape[0]
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    (m, s), _ = jax.lax.scan(body, init, jnp.arange(n))
    lse = m + jnp.log(s)
    return lse, (h, table, bias, lse)


def _lse_bwd(chunk, residuals, g):
    h, table, bias, lse = residuals
    c, n = _num_chunks(table.shape[0], chunk)
    f32 = jnp.float32

    def body(carry, i):
        dh, dt, db = carry
        rows, b, mask, start = _vocab_chunk(table, bias, i, c)
        p = jnp.exp(_chunk_logits(h, rows, b, mask) - lse[:, None]) * g[:, None]  # [N, c]
        pc = p.astype(h.dtype)
        dh = dh + jnp.einsum("nv,vh->nh", pc, rows.astype(h.dtype), preferred_element_type=f32)
        # Masked (already covered) rows have p = 0, so adding over the overlap is exact.
        dt_rows = jnp.einsum("nv,nh->vh", pc, h, preferred_element_type=f32)
        dt = jax.lax.dynamic_update_slice_in_dim(
            dt, jax.lax.dynamic_slice_in_dim(dt, start, c) + dt_rows, start, 0
        )
        db = jax.lax.dynamic_update_slice_in_dim(
            db, jax.lax.dynamic_slice_in_dim(db, start, c) + p.sum(0), start, 0
        )
        return (dh, dt, db), None

    init = (jnp.zeros(h.shape, f32), jnp.zeros(table.shape, f32), jnp.zeros(bias.shape, f32))
    (dh, dt, db), _ = jax.lax.scan(body, init, jnp.arange(n))
    return dh.astype(h.dtype), dt.astype(table.dtype), db.astype(bias.dtype)


vocab_logsumexp.defvjp(_lse_fwd, _lse_bwd)


def _marginal_argmax(h: Array, table: Array, bias: Array, offset: Array, chunk: int) -> Array:
    """argmax_v logsumexp_k(offset[b,k,p] + h[b,k,p] . table[v] + bias[v]) -> [B, P] int32,
    in vocabulary chunks (forward only: a metric)."""
    c, n = _num_chunks(table.shape[0], chunk)
    B, K, P, H = h.shape
    flat = h.reshape(-1, H)

    def body(carry, i):
        best, arg = carry
        rows, b, mask, start = _vocab_chunk(table, bias, i, c)
        logits = _chunk_logits(flat, rows, b, mask).reshape(B, K, P, c) + offset[..., None]
        marginal = jax.nn.logsumexp(logits, axis=1)  # [B, P, c]
        top = marginal.max(-1)
        better = top > best
        arg = jnp.where(better, marginal.argmax(-1).astype(jnp.int32) + start, arg)
        return (jnp.maximum(best, top), arg), None

    init = (jnp.full((B, P), -jnp.inf, jnp.float32), jnp.zeros((B, P), jnp.int32))
    (_, arg), _ = jax.lax.scan(body, init, jnp.arange(n))
    return arg


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
    B, K, P, H = features.shape
    lse = vocab_logsumexp(features.reshape(-1, H), table, bias, chunk).reshape(B, K, P)
    target_logits = jnp.einsum(
        "bkph,bph->bkp",
        features,
        table[targets].astype(features.dtype),
        preferred_element_type=jnp.float32,
    ) + bias[targets][:, None].astype(jnp.float32)
    log_py = target_logits - lse  # [B, K, P]
    log_pz = jax.nn.log_softmax(relevance.astype(jnp.float32), axis=-1)
    sg = jax.lax.stop_gradient
    predicted = _marginal_argmax(
        sg(features), sg(table), sg(bias), sg(log_pz[:, :, None] - lse), chunk
    )
    return _marginal_metrics(log_pz, log_py, predicted, targets, weights)


def _marginal_log_loss(logits: Array, is_correct: Array) -> Array:
    """-log sum_{correct} p; 0 where nothing is correct (as in ORQA)."""
    logits = logits.astype(jnp.float32)
    neg = jnp.finfo(jnp.float32).min
    num = jax.nn.logsumexp(jnp.where(is_correct, logits, neg), axis=-1)
    den = jax.nn.logsumexp(logits, axis=-1)
    return jnp.where(is_correct.any(-1), den - num, 0.0)


def correct_spans(starts: Array, ends: Array, gold_starts: Array, gold_ends: Array) -> Array:
    """starts/ends [S], gold [K, A] -> [K, S] True where a span equals some gold span."""
    hit = (starts[None, None, :] == gold_starts[..., None]) & (
        ends[None, None, :] == gold_ends[..., None]
    )
    return hit.any(axis=1)


def orqa_losses(relevance, span_logits, starts, ends, gold_starts, gold_ends, has_answers):
    """ORQA/REALM fine-tuning losses for one question over K blocks.

    relevance [K], span_logits [K, S], starts/ends [S], gold_* [K, A], has_answers [K].
    Returns (total, retriever_loss, reader_loss).
    """
    retriever = _marginal_log_loss(relevance, has_answers)
    correct = correct_spans(starts, ends, gold_starts, gold_ends)
    # As in ORQA, a span's score is its block's retrieval score plus the reader's span score.
    joint = span_logits + relevance[:, None].astype(jnp.float32)
    reader = _marginal_log_loss(joint.reshape(-1), correct.reshape(-1))
    return retriever + reader, retriever, reader
