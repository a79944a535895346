"""What the REALM train step measures beside its loss: whether the candidates hold the masked
span or the own document (coverage), and what REALM's gradient asks of the retriever
(realm_signal). Metrics only: nothing here is differentiated."""

from __future__ import annotations

import jax.numpy as jnp


def block_holds_targets(cands, targets, weights):
    """[B, K] bool: candidate block k holds every masked wordpiece of query b (as a bag of
    wordpieces, title included). The null document (k = 0) and queries without masks never."""
    member = (cands[:, :, None, :] == targets[:, None, :, None]).any(-1)  # [B, K, P]
    holds = (member | (weights[:, None, :] == 0)).all(-1) & (weights.sum(-1) > 0)[:, None]
    return holds.at[:, 0].set(False)


def coverage(cands, ids, targets, weights, gold=None, dense: int | None = None) -> dict:
    """The share of masked queries whose retrieved candidates hold the masked span (every
    masked wordpiece, block_holds_targets), and with `gold` [B] (the own document's block,
    -1 none: a separate text's sentences) the share of those that have it among them; over
    all candidates and, with `dense` (the dense top-k's count), over the dense ones alone.
    cands [B, K, Lb] (0: the null document), ids [B, K-1] (-1: an empty slot)."""
    holds = block_holds_targets(cands, targets, weights)[:, 1:] & (ids >= 0)  # [B, K-1]
    masked = (weights.sum(-1) > 0).astype(jnp.float32)
    parts = {"": holds.shape[1]} if dense is None else {"": holds.shape[1], "_dense": dense}
    out = {}
    for tag, n in parts.items():
        span = holds[:, :n].any(1).astype(jnp.float32)
        out[f"span_in_candidates{tag}"] = (span * masked).sum() / jnp.maximum(masked.sum(), 1)
        if gold is not None:
            has = (gold >= 0).astype(jnp.float32)
            doc = (ids[:, :n] == gold[:, None]).any(1).astype(jnp.float32)
            out[f"doc_in_candidates{tag}"] = (doc * has).sum() / jnp.maximum(has.sum(), 1)
    return out


def realm_signal(d_relevance, metrics, weights, gold=None) -> dict:
    """What REALM's gradient asks of the retriever, from dLoss/dRelevance [B, K]: for each
    query and candidate, the mean over its masked wordpieces of posterior - prior (the loss is
    a mean over the batch's targets of -log sum_z p(z|x) p(y_p|x,z), whose gradient on the
    score of z is -(1/N) sum_p (p(z|x,y_p) - p(z|x))). signal_span: that pull summed over the
    retrieved blocks that hold the masked span, averaged over the queries that have one;
    signal_doc: on the own document (a separate text's doc_block), over the queries that have
    it among their candidates. Above 0: REALM pulls the retriever towards them."""
    per = weights.astype(jnp.float32).sum(-1)  # [B]
    total = jnp.maximum(per.sum(), 1.0)
    pull = -d_relevance.astype(jnp.float32) * total / jnp.maximum(per, 1.0)[:, None]  # [B, K]
    holds = metrics.pop("candidate_holds")  # [B, K-1]
    has = holds.any(1) & (per > 0)
    span = (pull[:, 1:] * holds).sum(1)
    out = {"signal_span": jnp.where(has, span, 0).sum() / jnp.maximum(has.sum(), 1)}
    if gold is not None:
        at = metrics["retrieved_ids"] == gold[:, None]  # [B, K-1]
        has = at.any(1) & (gold >= 0) & (per > 0)
        doc = (pull[:, 1:] * at).sum(1)
        out["signal_doc"] = jnp.where(has, doc, 0).sum() / jnp.maximum(has.sum(), 1)
    return out
