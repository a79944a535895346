"""The experimental loss terms (not in the release), each added by name when its config switch is
on (StepConfig.terms): REALM's loss (step.realm_loss) asks each term in TERMS for its
Contribution and applies it, unaware of which are on.

A term may change the batch before the loss (`prepare`: the copying curriculum's injected
blocks), add candidates to the reader's marginal (`Contribution.join`: the batch's other
blocks), replace the marginal by its own objective (`Contribution.objective`: the curriculum),
add a weighted loss (`Contribution.loss`: the imitation term) and metrics."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from realm_jax.pretrain.retrieval import ABSENT, Candidates
from realm_jax.pretrain.step_config import StepConfig

BATCH_KEYS = ("gold_block", "article_block")  # read by `prepare` alone, dropped after it


class Context(NamedTuple):
    """What a term sees: the retrieval and reading, the prior's scores as REALM's loss uses
    them (train.realm_retriever_grad's stop_gradient and the step's zero offset applied),
    the batch and the step's settings."""

    cands: Candidates
    relevance: jax.Array  # [B, K]
    batch: dict
    cfg: StepConfig


@dataclasses.dataclass
class Contribution:
    """What a term adds to REALM's loss. join(rel, feats) -> (rel, feats): candidates the
    prior also covers (the reader's marginal gets them unless asked for its own candidates
    alone); objective(marginal, relevance) -> (loss, metrics): replaces the plain marginal,
    marginal(rel, join=True); loss: added to the returned loss (weighted); metrics: added."""

    join: Callable | None = None
    objective: Callable | None = None
    loss: jax.Array | None = None
    metrics: dict = dataclasses.field(default_factory=dict)


class Term:
    """An experimental term: both hooks are no-ops unless a term overrides them."""

    def prepare(self, batch: dict, step, cfg: StepConfig) -> dict:
        """The batch before the loss (train_step), given the state's step."""
        return batch

    def contribute(self, ctx: Context) -> Contribution:
        return Contribution()


class Curriculum(Term):
    """The copying curriculum (train.own_block_steps, train.article_block_steps).

    own_block_steps: before that step the masked sentence's own block is not excluded from
    retrieval, and a separate text's sentence gets its document's block (the batch's
    gold_block) among its candidates. article_block_steps: before that step a sentence cut
    from the corpus gets a block of its article (not its own) that holds the masked span (the
    batch's article_block) among its candidates, read as the curriculum reads a document's
    block. While a query has its block injected, the loss is curriculum_loss's."""

    def prepare(self, batch, step, cfg):
        gold, article = batch.get("gold_block"), batch.get("article_block")
        if cfg.own_block_steps > 0:
            early = step < cfg.own_block_steps
            if gold is not None:  # a separate text's sentence: its document's block joins
                put = jnp.where(early & (batch["block_id"] < 0), gold, -1)
                batch["inject"] = put.astype(jnp.int32)
            own = jnp.where(early, -1, batch["block_id"])
            batch["block_id"] = own.astype(batch["block_id"].dtype)
        if cfg.article_block_steps > 0 and article is not None:  # a corpus sentence
            put = jnp.where(step < cfg.article_block_steps, article, -1).astype(jnp.int32)
            batch["inject"] = (
                jnp.where(batch["inject"] >= 0, batch["inject"], put) if "inject" in batch else put
            )
        return batch

    def contribute(self, ctx):
        inject = ctx.batch.get("inject")
        if inject is None:
            return Contribution()

        def objective(marginal, relevance):  # its two losses only while a query has a block
            def plain():
                loss, m = marginal(relevance)
                return loss, dict(m, curriculum_copy_accuracy=jnp.zeros((), jnp.float32))

            alone = functools.partial(marginal, join=False)
            ids = ctx.cands.ids
            return jax.lax.cond(
                (inject >= 0).any(),
                lambda: curriculum_loss(marginal, relevance, ids, inject, alone),
                plain,
            )

        return Contribution(objective=objective)


class InBatch(Term):
    """train.inbatch_negatives: the prior normalised over the other queries' candidates too,
    those read as the null document (inbatch_scores, with_outside); metric
    inbatch_outside_mass, the prior's mass on them. With grad_accum, within a micro-batch."""

    def contribute(self, ctx):
        c = ctx.cands
        outside = inbatch_scores(c.q_emb, c.hits, c.ids, ctx.batch["block_id"].astype(c.ids.dtype))
        if not ctx.cfg.retriever_grad:
            outside = jax.lax.stop_gradient(outside)
        lse = functools.partial(jax.nn.logsumexp, axis=-1)
        gap = lse(outside.astype(jnp.float32)) - lse(ctx.relevance.astype(jnp.float32))
        mass = jax.nn.sigmoid(jax.lax.stop_gradient(gap)).mean()
        return Contribution(
            join=functools.partial(with_outside, outside=outside),
            metrics={"inbatch_outside_mass": mass},
        )


class Imitation(Term):
    """train.imitation_weight: the loss plus that times imitation_term's (BM25's top block,
    extra_ids[:, 0], as a contrastive positive; its columns train.imitation_negatives);
    metrics imitation_loss and imitation_accuracy ("loss" stays REALM's)."""

    def contribute(self, ctx):
        c, cfg = ctx.cands, ctx.cfg
        positive = ctx.batch["extra_ids"][:, 0].astype(c.ids.dtype)
        own = ctx.batch["block_id"].astype(c.ids.dtype)
        alone = cfg.imitation_negatives == "positives"
        term, accuracy = imitation_term(c.q_emb, c.hits, c.ids, positive, own, alone)
        return Contribution(
            loss=cfg.imitation_weight * term,
            metrics={"imitation_accuracy": accuracy, "imitation_loss": term},
        )


TERMS: dict[str, Term] = {
    "curriculum": Curriculum(),
    "inbatch": InBatch(),
    "imitation": Imitation(),
}


def inbatch_scores(q_emb, hits, ids, own_block):
    """The scores of query b against the other queries' retrieved candidates (train.
    inbatch_negatives): [B, B * (K-1)], ABSENT where a column is not one of b's in-batch
    negatives. q_emb [B, D], hits [B, K-1, D] (live embeddings), ids [B, K-1] (-1: an empty
    slot), own_block [B] (the masked sentence's own block, -1 none: the trivial-retrieval
    exclusion holds here too). A column counts for query b when its block is none of b's own
    candidates, is not b's own block, and is the block's first place in the batch (a block
    retrieved for many queries, a hub, counts once in a normaliser)."""
    B, k, D = hits.shape
    flat_ids = ids.reshape(B * k)
    col = jnp.arange(B * k)
    same = flat_ids[:, None] == flat_ids[None, :]  # [Bk, Bk]
    first = ~(same & (col[None, :] < col[:, None])).any(1)  # no earlier column holds it
    mine = (ids[:, :, None] == flat_ids[None, None, :]).any(1)  # [B, Bk]: among b's own
    keep = first[None, :] & ~mine & (flat_ids >= 0)[None, :]
    keep &= flat_ids[None, :] != own_block[:, None]
    scores = q_emb @ hits.reshape(B * k, D).T  # [B, Bk]
    return jnp.where(keep, scores, ABSENT)


def imitation_term(q_emb, hits, ids, positive, own_block, positives_only: bool = False):
    """The BM25-imitation term (train.imitation_weight; not in the release, issue 46): each
    query's second retriever's top block `positive` [B] (BM25's, the batch's raw extra_ids
    [:, 0]; -1 none) ranked by a softmax over the batch's candidate blocks, the dense and the
    joined ones (hits [B, K-1, D], live embeddings; ids [B, K-1], -1 an empty slot),
    deduplicated (a block's first place in the batch), the query's own block excluded as
    retrieval excludes it. As the imitation control's loss (ict.positives=bm25) but ranked
    against the batch's retrieved blocks, hard negatives, not only the other sentences'
    positives; with positives_only (train.imitation_negatives="positives") against the batch's
    positives alone, the control's loss. Returns (mean cross-entropy over the queries that
    have a positive, their accuracy: the positive scored above every other column)."""
    B, k, D = hits.shape
    flat_ids = ids.reshape(B * k)
    col = jnp.arange(B * k)
    same = flat_ids[:, None] == flat_ids[None, :]  # [Bk, Bk]
    first = ~(same & (col[None, :] < col[:, None])).any(1) & (flat_ids >= 0)  # [Bk]
    keep = first[None, :] & (flat_ids[None, :] != own_block[:, None])  # [B, Bk]
    if positives_only:  # the batch's positives alone: the imitation control's negatives
        keep &= (flat_ids[:, None] == positive[None, :]).any(1)[None, :]
    scores = jnp.where(keep, q_emb @ hits.reshape(B * k, D).T, ABSENT).astype(jnp.float32)
    at = first[None, :] & (flat_ids[None, :] == positive[:, None])  # [B, Bk]: one column
    has = (at.any(1) & (positive >= 0) & (positive != own_block)).astype(jnp.float32)
    label = jnp.argmax(at, axis=1)
    ce = jax.nn.logsumexp(scores, axis=1) - jnp.take_along_axis(scores, label[:, None], 1)[:, 0]
    n = jnp.maximum(has.sum(), 1.0)
    accuracy = ((jnp.argmax(scores, axis=1) == label) * has).sum() / n
    return (ce * has).sum() / n, accuracy


def with_outside(relevance, features, outside):
    """REALM's candidates joined by one for the batch's other blocks (train.inbatch_negatives):
    (relevance [B, K+1], features [B, K+1, P, H]); outside [B, B(K-1)] from inbatch_scores.

    Each query's prior is normalised over its own K candidates and the other queries'
    retrieved blocks; the reader reads only its own, and a block it does not read is taken to
    tell it what the null document does (an unrelated block, read, is a block that does not
    help: the release's top-k truncation leaves such blocks out of the normaliser altogether).
    So the others share one extra candidate scored logsumexp(outside), read as the null
    document: REALM's gradient pulls up an own candidate that predicts the masked span better
    than the null document does, and pushes down, by their prior, every block that does not,
    the batch's other sentences' blocks (BM25's among them) included, as a contrastive loss
    ranks a positive against the batch. (A likelihood of 0 for the unread blocks rewarded the
    own dense hits for being the top of the retriever's own ranking: in the attributes world
    the prior fell onto them, the null document took the mass, REALM's pull on the own
    document went to 0: experiments/world/README.md.)"""
    out = jax.nn.logsumexp(outside.astype(jnp.float32), axis=-1)  # [B]
    relevance = jnp.concatenate([relevance, out[:, None].astype(relevance.dtype)], axis=1)
    return relevance, jnp.concatenate([features, features[:, :1]], axis=1)


def curriculum_loss(marginal, relevance, ids, inject, marginal_alone=None):
    """The copying curriculum's loss (train.own_block_steps with a separate text), for the
    queries given their document's block z* (inject >= 0; the others: REALM's loss): the mean
    of -log p(y | x, z*), the reader reading z* alone (its prior set to 1), and REALM's
    marginal loss over the other candidates (z* left out, the null document in).

    A deviation from the release, whose BERT-base reader already copies: bert-tiny's reader
    given z* only at its prior (a tenth of the mass, or less, for a block the search ranked
    low) had not learned to copy after 150 steps at 1e-3, and one given z* alone copied from
    any block, right or wrong; once the retriever trained, every query whose own block was not
    retrieved preferred the null document to the confidently wrong copies, and the null
    document's score rose for every query at once: p(null) 0.89 within 20 steps, one block
    the top of every query by 50 (docs/tutorial.md). The second term teaches the reader not to
    copy from a block about someone else. marginal_alone (default marginal) scores the first
    term: the reader reading z* alone (train.inbatch_negatives' other blocks left out)."""
    B = relevance.shape[0]
    gold = jnp.concatenate([jnp.zeros((B, 1), bool), ids == inject[:, None]], axis=1)  # [B, K]
    on = (inject >= 0)[:, None]
    alone, m_alone = (marginal_alone or marginal)(jnp.where(on & ~gold, -1e9, relevance))
    others, m_others = marginal(jnp.where(on & gold, -1e9, relevance))
    metrics = dict(m_others)
    metrics["loss"] = (alone + others) / 2
    metrics["curriculum_copy_accuracy"] = m_alone["accuracy"]
    return metrics["loss"], metrics
