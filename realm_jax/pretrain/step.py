"""The REALM train step: retrieve, re-embed, read, marginalise, update. Pure and jitted.

One StepConfig (step_config.py) carries every setting, built once where the step is compiled;
the experimental loss terms it turns on (terms.py) are applied by name, so realm_loss and
train_step are the same code whichever are on. Retrieval and reading: retrieval.py.

Shapes: B queries, K candidates (candidate 0 = the null document, K-1 retrieved), P masked
positions per query, N blocks (padded), D = proj_size."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from realm_jax import sharding
from realm_jax.model.inputs import check_fits, init_inputs, joint_len
from realm_jax.model.realm import RealmModel, realm_model, tied_decoder_logits
from realm_jax.ops.fused_softmax import fused_marginal_loss
from realm_jax.pretrain import losses, measures, retrieval, terms
from realm_jax.pretrain.step_config import StepConfig
from realm_jax.train.optimizer import EMBEDDERS, make_optimizer, reader_only
from realm_jax.train.state import TrainState, create_sharded, guarded_update


def check_lengths(config, model: RealmModel) -> None:
    """Every input fits its network's position table (a clear error, not an XLA one)."""
    d = config.data
    what = "reader input length data.query_len + data.block_len - 1"
    check_fits(what, joint_len(config), model.cfg, "reader")
    check_fits("data.block_len", d.block_len, model.ecfg, "embedder", "doc")
    check_fits("data.query_len", d.query_len, model.ecfg, "embedder", "query")


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


def realm_loss(params, batch, index_emb, index_tokens, *, model, mesh, cfg: StepConfig, rng=None):
    """REALM's marginal loss for one batch, with the experimental terms cfg.terms turns on
    (terms.py); returns (loss, metrics). Dropout when rng given.

    cfg.retriever_grad=False (train.realm_retriever_grad): REALM's loss reaches the
    retriever's scores under stop_gradient, so the embedders learn from the imitation term
    alone, the reader from REALM's loss over the same candidates: the in-step imitation
    control. A batch's "inject" [B] puts those blocks among the candidates (retrieval); its
    "extra_ids" [B, m] joins a second retriever's blocks to them (train.bm25_candidates); its
    "doc_block" [B] (a separate text's document's block, -1 none) is only measured: the
    coverage metrics (measures.coverage: the masked span, or the own document, among the
    candidates; with extra_ids also among the dense ones alone, "..._dense"); its
    "relevance_offset" [B, K] (zeros, train_step) is added to the scores, so that its
    gradient is dLoss/dRelevance."""
    c = retrieval.retrieve_and_read(
        params, batch, index_emb, index_tokens, model=model, mesh=mesh, cfg=cfg, rng=rng
    )
    relevance = c.relevance
    if not cfg.retriever_grad:  # the in-step imitation control: REALM trains the reader alone
        relevance = jax.lax.stop_gradient(relevance)
    if "relevance_offset" in batch:
        relevance = relevance + batch["relevance_offset"].astype(relevance.dtype)
    ctx = terms.Context(c, relevance, batch, cfg)
    parts = [terms.TERMS[name].contribute(ctx) for name in cfg.terms]
    marginal = reader_marginal(c, batch, cfg, mesh, [p.join for p in parts if p.join])
    objective = [p.objective for p in parts if p.objective]
    loss, metrics = objective[0](marginal, relevance) if objective else marginal(relevance)
    for part in parts:
        metrics.update(part.metrics)
    metrics.update(candidate_metrics(c, batch, cfg))
    for part in parts:
        if part.loss is not None:
            loss = loss + part.loss
    return loss, metrics


def reader_marginal(c, batch, cfg: StepConfig, mesh: Mesh, joins):
    """marginal(relevance [B, K], join=True) -> (loss, metrics): REALM's marginal likelihood
    of the masked targets over the candidates, their features c.features, the prior extended
    by each of `joins` (a term's extra candidates) unless join=False.

    cfg.vocab_chunk: vocabulary rows per step of the fused MLM softmax (fused_marginal_loss;
    0 = the whole vocabulary at once; -1 = materialise the logits, losses.marginal_loss)."""
    targets, weights = batch["mlm_targets"], batch["mlm_weights"]

    def marginal(rel, join: bool = True):
        feats = c.features
        if join:
            for extend in joins:
                rel, feats = extend(rel, feats)
        if cfg.vocab_chunk < 0:  # materialise the [B, K, P, V] logits (the reference path)
            logits = tied_decoder_logits(feats, c.table, c.bias)
            return losses.marginal_loss(rel, logits, targets, weights)
        return fused_marginal_loss(
            rel, feats, c.table, c.bias, targets, weights, chunk=cfg.vocab_chunk, mesh=mesh
        )

    return marginal


def candidate_metrics(c, batch, cfg: StepConfig) -> dict:
    """The candidates' coverage metrics, their ids ("retrieved_ids") and, for realm_signal,
    which hold the masked span ("candidate_holds", with the step's relevance_offset)."""
    targets, weights = batch["mlm_targets"], batch["mlm_weights"]
    dense = cfg.num_candidates - 1 if "extra_ids" in batch else None
    out = measures.coverage(c.cands, c.ids, targets, weights, batch.get("doc_block"), dense)
    out["retrieved_ids"] = c.ids
    if "relevance_offset" in batch:  # for realm_signal, outside the differentiated function
        holds = measures.block_holds_targets(c.cands, targets, weights)[:, 1:]
        out["candidate_holds"] = holds & (c.ids >= 0)
    return out


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


def prepare_batch(batch, step, cfg: StepConfig) -> dict:
    """The batch as realm_loss takes it: a separate text's sentence's gold_block as its
    "doc_block" (measured: coverage), then each term's `prepare` (the copying curriculum's
    injected blocks), the keys only they read dropped."""
    batch = dict(batch)
    if "gold_block" in batch:  # a separate text's sentence: its document's block (coverage)
        gold = batch["gold_block"]
        batch["doc_block"] = jnp.where(batch["block_id"] < 0, gold, -1).astype(jnp.int32)
    for name in cfg.terms:
        batch = terms.TERMS[name].prepare(batch, step, cfg)
    for key in terms.BATCH_KEYS:
        batch.pop(key, None)
    return batch


def one_pass_grads(loss_fn, params, batch, index_emb, index_tokens, cfg: StepConfig, rng):
    """The gradient and metrics of loss_fn on the whole batch in one pass, with realm_signal's
    metrics: a zero offset on the relevance gives dLoss/dRelevance in the same pass."""
    K = cfg.num_candidates + (batch["extra_ids"].shape[1] if "extra_ids" in batch else 0)
    zeros = jnp.zeros((batch["query_ids"].shape[0], K), jnp.float32)

    def with_offset(params, offset):
        step_batch = dict(batch, relevance_offset=offset)
        return loss_fn(params, step_batch, index_emb, index_tokens, rng=rng)

    grad_fn = jax.value_and_grad(with_offset, argnums=(0, 1), has_aux=True)
    (_, metrics), (grads, d_rel) = grad_fn(params, zeros)
    signal = measures.realm_signal(d_rel, metrics, batch["mlm_weights"], batch.get("doc_block"))
    metrics.update(signal)
    metrics.pop("retrieved_ids")
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
    cfg: StepConfig,
):
    """One optimizer step; returns (new state, metrics). The batch is prepared by the terms
    (prepare_batch), the gradient taken in one pass or over cfg.grad_accum micro-batches
    (accumulated_grads: with train.inbatch_negatives a micro-batch's queries are each other's
    negatives, as they are for the imitation term, its term then weighted by the
    micro-batch's share of the targets, as REALM's loss is)."""
    batch = prepare_batch(batch, state.step, cfg)
    rng = None  # dropout keys depend only on (seed, step): the same on any mesh
    if model.uses_dropout:
        rng = jax.random.fold_in(jax.random.key(cfg.seed), state.step)
    loss_fn = functools.partial(realm_loss, model=model, mesh=mesh, cfg=cfg)
    params, frozen = state.params, {}
    if cfg.embedders_frozen:
        loss_fn, params, frozen = reader_only(loss_fn, state.params)
    args = (loss_fn, params, batch, index_emb, index_tokens)
    if cfg.grad_accum > 1:
        grads, metrics = accumulated_grads(*args, cfg.grad_accum, mesh, rng)
    else:
        grads, metrics = one_pass_grads(*args, cfg, rng)
    grads = {**grads, **jax.tree.map(jnp.zeros_like, frozen)}  # the full tree, as the state's
    new_state = guarded_update(state, grads, metrics, optimizer)
    if frozen:
        new_state = new_state.replace(
            params=_embedders_kept(new_state.params, state.params),
            opt_state=_embedders_kept(new_state.opt_state, state.opt_state),
        )
    for name in grads:
        metrics[f"grad_norm/{name}"] = optax.tree.norm(grads[name])
    metrics["staleness"] = state.step - index_step
    return new_state, metrics


def _embedders_kept(new, old):
    """`new` (params or optimizer state) with every leaf under an embedder's key taken from
    `old`: the frozen-embedders step leaves their weights and Adam moments as they were."""

    def pick(path, n, o):
        under = any(getattr(k, "key", None) in EMBEDDERS for k in path)
        return o if under else n

    return jax.tree_util.tree_map_with_path(pick, new, old)


def frozen_steps(config) -> int:
    """The steps (0 .. n-1) the frozen-embedders step runs: train.embedders_frozen_steps when
    train.frozen_step is on (off by default: configs/realm.py says why), else none."""
    if not config.train.get("frozen_step", False):
        return 0
    return int(config.train.get("embedders_frozen_steps", 0))


def step_for(full, frozen, frozen_steps: int):
    """step -> the step function to run (Task.step_for): `frozen` for the steps before
    train.embedders_frozen_steps, when the optimizer gives the embedders no update, `full`
    from the step at which they unfreeze on (it takes their first update)."""
    return lambda step: frozen if step < frozen_steps else full


def compile_train_step(
    config,
    mesh: Mesh,
    model,
    optimizer,
    state_shardings,
    num_valid: int,
    frozen: bool = False,
):
    """jax.jit of train_step with explicit in/out shardings; the state is donated. The
    step's settings: StepConfig.from_config(config, num_valid), built here once.

    frozen=True: the variant for the steps before train.embedders_frozen_steps (StepConfig
    embedders_frozen), where the optimizer gives the embedders no update anyway
    (optimizer.scale_networks): no gradient for them, their params and Adam moments passed
    through unchanged, the same metrics (their grad_norm/... 0). Two ways it is not the full
    step's bit for bit, both because the full step took gradients it then threw away: the
    global-norm clip (train.grad_clip) and "grad_norm" see the reader's gradient alone, not
    the embedders' too (the same update when the clip does not bind); and the embedders' Adam
    moments stay as they were (zero from scratch) where the full step filled them with the
    frozen phase's gradients, so when they unfreeze their first updates are larger (the
    moments' bias correction counts every step; train.embedders_warmup_steps tempers it).

    Where we differ from the release: none, in what is computed: every candidate is still
    re-embedded with the live document embedder (forward only), as the release's step does.
    Scoring the candidates with the index's rows instead (mips.search_and_fetch's scores)
    would skip that forward too, but differs from it by the index dtype and by dropout
    (model.dropout / proj_dropout are on in training, off in the index), so it is not done."""
    cfg = StepConfig.from_config(config, num_valid)
    if frozen:
        cfg = dataclasses.replace(cfg, embedders_frozen=True)
    fn = functools.partial(train_step, model=model, optimizer=optimizer, mesh=mesh, cfg=cfg)
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
    """The forward pass alone (evaluation and tests): (params, batch, emb, tokens) -> metrics,
    REALM's loss without the experimental terms (StepConfig.without_terms)."""
    cfg = StepConfig.from_config(config, num_valid).without_terms()
    fn = functools.partial(realm_loss, model=model, mesh=mesh, cfg=cfg)
    return jax.jit(lambda *a: fn(*a)[1], out_shardings=NamedSharding(mesh, P()))
