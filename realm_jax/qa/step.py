"""ORQA fine-tuning on REALM's machinery: one jitted, sharded step.

As ORQA (language/orqa/models/orqa_model.py): the block embeddings are frozen (the index), the
query embedder and the reader train. The question retrieves the top `retriever_beam_size`
blocks by exact MIPS over the row-sharded index (shard_map, as pre-training); the retriever
loss is the marginal log-likelihood of the blocks that contain an answer; the top
`reader_beam_size` blocks are read as `[CLS] question [SEP] title [SEP] body [SEP]` and every
span of up to max_span_width wordpieces inside the block is scored (span head + the block's
retrieval score); the reader loss is the marginal over spans equal to an answer.

Where we differ on purpose:
- Answer containment is tested on device against the token table: an answer "is in" a block
  when its wordpieces occur there consecutively (the same test ORQA's reader_inputs op uses
  for gold spans). ORQA's has_answer op searches the raw block string instead; on device there
  is no string, and a token match cannot fire inside a longer word ("art" in "party").
- A batch holds many questions (ORQA's model_fn takes one); the loss is their mean.
- qa.gold_in_beam (off by default; on in configs/orqa.py:squad): a deviation from ORQA, which
  has no gold passages (REALM and ORQA fine-tune on NQ). When a question's gold block (the
  answer-holding block of its SQuAD gold passage, qa/data.py gold_blocks) is not among the top
  R retrieved, it takes the reader beam's last slot (R - 1), with its retrieval logit computed
  from the frozen index as for any retrieved block (query . index_emb[gold]), so the joint
  span + retrieval logits stay consistent. The small reader then gets a supervised read on
  every such question instead of only the ~30% whose answer the dense top R happens to hold
  (issue 22). The retriever loss is ORQA's, over the top k as retrieved; questions without a
  gold block (-1: NQ files, or no block of the passage holds an answer) are unaffected.

Shapes: B questions, A answers of up to La wordpieces each (zero-padded), k retrieved blocks,
R read blocks, S candidate spans, Lq / Lb / Lr question / block / reader lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from realm_jax import sharding
from realm_jax.index.embedding import embed_block_tokens, embed_query_tokens
from realm_jax.model.inputs import (
    build_joint,
    check_fits,
    dropout_kwargs,
    init_inputs,
    joint_len,
)
from realm_jax.model.realm import RealmModel, realm_model
from realm_jax.ops import mips
from realm_jax.qa.losses import orqa_loss
from realm_jax.tokenization import SEP_ID
from realm_jax.train.optimizer import freeze_networks, make_optimizer, reader_only
from realm_jax.train.state import TrainState, create_sharded, guarded_update

# The networks fine-tuning leaves as they are: the document embedder made the frozen index.
FROZEN = ("doc_embedder",)


def frozen_networks(config) -> tuple[str, ...]:
    """FROZEN, or none when qa.train_doc_embedder (fine-tuning that refreshes, issue 61)."""
    return () if config.qa.get("train_doc_embedder", False) else FROZEN


def answer_starts(tokens, answers):
    """Where each answer's wordpieces start in each sequence.

    tokens [..., K, L] int; answers [..., A, La] int (wordpiece ids, zero-padded; an all-zero
    row is no answer) -> [..., K, A, L] bool: answer a occurs at positions p .. p+len-1 of
    sequence k. Leading dims broadcast (one question's answers against its K sequences)."""
    A, La = answers.shape[-2:]
    L = tokens.shape[-1]
    alen = (answers != 0).sum(-1)  # [..., A]
    pad = jnp.full(tokens.shape[:-1] + (La,), -1, tokens.dtype)
    ext = jnp.concatenate([tokens, pad], axis=-1)[..., :, None, :]  # [..., K, 1, L + La]
    ok = jnp.broadcast_to((alen > 0)[..., None, :, None], ext.shape[:-2] + (A, L))
    for j in range(La):
        piece = answers[..., None, :, j, None]  # [..., 1, A, 1]
        needed = (j < alen)[..., None, :, None]
        ok = ok & ((ext[..., j : j + L] == piece) | ~needed)
    return ok


def contains_answer(tokens, answers):
    """tokens [B, K, L], answers [B, A, La] -> [B, K] bool: some answer occurs in the block."""
    return answer_starts(tokens, answers).any(axis=(-1, -2))


def reader_input(question_ids, block_tokens, length: int):
    """`[CLS] question [SEP] title [SEP] body [SEP]` of `length` tokens for every block, and
    the block mask (the title and body wordpieces, where spans may lie).

    question_ids [B, Lq], block_tokens [B, R, Lb] -> (ids, segs, mask, block_mask), each
    [B, R, length]. As ORQA's reader_inputs op, a block cut by the length still ends with
    [SEP]."""
    ids, segs, mask = build_joint(question_ids, block_tokens, length)
    ids = ids.at[..., -1].set(jnp.where(ids[..., -1] != 0, SEP_ID, 0))
    block_mask = (segs == 1) & (ids != SEP_ID)
    return ids, segs, mask, block_mask


def span_correct(joint_ids, block_mask, answers, starts, ends):
    """[B, R, S] True where span s of block r is an answer: its wordpieces, inside the block,
    equal some answer's (ORQA: gold spans found in the reader input, matched to candidates)."""
    match = answer_starts(joint_ids, answers) & block_mask[..., None, :]  # [B,R,A,L]
    alen = (answers != 0).sum(-1)  # [B, A]
    width = jnp.asarray(ends - starts + 1)
    hit = match[..., jnp.asarray(starts)] & (width[None, None, None] == alen[:, None, :, None])
    return hit.any(axis=2)


def retrieve(params, question_ids, index_emb, *, model, mesh, k, num_valid, rng=None):
    """Top-k blocks by exact MIPS: (block ids [B, k], retrieval logits [B, k] (differentiable
    in the query embedder; the index is frozen), query embeddings [B, D]). No tokens: the
    caller fetches those of the blocks it reads (fetch_rows) and tests the rest where they
    live (block_has_answer)."""
    q = embed_query_tokens(model, params, question_ids, rng)  # [B, D]
    none = jnp.full((q.shape[0],), -1, jnp.int32)
    _, ids = mips.search(mesh, jax.lax.stop_gradient(q), index_emb, none, k=k, num_valid=num_valid)
    # [B, k, D] rows of the beam for a differentiable logit: B x k x D x 4 bytes all-reduced
    # (164 MB at base: 64 x 5000 x 128), the step's largest fetch now the tokens are not
    rows = mips.fetch_rows(mesh, index_emb, ids)
    return ids, jnp.einsum("bd,bkd->bk", q, rows.astype(q.dtype)), q


def insert_gold(q, ids, logits, gold, index_emb, *, mesh):
    """qa.gold_in_beam: the reader beam with each question's gold block in its last slot where
    retrieval missed it (a deviation from ORQA; see the module docstring).

    q [B, D] query embeddings; ids / logits [B, R]: the top R retrieved; gold [B] int32 (-1:
    none). The gold block's row is gathered from the row-sharded index like any retrieved
    block's (fetch_rows), its logit is q . index_emb[gold] (differentiable in the query
    embedder, as the retrieved ones); its tokens come with the other read blocks'. Shapes do
    not change. Returns (ids, logits, inserted [B] bool)."""
    last = ids.shape[1] - 1
    inserted = (gold >= 0) & ~(ids == gold[:, None]).any(axis=1)
    safe = jnp.maximum(gold, 0)[:, None]  # [B, 1]; a -1 row reads block 0, then is dropped
    row = mips.fetch_rows(mesh, index_emb, safe)[:, 0]  # [B, D]
    logit = jnp.einsum("bd,bd->b", q, row.astype(q.dtype)).astype(logits.dtype)
    ids = ids.at[:, last].set(jnp.where(inserted, gold, ids[:, last]))
    logits = logits.at[:, last].set(jnp.where(inserted, logit, logits[:, last]))
    return ids, logits, inserted


def read(params, question_ids, block_tokens, *, model, length: int, rng=None):
    """The reader's span scores: (logits [B, R, S] (float32 min outside the block), starts
    [S], ends [S] (reader positions), reader ids [B, R, length], block mask [B, R, length])."""
    B, R, _ = block_tokens.shape
    ids, segs, mask, bmask = reader_input(question_ids, block_tokens, length)

    def flat(x):
        return x.reshape(B * R, length)

    logits, starts, ends = model.apply(
        {"params": params},
        flat(ids),
        flat(segs),
        flat(mask),
        flat(bmask),
        method=RealmModel.span_logits,
        **dropout_kwargs(rng, 2),
    )
    return logits.reshape(B, R, -1), starts, ends, ids, bmask


def qa_loss(
    params,
    batch,
    index_emb,
    index_tokens,
    *,
    model,
    mesh,
    beams,
    length,
    num_valid,
    rng,
    gold_in_beam=False,
    fresh=0,
    details=False,
):
    """ORQA's loss for a batch of questions; returns (loss, metrics). beams = (retriever beam
    k, reader beam R). gold_in_beam (qa.gold_in_beam): batch["gold_block"] [B] (-1: none)
    takes the reader beam's last slot where retrieval missed it (insert_gold); the metrics
    then hold gold_in_beam_rate, the share of questions whose gold block was inserted.
    details: the metrics also hold read_ids / read_relevance [B, R] (the blocks read and their
    retrieval logits) and query_emb [B, D], for inspection and tests (not for the loop's logs).
    fresh (qa.train_doc_embedder: the reader beam R): the top `fresh` retrieved blocks are
    embedded again from their tokens with the current document embedder, their logits
    q . e differentiable in both embedders (RAG-end2end's doc-encoder gradient); the rest of
    the beam keeps the index's (stale) rows, as REALM's candidates between refreshes."""
    k, R = beams
    q_ids, answers = batch["question_ids"], batch["answer_ids"]
    ids, r_logits, q = retrieve(
        params, q_ids, index_emb, model=model, mesh=mesh, k=k, num_valid=num_valid, rng=rng
    )
    if fresh:
        F = min(int(fresh), k)
        tok = mips.fetch_rows(mesh, index_tokens, ids[:, :F])  # [B, F, Lb]
        B_, _, Lb = tok.shape
        e = embed_block_tokens(model, params, tok.reshape(B_ * F, Lb), rng)
        e = e.reshape(B_, F, -1)
        r_logits = r_logits.at[:, :F].set(jnp.einsum("bd,bfd->bf", q, e.astype(q.dtype)))
    r_correct = block_has_answer(ids, answers, index_tokens, mesh=mesh)  # [B, k]
    read_ids, rel = ids[:, :R], r_logits[:, :R]
    if gold_in_beam:  # a deviation from ORQA (the module docstring); the retriever loss stays
        read_ids, rel, inserted = insert_gold(
            q, read_ids, rel, batch["gold_block"], index_emb, mesh=mesh
        )
    read_tokens = mips.fetch_rows(mesh, index_tokens, read_ids)  # [B, R, Lb]: R, not k, rows
    logits, starts, ends, j_ids, bmask = read(
        params, q_ids, read_tokens, model=model, length=length, rng=rng
    )
    s_correct = span_correct(j_ids, bmask, answers, starts, ends)  # [B, R, S]
    total, retriever, reader = orqa_loss(r_logits, r_correct, logits, s_correct, rel)
    B = q_ids.shape[0]
    joint = (logits + rel[..., None]).reshape(B, -1)
    best = jnp.argmax(joint, axis=-1)
    metrics = {
        "loss": total.mean(),
        "retriever_loss": retriever.mean(),
        "reader_loss": reader.mean(),
        # ORQA's training-time metrics: the predicted span is an answer (token level), some
        # read span is (reader oracle), some retrieved / top-R block holds one (retrieval's
        # own top R, before any gold block is inserted)
        "exact_match": jnp.take_along_axis(s_correct.reshape(B, -1), best[:, None], 1).mean(),
        "reader_oracle": s_correct.any(axis=(1, 2)).mean(),
        "retriever_recall": r_correct.any(axis=1).mean(),
        "reader_beam_recall": r_correct[:, :R].any(axis=1).mean(),
    }
    if gold_in_beam:
        metrics["gold_in_beam_rate"] = inserted.astype(jnp.float32).mean()
    if details:
        metrics.update(read_ids=read_ids, read_relevance=rel, query_emb=q)
    return metrics["loss"], metrics


def train_step(
    state: TrainState,
    batch,
    index_emb,
    index_tokens,
    *,
    model,
    optimizer,
    seed,
    frozen=FROZEN,
    reader_only_step=False,
    **kw,
):
    """One optimizer step; returns (new state, metrics). frozen: the networks the optimizer
    leaves as they are (frozen_networks), whose gradient norms are not logged.
    reader_only_step (reads_alone: train.embedder_lr_scale 0, the reading phases): the step
    differentiates the reader alone; the embedders run forward only, as REALM's
    frozen-embedders step (train/optimizer.py reader_only), so no backward pass runs through
    the query embedder (for all-MiniLM-L6-v2, by a FLOP estimate the larger part of the step).
    Their updates were zero either way: the same parameters, the embedders' Adam moments left
    at zero."""
    rng = None
    if model.uses_dropout:
        rng = jax.random.fold_in(jax.random.key(seed), state.step)
    loss_fn = functools.partial(qa_loss, model=model, rng=rng, **kw)
    params, fixed = state.params, {}
    if reader_only_step:
        loss_fn, params, fixed = reader_only(loss_fn, state.params)
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch, index_emb, index_tokens
    )
    grads = {**grads, **jax.tree.map(jnp.zeros_like, fixed)}  # the full tree, as the state's
    new_state = guarded_update(state, grads, metrics, optimizer)
    for name in grads:
        if name not in frozen and name not in fixed:
            metrics[f"grad_norm/{name}"] = optax.tree.norm(grads[name])
    return new_state, metrics


def reads_alone(config) -> bool:
    """Whether fine-tuning trains the reader alone: train.embedder_lr_scale 0 (configs/orqa.py's
    reading phases), when the query embedder's updates are zero at every step."""
    return float(config.train.embedder_lr_scale) == 0.0


def reader_len(config) -> int:
    """qa.reader_len, or the pre-training joint length when 0."""
    return int(config.qa.reader_len) or joint_len(config)


def step_kwargs(config, mesh: Mesh, num_valid: int) -> dict:
    """The static arguments of qa_loss / train_step that the config decides."""
    q = config.qa
    return dict(
        mesh=mesh,
        beams=(int(q.retriever_beam_size), int(q.reader_beam_size)),
        length=reader_len(config),
        num_valid=num_valid,
        gold_in_beam=bool(q.get("gold_in_beam", False)),
        fresh=int(q.reader_beam_size) if q.get("train_doc_embedder", False) else 0,
    )


def check_config(config, model: RealmModel, num_blocks: int, mesh: Mesh) -> None:
    """Beams, lengths and the corpus agree (a clear error before any work)."""
    q = config.qa
    k, R = int(q.retriever_beam_size), int(q.reader_beam_size)
    if not 1 <= R <= k:
        raise ValueError(
            f"qa.reader_beam_size ({R}) must be between 1 and qa.retriever_beam_size ({k})"
        )
    E = int(q.get("eval_reader_beam_size", 0))
    if not 0 <= E <= k:
        raise ValueError(
            f"qa.eval_reader_beam_size ({E}) must be between 0 (qa.reader_beam_size's) and "
            f"qa.retriever_beam_size ({k})"
        )
    if k > num_blocks:
        raise ValueError(
            f"qa.retriever_beam_size = {k} exceeds the corpus ({num_blocks} blocks): lower it"
        )
    Lr = reader_len(config)
    if Lr < config.data.query_len + 3:
        raise ValueError(f"qa.reader_len = {Lr} leaves no room for a block after the question")
    check_fits("qa.reader_len", Lr, model.cfg, "reader")
    check_fits("data.query_len", config.data.query_len, model.ecfg, "embedder", "query")


def state_parts(config):
    """(model, optimizer, init_params(rng) -> boxed params): all three networks (checkpoints
    look like pre-training's), the document embedder frozen by the optimizer."""
    model = realm_model(config.model)
    optimizer = freeze_networks(make_optimizer(config.train), frozen_networks(config))
    d = config.data
    inputs = init_inputs(d.query_len, d.block_len, reader_len(config))
    return model, optimizer, lambda r: model.init(r, *inputs)["params"]


def create_state(config, mesh: Mesh, rng, params_hook=None):
    """(model, optimizer, state, shardings), created sharded."""
    model, optimizer, init_params = state_parts(config)
    state, shardings = create_sharded(
        mesh, init_params, optimizer, rng, params_hook, fsdp=config.mesh.get("fsdp", False)
    )
    return model, optimizer, state, shardings


def compile_train_step(config, mesh: Mesh, model, optimizer, state_shardings, num_valid: int):
    """jax.jit of train_step with explicit in/out shardings; the state is donated."""
    fn = functools.partial(
        train_step,
        model=model,
        optimizer=optimizer,
        seed=config.train.seed,
        frozen=frozen_networks(config),
        reader_only_step=reads_alone(config),
        **step_kwargs(config, mesh, num_valid),
    )
    rows = sharding.rows_sharding(mesh)
    jitted = jax.jit(
        fn,
        in_shardings=(state_shardings, sharding.batch_sharding(mesh), rows, rows),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )
    return sharding.traced_in_mesh(jitted, mesh)


def predict(
    params,
    question_ids,
    block_ids,
    index_emb,
    index_tokens,
    retrieval=None,
    *,
    model,
    mesh,
    length,
):
    """Read the given blocks (any retriever's: the dense top-R, BM25's) and pick the best span
    of all, scored as in training (span score + the block's retrieval score, ORQA's
    get_predictions). retrieval [B, R]: the blocks' retrieval scores to add instead of the
    dense relevance (BM25's, scaled by qa.bm25_weight); None: the dense relevance, as ORQA.
    Returns a dict: relevance [B, R] (the dense relevance), best_block [B] (index into
    block_ids), start / end [B] (block-token positions, the block's [CLS] at 0), score [B],
    and each block's own best span: block_span_score [B, R] (the reader's span logit alone),
    block_start / block_end [B, R]."""
    q = embed_query_tokens(model, params, question_ids)
    rows = mips.fetch_rows(mesh, index_emb, block_ids)
    tokens = mips.fetch_rows(mesh, index_tokens, block_ids)
    rel = jnp.einsum("bd,bkd->bk", q, rows.astype(q.dtype))
    added = rel if retrieval is None else retrieval.astype(rel.dtype)
    logits, starts, ends, _, _ = read(params, question_ids, tokens, model=model, length=length)
    B, _, S = logits.shape
    joint = (logits + added[..., None]).reshape(B, -1)
    best = jnp.argmax(joint, axis=-1)
    span = best % S
    qlen = (question_ids != 0).sum(-1)  # reader position p holds block token p - qlen + 1
    starts, ends = jnp.asarray(starts), jnp.asarray(ends)
    own = jnp.argmax(logits, axis=-1)  # [B, R]: each block's best span
    return {
        "relevance": rel,
        "best_block": best // S,
        "start": starts[span] - qlen + 1,
        "end": ends[span] - qlen + 1,
        "score": jnp.max(joint, axis=-1),
        "block_span_score": jnp.max(logits, axis=-1),
        "block_start": starts[own] - qlen[:, None] + 1,
        "block_end": ends[own] - qlen[:, None] + 1,
    }


def search(params, question_ids, index_emb, index_tokens, *, model, mesh, k, num_valid):
    """Dense top-k: (block ids [B, k], scores [B, k]), best first (index_tokens unused: the
    evaluator's calls pass it; no tokens are fetched)."""
    del index_tokens
    q = embed_query_tokens(model, params, question_ids)
    none = jnp.full((q.shape[0],), -1, jnp.int32)
    scores, ids = mips.search(mesh, q, index_emb, none, k=k, num_valid=num_valid)
    return ids, scores


def dense_scores(params, question_ids, block_ids, index_emb, *, model, mesh):
    """The dense relevance q . e of any blocks block_ids [B, n] -> [B, n] (the hybrid
    retriever rescores blocks that BM25 found and the dense top-k did not)."""
    q = embed_query_tokens(model, params, question_ids)
    rows = mips.fetch_rows(mesh, index_emb, block_ids)
    return jnp.einsum("bd,bkd->bk", q, rows.astype(q.dtype))


def block_has_answer(block_ids, answers, index_tokens, *, mesh):
    """[B, k] whether each block holds an answer (the retriever loss's targets, recall@k), for
    any retriever's ids [B, k]; answers [B, A, La]. Tested on the device that owns each block
    (mips.owner_test): [B, k] flags cross the mesh, not the beam's [B, k, Lb] tokens (at base,
    64 x 5000 x 288 ids: 369 MB int32 a step). Each device still matches [B, k, Lb] against
    the answers (zeros where it owns no block), as every device did with the tokens fetched."""
    return mips.owner_test(mesh, index_tokens, block_ids, contains_answer, answers)
