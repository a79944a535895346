"""REALM's held-out evaluation: what retrieval is worth to the reader on unseen sentences.

Metrics (averaged over the held-out examples of prepare's eval split, masks fixed):
  accuracy             masked wordpieces predicted right by the marginal over candidates
  null_only_accuracy   the same reader given only the null document (no retrieval)
  retrieval_utility    log p(y|x) - log p(y|x, null), per target (the release's metric)
  retrieval_entropy    entropy of p(z|x) over the K candidates (0 = one-hot)
  null_doc_prob        p(null | x)
  same_title_fraction  retrieved blocks that share the query's title (the own block is
                       never retrieved, so these are real same-article hits) ...
  same_title_random    ... and the same fraction for blocks drawn uniformly at random
  title_recall@k       queries whose top k retrieved blocks hold one of the query's title, for
                       k = 1, 5 and K-1 (those <= K-1): with a separate pre-training text
                       (data.sentences) whose documents carry the title of the corpus document
                       they restate, the recall of the masked fact's own document
  same_title_prior     p(z|x) mass on retrieved blocks of the query's article ...
  same_title_posterior ... and p(z|x, y) mass (z's prior times how well the reader fills the
                       masks given z, renormalised over the K candidates). REALM's gradient
                       on the retriever's scores is p(z|x, y) - p(z|x): posterior above
                       prior means it pulls the retriever towards the article's blocks, and
                       the gap is how hard (0: the reader gives the retriever no signal)
  span_in_candidates   queries with a retrieved block that holds every masked wordpiece
                       (as a bag of wordpieces, title included) ...
  accuracy_block_holds ... the masks filled right by the reader given one such block alone
                       (per target, over every such query and block) ...
  accuracy_block_lacks ... and given one retrieved block that lacks them
  copy_gain            log p(y|x,z) per target, blocks that hold the masks minus blocks that
                       lack them, averaged over queries that retrieved both kinds: how much
                       the reader reads its block. REALM's posterior can only favour the
                       blocks that help where this is above 0 (a reader that ignores its
                       block scores 0, whatever it retrieves)
  top1_share           the share of queries whose top retrieved block is the one block most
                       often on top (a collapse: one block retrieved for every query; warned
                       about on the console from COLLAPSE_SHARE) ...
  distinct_top1        ... and the number of distinct top blocks over the queries

The query's title: its block's for a sentence cut from the corpus; for a separate text, its
document's (examples carry it since prepare format v3); a title no block has leaves the query
out of the title metrics.
"""

from __future__ import annotations

import collections
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import sharding
from realm_jax.data import datasets
from realm_jax.model.inputs import joint_len
from realm_jax.ops.fused_softmax import fused_marginal_loss
from realm_jax.pretrain import measures, retrieval, step_config

SUMMED = ("loss", "accuracy", "null_only_accuracy", "retrieval_utility")  # per target
PER_QUERY = ("retrieval_entropy", "null_doc_prob")
RECALL_KS = (1, 5)  # title_recall@k (and @K-1)
COLLAPSE_SHARE = 0.5  # warn when one block is the top retrieved block of this many queries
COLLAPSE_MIN_QUERIES = 16  # ... of at least this many

log = logging.getLogger("realm_jax.train")


def eval_metrics(
    params,
    batch,
    index_emb,
    index_tokens,
    *,
    model,
    mesh,
    num_candidates,
    num_valid,
    length,
    vocab_chunk,
    fixed_null: bool = False,
):
    """Metrics of one held-out batch (no dropout) + the retrieved ids [B, K-1]."""
    cfg = step_config.StepConfig(
        num_candidates, num_valid, length, vocab_chunk, fixed_null=fixed_null
    )
    _, relevance, cands, ids = retrieval.retrieve(
        params, batch, index_emb, index_tokens, model=model, mesh=mesh, cfg=cfg
    )
    features, table, bias = retrieval.read_candidates(
        model, params, batch["query_ids"], cands, batch["mlm_positions"], length
    )  # features [B, K, P, H]
    targets, weights = batch["mlm_targets"], batch["mlm_weights"]
    _, metrics = fused_marginal_loss(
        relevance, features, table, bias, targets, weights, chunk=vocab_chunk, mesh=mesh
    )
    null_logits = jnp.einsum("bph,vh->bpv", features[:, 0], table) + bias  # [B, P, V]
    null_right = (jnp.argmax(null_logits, -1) == targets).astype(jnp.float32) * weights
    metrics["null_only_accuracy"] = null_right.sum() / jnp.maximum(weights.sum(), 1.0)
    metrics["retrieved_ids"] = ids
    log_prior = jax.nn.log_softmax(relevance.astype(jnp.float32), -1)  # [B, K]
    loglik, right = _candidate_log_likelihood(features, table, bias, targets, weights)
    log_post = log_prior + loglik
    metrics["prior"] = jnp.exp(log_prior)
    metrics["posterior"] = jax.nn.softmax(log_post, -1)
    metrics["candidate_loglik"], metrics["candidate_right"] = loglik, right
    metrics["block_holds"] = measures.block_holds_targets(cands, targets, weights)
    metrics["query_targets"] = weights.sum(-1)
    return metrics


def _candidate_log_likelihood(features, table, bias, targets, weights):
    """Per candidate [B, K]: log p(y | x, z), the masked targets' log-probabilities summed,
    and the number of them the reader's argmax gets right given z alone; one candidate at a
    time (never [B, K, P, V] at once)."""

    def one(f):  # [B, P, H]
        logits = (jnp.einsum("bph,vh->bpv", f, table) + bias).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, -1)
        hit = jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]  # [B, P]
        right = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
        return (hit * weights).sum(-1), (right * weights).sum(-1)  # [B], [B]

    loglik, right = jax.lax.map(one, jnp.moveaxis(features, 1, 0))
    return loglik.T, right.T


def compile_eval(config, mesh, model, num_valid: int):
    fn = functools.partial(
        eval_metrics,
        model=model,
        mesh=mesh,
        num_candidates=config.train.num_candidates,
        num_valid=num_valid,
        length=joint_len(config),
        vocab_chunk=max(config.train.mlm_vocab_chunk, 0),
        fixed_null=step_config.fixed_null(config),
    )
    rows = sharding.rows_sharding(mesh)
    jitted = jax.jit(
        fn,
        in_shardings=(None, sharding.batch_sharding(mesh), rows, rows),
        out_shardings=NamedSharding(mesh, P()),
    )
    return sharding.traced_in_mesh(jitted, mesh)  # the model's sharding rules apply, as in training


class RealmEvaluator:
    """Evaluates the held-out batches against the trainer's current index."""

    def __init__(self, config, mesh, model, feed, batches: list[dict], titles):
        """titles: every block's title, as datasets.TitleIds (ids, never the strings) or a
        list of strings (tests, scripts)."""
        self.mesh, self.feed = mesh, feed
        self.fn = compile_eval(config, mesh, model, feed.num_blocks)
        if not isinstance(titles, datasets.TitleIds):
            titles = datasets.TitleIds.of(list(titles))
        self.names = titles
        self.titles = titles.ids  # [N] int64: equal ids, equal titles
        self.title_count = titles.count  # [N] blocks sharing each block's title
        k = config.train.num_candidates - 1
        self.ks = sorted({j for j in RECALL_KS if j <= k} | {k})
        # Each batch's queries' titles as block indices (a block of that title; -1 none) on
        # the host; the device batch without them.
        self.batches, self.gold = [], []
        for local in batches:
            local = dict(local)
            names = local.pop("title", None)
            own = np.asarray(local["block_id"])
            if names is None:  # examples of an older prepare: the own block's title only
                gold = own.copy()
            else:
                gold = np.asarray([titles.get(str(t), -1) for t in names], np.int64)
                gold = np.where(own >= 0, own, gold)
            self.batches.append(local)
            self.gold.append(gold)

    def __call__(self, state, step: int) -> dict[str, float]:
        sums = collections.Counter()
        copy = collections.Counter()
        same = rand = n_q = prior_same = post_same = 0.0
        recall = collections.Counter()
        tops = []
        for local, gold in zip(self.batches, self.gold, strict=True):
            batch = sharding.global_batch(local, self.mesh)
            m = sharding.to_host(self.fn(state.params, batch, self.feed.emb, self.feed.tokens))
            n_t, b = float(m["num_targets"]), len(m["retrieved_ids"])
            sums["targets"] += n_t
            for k in SUMMED:
                sums[k] += float(m[k]) * n_t
            for k in PER_QUERY:
                sums[k] += float(m[k]) * b
            sums["queries"] += b
            own = np.asarray(local["block_id"])
            if jax.process_count() > 1:  # the global batch's ids, as retrieved ids are
                own = np.asarray(multihost_utils.process_allgather(own, tiled=True))
                gold = np.asarray(multihost_utils.process_allgather(gold, tiled=True))
            ids = np.asarray(m["retrieved_ids"])
            tops.append(ids[:, 0])
            ok = gold >= 0
            hits = self.titles[ids[ok]] == self.titles[gold[ok]][:, None]  # [b, K-1]
            same += hits.mean(1).sum()
            for k in self.ks:
                recall[k] += hits[:, :k].any(1).sum()
            # candidate 0 is the null document: never of the article
            prior_same += (np.asarray(m["prior"])[ok][:, 1:] * hits).sum()
            post_same += (np.asarray(m["posterior"])[ok][:, 1:] * hits).sum()
            # a sentence cut from the corpus never retrieves its own block; a separate text's
            # may retrieve any
            cut = (own[ok] >= 0).astype(np.float64)
            n = len(self.titles)
            rand += ((self.title_count[gold[ok]] - cut) / np.maximum(n - cut, 1)).sum()
            n_q += ok.sum()
            _copy_sums(copy, m)
        out = {k: sums[k] / max(sums["targets"], 1.0) for k in SUMMED}
        out.update({k: sums[k] / max(sums["queries"], 1.0) for k in PER_QUERY})
        out["same_title_fraction"] = same / max(n_q, 1.0)
        out["same_title_random"] = rand / max(n_q, 1.0)
        out["same_title_prior"] = prior_same / max(n_q, 1.0)
        out["same_title_posterior"] = post_same / max(n_q, 1.0)
        out["title_queries"] = n_q
        for k in self.ks:
            out[f"title_recall@{k}"] = recall[k] / max(n_q, 1.0)
        out["span_in_candidates"] = copy["span_queries"] / max(copy["masked_queries"], 1.0)
        for kind in ("holds", "lacks"):
            out[f"accuracy_block_{kind}"] = copy[f"right_{kind}"] / max(copy[f"targets_{kind}"], 1)
        out["copy_gain"] = copy["gain"] / max(copy["gain_queries"], 1.0)
        out.update(collapse_metrics(np.concatenate(tops) if tops else np.zeros(0, np.int64)))
        out["examples"] = sums["queries"]
        out["index_step"] = self.feed.step
        warn_collapse(out, step, tops, self.names)
        return out


def collapse_metrics(top: np.ndarray) -> dict[str, float]:
    """top1_share and distinct_top1 of the queries' top retrieved block ids."""
    if len(top) == 0:
        return {"top1_share": 0.0, "distinct_top1": 0.0}
    _, counts = np.unique(top, return_counts=True)
    return {"top1_share": counts.max() / len(top), "distinct_top1": float(len(counts))}


def warn_collapse(out: dict, step: int, tops: list, titles) -> None:
    """A console warning when one block is the top retrieved block of most held-out queries:
    the retriever has collapsed (its scores no longer depend on the query)."""
    if out["examples"] < COLLAPSE_MIN_QUERIES or out["top1_share"] < COLLAPSE_SHARE:
        return
    top = np.concatenate(tops)
    ids, counts = np.unique(top, return_counts=True)
    block = int(ids[counts.argmax()])
    log.warning(
        "retrieval collapse at step %d: block %d (%r) is the top retrieved block of %.0f%% of "
        "%d held-out queries (%d distinct top blocks). The retriever's scores no longer depend "
        "on the query; see docs/tutorial.md",
        step,
        block,
        _title_of(titles, block),
        100 * out["top1_share"],
        int(out["examples"]),
        int(out["distinct_top1"]),
    )


def _title_of(titles, block: int) -> str:
    """A block's title from datasets.TitleIds (read back) or a list of titles."""
    if isinstance(titles, datasets.TitleIds):
        return titles.name(block)
    return titles[block] if block < len(titles) else "?"


def _copy_sums(acc: collections.Counter, m: dict) -> None:
    """Adds one batch's sums for span_in_candidates, accuracy_block_* and copy_gain."""
    holds = np.asarray(m["block_holds"])[:, 1:]  # the retrieved blocks (the null never holds)
    right = np.asarray(m["candidate_right"], np.float64)[:, 1:]
    loglik = np.asarray(m["candidate_loglik"], np.float64)[:, 1:]
    n_t = np.asarray(m["query_targets"], np.float64)
    masked = n_t > 0
    acc["masked_queries"] += masked.sum()
    acc["span_queries"] += holds.any(1).sum()
    lacks = ~holds & masked[:, None]
    for kind, sel in (("holds", holds), ("lacks", lacks)):
        acc[f"right_{kind}"] += right[sel].sum()
        acc[f"targets_{kind}"] += (np.broadcast_to(n_t[:, None], sel.shape) * sel).sum()
    both = holds.any(1) & lacks.any(1)
    per_t = loglik / np.maximum(n_t, 1.0)[:, None]

    def mean(sel):  # each query's mean over the selected blocks
        return (per_t * sel).sum(1) / np.maximum(sel.sum(1), 1)

    acc["gain"] += (mean(holds) - mean(lacks))[both].sum()
    acc["gain_queries"] += both.sum()
