"""The REALM train step: retrieve, re-embed, read, marginalise, update. Pure and jitted.

Shapes: B queries, K candidates (candidate 0 = the null document, K-1 retrieved), P masked
positions per query, Lq/Lb/Lj query/block/joint lengths, N blocks (padded), D = proj_size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import sharding
from realm_jax.index.embedding import embed_block_tokens, embed_query_tokens
from realm_jax.model.inputs import (
    NULL_BLOCK,
    build_joint,
    check_fits,
    dropout_kwargs,
    init_inputs,
    joint_len,
    null_block_tokens,
    null_reader_input,
)
from realm_jax.model.realm import RealmModel, realm_model, tied_decoder_logits
from realm_jax.ops import mips
from realm_jax.ops.fused_softmax import fused_marginal_loss
from realm_jax.pretrain import losses
from realm_jax.train.optimizer import make_optimizer
from realm_jax.train.state import TrainState, create_sharded, guarded_update


def check_lengths(config, model: RealmModel) -> None:
    """Every input fits its network's position table (a clear error, not an XLA one)."""
    d = config.data
    what = "reader input length data.query_len + data.block_len - 1"
    check_fits(what, joint_len(config), model.cfg, "reader")
    check_fits("data.block_len", d.block_len, model.ecfg, "embedder")
    check_fits("data.query_len", d.query_len, model.ecfg, "embedder")


def state_parts(config):
    """(model, optimizer, init_params(rng) -> boxed params): what the state is made of."""
    model = realm_model(config.model)
    check_lengths(config, model)
    d = config.data
    inputs = init_inputs(d.query_len, d.block_len, joint_len(config))
    return model, make_optimizer(config.train), lambda r: model.init(r, *inputs)["params"]


def create_state(config, mesh: Mesh, rng, params_hook=None):
    """The train state created sharded: eval_shape -> logical specs -> jit(out_shardings).

    params_hook(params) may replace parameters on the host (weight import) before training.
    Returns (model, optimizer, state, state_shardings).
    """
    model, optimizer, init_params = state_parts(config)
    state, shardings = create_sharded(
        mesh, init_params, optimizer, rng, params_hook, fsdp=config.mesh.get("fsdp", False)
    )
    return model, optimizer, state, shardings


def retrieve(params, batch, index_emb, index_tokens, **kw):
    """Embed queries, search the index, re-embed the hits with live params: `retrieve_embedded`
    without the candidates' embeddings, (q_emb [B, D], relevance [B, K], candidate tokens
    [B, K, Lb], retrieved ids [B, K-1])."""
    q_emb, _, relevance, cands, ids = retrieve_embedded(
        params, batch, index_emb, index_tokens, **kw
    )
    return q_emb, relevance, cands, ids


def retrieve_embedded(
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
    inject=None,
    fixed_null: bool = False,
    extra=None,
):
    """Embed queries, search the index, re-embed the hits with live params.

    extra [B, m] (block ids, -1 none): a second retriever's blocks joined to the dense top-k
    (join_extra; train.bm25_candidates), K = num_candidates + m; a slot whose block repeats
    another scores ABSENT.

    fixed_null: the null document's prior is 1/K whatever the query (train.null_doc
    "fixed"), its score that of the retrieved blocks' mean probability, without gradient.

    inject [B] (block ids, -1 none): a block put among query b's candidates in place of its
    lowest-scored retrieved one when the search did not find it (train.own_block_steps'
    copying curriculum for a separate text: the sentence's document's block; realm_loss).

    Returns (q_emb [B, D], the retrieved candidates' live embeddings [B, K-1, D], relevance
    [B, K], candidate tokens [B, K, Lb], retrieved ids [B, K-1], -1 for an empty slot).
    Candidate 0 is the null document, as in the release
    (example_generator.py prepends an empty Document; model.py scores every candidate with
    one einsum): the empty block `[CLS] [SEP] [SEP]` embedded by the live document embedder,
    so its score and gradient are those of any candidate. (A constant score of 0 took all the
    probability whenever an untrained projection scored every retrieved block below 0, and
    the retriever's gradient vanished for good.)
    """
    q_ids = batch["query_ids"]  # [B, Lq]
    q_emb = embed_query_tokens(model, params, q_ids, rng)  # [B, D]
    k = num_candidates - 1
    _, ids, tokens = mips.search_and_fetch(
        mesh,
        jax.lax.stop_gradient(q_emb),
        index_emb,
        index_tokens,
        batch["block_id"],
        k=k,
        num_valid=num_valid,
    )  # ids [B, k], tokens [B, k, Lb]
    if inject is not None:
        put = (inject >= 0) & ~(ids == inject[:, None]).any(1)  # [B]
        ids = ids.at[:, -1].set(jnp.where(put, inject, ids[:, -1]))
        gold = mips.fetch_rows(mesh, index_tokens, jnp.maximum(inject, 0)[:, None])[:, 0]
        tokens = tokens.at[:, -1].set(jnp.where(put[:, None], gold, tokens[:, -1]))
    if extra is not None:  # a second retriever's blocks join the dense ones
        ids, tokens = join_extra(mesh, index_tokens, ids, tokens, extra)
    B, k, Lb = tokens.shape
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
    hits = d_emb  # [B, K-1, D]
    d_emb = jnp.concatenate([null_emb[:, None], d_emb], axis=1)  # [B, K, D]
    relevance = jnp.einsum("bd,bkd->bk", q_emb, d_emb)
    valid = ids >= 0  # [B, K-1]: a joined candidate that repeats another (or none) is out
    relevance = relevance.at[:, 1:].set(jnp.where(valid, relevance[:, 1:], ABSENT))
    if fixed_null:
        rest = jnp.where(valid, relevance[:, 1:], -jnp.inf)
        null = jax.nn.logsumexp(rest, axis=1) - jnp.log(valid.sum(1).astype(rest.dtype))
        relevance = relevance.at[:, 0].set(jax.lax.stop_gradient(null))
    cands = jnp.concatenate([null_block_tokens(B, Lb)[:, None].astype(tokens.dtype), tokens], 1)
    return q_emb, hits, relevance, cands, ids


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


ABSENT = -1e9  # the score of a candidate slot that holds no block (its prior is 0)


def join_extra(mesh: Mesh, index_tokens, ids, tokens, extra):
    """The dense top-k (ids [B, k], tokens [B, k, Lb]) joined by a second retriever's blocks
    extra [B, m] (-1: none; train.bm25_candidates): (ids [B, k + m], tokens [B, k + m, Lb]),
    an extra block already among the dense ones, or earlier among the extras, given id -1.
    Every joined block is then embedded with the live parameters and scored by the query
    like the dense ones (`retrieve`), so REALM's prior and posterior cover them all."""
    m = extra.shape[1]
    earlier = jnp.tril(jnp.ones((m, m), bool), -1)  # [m, m]: j < i
    repeat = (extra[:, :, None] == ids[:, None, :]).any(-1)  # [B, m]
    repeat |= ((extra[:, :, None] == extra[:, None, :]) & earlier).any(-1)
    extra = jnp.where(repeat | (extra < 0), -1, extra).astype(ids.dtype)
    rows = mips.fetch_rows(mesh, index_tokens, jnp.maximum(extra, 0))  # [B, m, Lb]
    return jnp.concatenate([ids, extra], 1), jnp.concatenate([tokens, rows.astype(tokens.dtype)], 1)


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


def retrieve_and_read(
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
    rng=None,
    inject=None,
    fixed_null: bool = False,
    inbatch: bool = False,
    imitation: str = "",
):
    """`retrieve` then `read_candidates`, with a batch's extra_ids (a second retriever's
    blocks) joined: (relevance [B, K], features [B, K, P, H], word embeddings [V, H], decoder
    bias [V], retrieved ids [B, K-1], candidate tokens [B, K, Lb], and a dict of the batch
    terms: with inbatch "outside", the scores against the other queries' candidates
    [B, B(K-1)] (inbatch_scores); with imitation ("candidates" or "positives",
    train.imitation_negatives) "imitation", imitation_term's (loss, accuracy) for
    extra_ids[:, 0])."""
    q_emb, hits, relevance, cands, ids = retrieve_embedded(
        params,
        batch,
        index_emb,
        index_tokens,
        model=model,
        mesh=mesh,
        num_candidates=num_candidates,
        num_valid=num_valid,
        rng=rng,
        inject=inject,
        fixed_null=fixed_null,
        extra=batch.get("extra_ids"),
    )
    features, table, bias = read_candidates(
        model, params, batch["query_ids"], cands, batch["mlm_positions"], length, rng
    )
    terms = {}
    own = batch["block_id"].astype(ids.dtype)
    if inbatch:
        terms["outside"] = inbatch_scores(q_emb, hits, ids, own)
    if imitation:
        positive = batch["extra_ids"][:, 0].astype(ids.dtype)
        alone = imitation == "positives"
        terms["imitation"] = imitation_term(q_emb, hits, ids, positive, own, alone)
    return relevance, features, table, bias, ids, cands, terms


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
    fixed_null: bool = False,
    inbatch: bool = False,
    imitation_weight: float = 0.0,
    retriever_grad: bool = True,
    imitation_negatives: str = "candidates",
):
    """REALM's marginal loss for one batch; returns (loss, metrics). Dropout when rng given.
    inbatch (train.inbatch_negatives): the prior normalised over the other queries'
    candidates too, those read as the null document (with_outside; not in the release).
    imitation_weight (train.imitation_weight): the returned loss is REALM's plus that times
    imitation_term's (BM25's top block, extra_ids[:, 0], as a contrastive positive; metrics
    "imitation_loss" and "imitation_accuracy"; "loss" stays REALM's). retriever_grad=False
    (train.realm_retriever_grad): REALM's loss reaches the retriever's scores under
    stop_gradient, so the embedders learn from the imitation term alone, the reader from
    REALM's loss over the same candidates: the in-step imitation control.
    imitation_negatives: the term's columns, "candidates" (the batch's) or "positives".
    A batch's "inject" [B] puts those blocks among the candidates (retrieve); its
    "extra_ids" [B, m] joins a second retriever's blocks to them (train.bm25_candidates);
    its "doc_block" [B] (a separate text's document's block, -1 none) is only measured:
    the coverage metrics (`coverage`: the masked span, or the own document, among the
    candidates; with extra_ids also among the dense ones alone, "..._dense").

    vocab_chunk: vocabulary rows per step of the fused MLM softmax (fused_marginal_loss;
    0 = the whole vocabulary at once; -1 = materialise the logits, losses.marginal_loss)."""
    relevance, features, table, bias, ids, cands, terms = retrieve_and_read(
        params,
        batch,
        index_emb,
        index_tokens,
        model=model,
        mesh=mesh,
        num_candidates=num_candidates,
        num_valid=num_valid,
        length=length,
        rng=rng,
        inject=batch.get("inject"),
        fixed_null=fixed_null,
        inbatch=inbatch,
        imitation=imitation_negatives if imitation_weight > 0 else "",
    )  # features [B, K, P, H]
    outside = terms.get("outside")
    if not retriever_grad:  # the in-step imitation control: REALM trains the reader alone
        relevance = jax.lax.stop_gradient(relevance)
        outside = None if outside is None else jax.lax.stop_gradient(outside)
    targets, weights = batch["mlm_targets"], batch["mlm_weights"]
    if "relevance_offset" in batch:  # zeros: its gradient is dLoss/dRelevance (train_step)
        relevance = relevance + batch["relevance_offset"].astype(relevance.dtype)

    def marginal(rel, join_outside: bool = True):
        feats = features
        if outside is not None and join_outside:  # the batch's other blocks: one candidate
            rel, feats = with_outside(rel, features, outside)
        if vocab_chunk < 0:  # materialise the [B, K, P, V] logits (the reference path)
            logits = tied_decoder_logits(feats, table, bias)
            return losses.marginal_loss(rel, logits, targets, weights)
        return fused_marginal_loss(
            rel, feats, table, bias, targets, weights, chunk=vocab_chunk, mesh=mesh
        )

    inject = batch.get("inject")
    if inject is None:
        loss, metrics = marginal(relevance)
    else:  # the curriculum's two losses only while a query has its block injected

        def plain():
            loss, m = marginal(relevance)
            return loss, dict(m, curriculum_copy_accuracy=jnp.zeros((), jnp.float32))

        loss, metrics = jax.lax.cond(
            (inject >= 0).any(),
            lambda: curriculum_loss(
                marginal, relevance, ids, inject, lambda r: marginal(r, join_outside=False)
            ),
            plain,
        )
    if outside is not None:  # the prior's mass on the batch's other blocks
        lse = functools.partial(jax.nn.logsumexp, axis=-1)
        gap = lse(outside.astype(jnp.float32)) - lse(relevance.astype(jnp.float32))
        metrics["inbatch_outside_mass"] = jax.nn.sigmoid(jax.lax.stop_gradient(gap)).mean()
    gold = batch.get("doc_block")
    dense = num_candidates - 1 if "extra_ids" in batch else None
    metrics.update(coverage(cands, ids, targets, weights, gold, dense))
    metrics["retrieved_ids"] = ids
    if "relevance_offset" in batch:  # for realm_signal, outside the differentiated function
        metrics["candidate_holds"] = block_holds_targets(cands, targets, weights)[:, 1:] & (
            ids >= 0
        )
    if "imitation" in terms:
        term, metrics["imitation_accuracy"] = terms["imitation"]
        metrics["imitation_loss"] = term
        loss = loss + imitation_weight * term
    return loss, metrics


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


# Metrics that marginal_metrics averages over the batch's real targets, and the one it sums;
# any other metric is a mean over sentences.
_PER_TARGET = ("loss", "accuracy", "retrieval_utility")
_SUMMED = ("num_targets",)


def micro_batches(batch, n: int, mesh: Mesh):
    """The global batch [B, ...] as n micro-batches [n, B/n, ...]. Micro-batch j takes rows
    j, j + n, j + 2n, ...: every data shard's rows split evenly between the micro-batches, so
    each stays sharded over the data axis with no data moving between devices (B must be
    divisible by n times the data axis: config and sharding.check_batch say so)."""

    def split(x):
        x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
        spec = P(None, "data", *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def accumulated_grads(loss_fn, params, batch, index_emb, index_tokens, n: int, mesh, rng):
    """The gradient and metrics of REALM's loss on the whole batch, computed over n
    micro-batches in a lax.scan, so that activations are those of one micro-batch.

    Exact, not an average of micro-batch means: the loss is a mean over the batch's real
    targets (marginal_metrics), so each micro-batch's gradient is weighted by its number of
    targets n_i and the sum divided by the batch's: sum_i n_i grad(loss_i) / max(sum_i n_i,
    1), since n_i loss_i is micro-batch i's summed loss (0 when it has no targets). Dropout
    keys fold in the micro-batch index. The release has no accumulation (it runs the paper's
    batch of 512 on 64 TPU cores); this is how one accelerator, or a CPU, runs that batch.
    """
    micro = micro_batches(batch, n, mesh)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(carry, xs):
        i, mb = xs
        key = None if rng is None else jax.random.fold_in(rng, i)
        (_, m), g = grad_fn(params, mb, index_emb, index_tokens, rng=key)
        m.pop("retrieved_ids")
        w = m["num_targets"]
        g_sum, m_sum = carry
        g_sum = jax.tree.map(lambda a, b: a + w * b.astype(a.dtype), g_sum, g)
        m_sum = {k: m_sum[k] + (w * m[k] if k in _PER_TARGET else m[k]) for k in m_sum}
        return (g_sum, m_sum), None

    _, m_shape = jax.eval_shape(
        lambda: grad_fn(
            params, jax.tree.map(lambda x: x[0], micro), index_emb, index_tokens, rng=rng
        )[0]
    )
    m_shape.pop("retrieved_ids")
    zeros = (
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        {k: jnp.zeros(v.shape, jnp.float32) for k, v in m_shape.items()},
    )
    (g_sum, m_sum), _ = jax.lax.scan(body, zeros, (jnp.arange(n), micro))
    total = jnp.maximum(m_sum["num_targets"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / total).astype(p.dtype), g_sum, params)
    metrics = {
        k: v / total if k in _PER_TARGET else v if k in _SUMMED else v / n for k, v in m_sum.items()
    }
    return grads, metrics


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
    own_block_steps: int = 0,
    grad_accum: int = 1,
    fixed_null: bool = False,
    article_block_steps: int = 0,
    inbatch: bool = False,
    imitation_weight: float = 0.0,
    retriever_grad: bool = True,
    imitation_negatives: str = "candidates",
):
    """One optimizer step; returns (new state, metrics). own_block_steps: before that step
    the masked sentence's own block is not excluded from retrieval, and a separate text's
    sentence gets its document's block (the batch's gold_block) among its candidates
    (train.own_block_steps: the reader's copying curriculum). article_block_steps: before
    that step a sentence cut from the corpus gets a block of its article (not its own) that
    holds the masked span (the batch's article_block) among its candidates, read as the
    curriculum reads a document's block (train.article_block_steps).
    grad_accum: micro-batches the batch is split into (accumulated_grads); 1 = one pass, and
    with inbatch (train.inbatch_negatives) a micro-batch's queries are each other's negatives,
    as they are with imitation_weight (realm_loss; its term then weighted by the micro-batch's
    share of the targets, as REALM's loss is)."""
    batch = dict(batch)
    gold = batch.pop("gold_block", None)
    article = batch.pop("article_block", None)
    if gold is not None:  # a separate text's sentence: its document's block (coverage)
        batch["doc_block"] = jnp.where(batch["block_id"] < 0, gold, -1).astype(jnp.int32)
    if own_block_steps > 0:
        early = state.step < own_block_steps
        if gold is not None:  # a separate text's sentence: its document's block joins
            batch["inject"] = jnp.where(early & (batch["block_id"] < 0), gold, -1).astype(jnp.int32)
        own = jnp.where(early, -1, batch["block_id"])
        batch["block_id"] = own.astype(batch["block_id"].dtype)
    if article_block_steps > 0 and article is not None:  # a corpus sentence: an article block
        put = jnp.where(state.step < article_block_steps, article, -1).astype(jnp.int32)
        batch["inject"] = (
            jnp.where(batch["inject"] >= 0, batch["inject"], put) if "inject" in batch else put
        )
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
        fixed_null=fixed_null,
        inbatch=inbatch,
        imitation_weight=imitation_weight,
        retriever_grad=retriever_grad,
        imitation_negatives=imitation_negatives,
    )
    if grad_accum > 1:
        grads, metrics = accumulated_grads(
            loss_fn, state.params, batch, index_emb, index_tokens, grad_accum, mesh, rng
        )
    else:  # a zero offset on the relevance gives dLoss/dRelevance in the same pass
        K = num_candidates + (batch["extra_ids"].shape[1] if "extra_ids" in batch else 0)
        zeros = jnp.zeros((batch["query_ids"].shape[0], K), jnp.float32)

        def with_offset(params, offset):
            step_batch = dict(batch, relevance_offset=offset)
            return loss_fn(params, step_batch, index_emb, index_tokens, rng=rng)

        grad_fn = jax.value_and_grad(with_offset, argnums=(0, 1), has_aux=True)
        (_, metrics), (grads, d_rel) = grad_fn(state.params, zeros)
        metrics.update(realm_signal(d_rel, metrics, batch["mlm_weights"], batch.get("doc_block")))
        metrics.pop("retrieved_ids")
    new_state = guarded_update(state, grads, metrics, optimizer)
    for name in grads:
        metrics[f"grad_norm/{name}"] = optax.tree.norm(grads[name])
    metrics["staleness"] = state.step - index_step
    return new_state, metrics


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
        own_block_steps=int(config.train.get("own_block_steps", 0)),
        grad_accum=int(config.train.get("grad_accum", 1)),
        fixed_null=fixed_null(config),
        article_block_steps=int(config.train.get("article_block_steps", 0)),
        inbatch=bool(config.train.get("inbatch_negatives", False)),
        imitation_weight=float(config.train.get("imitation_weight", 0.0)),
        retriever_grad=bool(config.train.get("realm_retriever_grad", True)),
        imitation_negatives=config.train.get("imitation_negatives", "candidates"),
    )
    rows = sharding.rows_sharding(mesh)
    jitted = jax.jit(
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
    return sharding.traced_in_mesh(jitted, mesh)


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
        fixed_null=fixed_null(config),
    )
    return jax.jit(lambda *a: fn(*a)[1], out_shardings=NamedSharding(mesh, P()))


NULL_DOCS = ("scored", "fixed")


def fixed_null(config) -> bool:
    """train.null_doc: "scored" (the release: the empty block embedded and scored like any
    block) or "fixed" (its prior 1/K for every query: retrieve)."""
    mode = config.train.get("null_doc", "scored")
    if mode not in NULL_DOCS:
        from realm_jax.config import ConfigError

        raise ConfigError(f"train.null_doc={mode!r}: must be one of {', '.join(NULL_DOCS)}")
    return mode == "fixed"
