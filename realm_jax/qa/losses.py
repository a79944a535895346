"""ORQA's fine-tuning losses: the retriever's and the reader's marginal log-likelihoods."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


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
