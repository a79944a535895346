"""REALM's marginal likelihood, its metrics, and the ORQA reader losses.

The pre-training loss follows the REALM release: per masked position j,
    log p(y_j | x) = logsumexp_z [ log p(z | x) + log p(y_j | x, z) ],
averaged over the real targets and negated. Candidate 0 is the null document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def marginal_loss(relevance: Array, mlm_logits: Array, targets: Array, weights: Array):
    """REALM marginal loss and metrics.

    relevance [B, K] (candidate 0 = null doc), mlm_logits [B, K, P, V], targets [B, P],
    weights [B, P] (1 for real targets). Returns (loss, metrics dict of scalars).
    """
    weights = weights.astype(jnp.float32)
    num_targets = jnp.maximum(weights.sum(), 1.0)
    log_pz = jax.nn.log_softmax(relevance.astype(jnp.float32), axis=-1)  # [B, K]
    # One log-softmax over the vocabulary serves the loss and the accuracy metric.
    log_p_vocab = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), axis=-1)  # [B, K, P, V]
    tgt = jnp.broadcast_to(targets[:, None, :, None], mlm_logits.shape[:-1] + (1,))
    log_py = jnp.take_along_axis(log_p_vocab, tgt, axis=-1)[..., 0]  # [B, K, P]
    marginal = jax.nn.logsumexp(log_pz[:, :, None] + log_py, axis=1)  # [B, P]
    loss = -(marginal * weights).sum() / num_targets

    # Prediction = argmax of the marginal distribution over the vocabulary (no gradient).
    marginal_vocab = jax.nn.logsumexp(
        jax.lax.stop_gradient(log_pz[:, :, None, None] + log_p_vocab), axis=1
    )  # [B, P, V]
    correct = (jnp.argmax(marginal_vocab, axis=-1) == targets).astype(jnp.float32)
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
