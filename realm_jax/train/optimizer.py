"""BERT's AdamW with REALM's warmup and linear decay, clipping, no decay on LayerNorm/bias."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def warmup_steps(train_cfg) -> int:
    """BERT/REALM warmup: min(10000, max(100, steps / 10)) unless set explicitly."""
    if train_cfg.warmup_steps >= 0:
        return int(train_cfg.warmup_steps)
    return int(min(10_000, max(100, train_cfg.steps // 10)))


def learning_rate(train_cfg) -> optax.Schedule:
    """Linear warmup to lr, then linear decay to 0 at train.steps."""
    warm = warmup_steps(train_cfg)
    decay = max(1, train_cfg.steps - warm)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, train_cfg.lr, max(1, warm)),
            optax.linear_schedule(train_cfg.lr, 0.0, decay),
        ],
        [warm],
    )


def _decay_mask(params):
    """Weight decay on kernels and embeddings only; not on LayerNorm or biases."""

    def keep(path, _):
        names = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
        return not any(n in ("bias", "scale") for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


EMBEDDERS = ("query_embedder", "doc_embedder")


class ScaleNetworksState(NamedTuple):
    count: jax.Array  # optimizer steps taken (for the frozen start)


def scale_networks(
    factor: float, names=EMBEDDERS, frozen_steps: int = 0, warmup_steps: int = 0
) -> optax.GradientTransformation:
    """Multiply the updates of the named top-level networks by `factor` (their learning rate
    relative to the rest); other networks' updates pass through. frozen_steps > 0: the named
    networks take no step (factor 0, no weight decay) for the first frozen_steps updates.
    warmup_steps > 0: from then on their factor rises linearly from 0 over warmup_steps
    updates (a warmup of their own when they start training late)."""
    counted = frozen_steps > 0 or warmup_steps > 0

    def init(params):
        del params
        if not counted:
            return optax.EmptyState()
        return ScaleNetworksState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        f = factor
        if counted:
            since = (state.count - frozen_steps).astype(jnp.float32)
            ramp = jnp.clip((since + 1) / max(warmup_steps, 1), 0.0, 1.0) if warmup_steps else 1
            f = jnp.where(state.count < frozen_steps, 0.0, factor * ramp)
            state = ScaleNetworksState(count=optax.safe_int32_increment(state.count))
        return {
            k: jax.tree.map(lambda u: u * f, v) if k in names else v for k, v in updates.items()
        }, state

    return optax.GradientTransformation(init, update)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """AdamW as in BERT, with global-norm clipping; the embedders' steps scaled by
    train.embedder_lr_scale (1 = one learning rate for every network, as the release) and
    frozen for the first train.embedders_frozen_steps (a reader warm-up; 0 = none), then
    warmed up over train.embedders_warmup_steps (0 = none)."""
    extra = []
    frozen = int(train_cfg.get("embedders_frozen_steps", 0))
    warm = int(train_cfg.get("embedders_warmup_steps", 0))
    if train_cfg.embedder_lr_scale != 1.0 or frozen > 0 or warm > 0:
        extra.append(
            scale_networks(train_cfg.embedder_lr_scale, frozen_steps=frozen, warmup_steps=warm)
        )
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(
            learning_rate(train_cfg),
            b1=train_cfg.adam_b1,
            b2=train_cfg.adam_b2,
            eps=train_cfg.adam_eps,
            weight_decay=train_cfg.weight_decay,
            mask=_decay_mask,
        ),
        *extra,
    )


def freeze_networks(optimizer, names) -> optax.GradientTransformation:
    """`optimizer` for every top-level network but the named ones, which never change (no
    update, no weight decay, no optimizer state): fine-tuning's frozen document embedder."""

    def labels(params):
        return {k: "frozen" if k in names else "train" for k in params}

    return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


def reader_only(loss_fn, params):
    """(loss_fn of the other networks' params alone, those params, the embedders' params):
    a step that differentiates the reader alone (REALM's frozen-embedders step, the QA reading
    phases). The embedders still run forward (the queries' search and every candidate's live
    embedding, dropout included, as the full step's), but with their params outside the
    differentiated arguments JAX builds no backward through them: the gradient stops at the
    scores and the query embeddings."""
    frozen = {k: v for k, v in params.items() if k in EMBEDDERS}
    rest = {k: v for k, v in params.items() if k not in EMBEDDERS}

    def reader_loss(p, *args, **kwargs):
        return loss_fn({**p, **frozen}, *args, **kwargs)

    return reader_loss, rest, frozen
