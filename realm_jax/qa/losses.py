"""ORQA's fine-tuning losses (language/orqa/models/orqa_model.py compute_loss): the
retriever's and the reader's marginal log-likelihoods, each counted only when something is
correct."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def marginal_log_loss(logits: Array, is_correct: Array) -> Array:
    """-log sum_{correct} p over the last axis; 0 where nothing is correct (as in ORQA).

    ORQA masks with a -10000 score; a float32 minimum is the same function without the
    (tiny) leak of probability to incorrect entries."""
    logits = logits.astype(jnp.float32)
    neg = jnp.finfo(jnp.float32).min
    num = jax.nn.logsumexp(jnp.where(is_correct, logits, neg), axis=-1)
    den = jax.nn.logsumexp(logits, axis=-1)
    return jnp.where(is_correct.any(-1), den - num, 0.0)


def correct_spans(starts: Array, ends: Array, gold_starts: Array, gold_ends: Array) -> Array:
    """starts/ends [S], gold [K, A] (-1 padded) -> [K, S] True where a span equals some gold
    span (ORQA compute_correct_candidates)."""
    hit = (starts[None, None, :] == gold_starts[..., None]) & (
        ends[None, None, :] == gold_ends[..., None]
    )
    return hit.any(axis=1)


def orqa_loss(retriever_logits, retriever_correct, span_logits, span_correct, relevance):
    """ORQA's loss, batched over any leading dims.

    retriever_logits / retriever_correct [..., k]: every retrieved block (the retriever beam);
    span_logits / span_correct [..., R, S]: the reader's spans of the top R blocks, whose
    retrieval scores `relevance` [..., R] are added to their spans' scores (ORQA's reader
    logits). Returns (total, retriever loss, reader loss), each [...]."""
    retriever = marginal_log_loss(retriever_logits, retriever_correct)
    joint = span_logits.astype(jnp.float32) + relevance[..., None].astype(jnp.float32)
    flat = joint.shape[:-2] + (-1,)
    reader = marginal_log_loss(joint.reshape(flat), span_correct.reshape(flat))
    return retriever + reader, retriever, reader


def orqa_losses(relevance, span_logits, starts, ends, gold_starts, gold_ends, has_answers):
    """ORQA/REALM fine-tuning losses for one question over K blocks, from gold span lists
    (the form HuggingFace's RealmReader takes: the parity test's reference).

    relevance [K], span_logits [K, S], starts/ends [S], gold_* [K, A], has_answers [K].
    Returns (total, retriever_loss, reader_loss)."""
    correct = correct_spans(starts, ends, gold_starts, gold_ends)
    return orqa_loss(relevance, has_answers, span_logits, correct, relevance)
