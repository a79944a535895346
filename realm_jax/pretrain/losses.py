"""REALM's marginal likelihood (the readable definition, from materialised logits).

The pre-training loss follows the REALM release: per masked position j,
    log p(y_j | x) = logsumexp_z [ log p(z | x) + log p(y_j | x, z) ],
averaged over the real targets and negated. Candidate 0 is the null document. Training
uses ops.fused_softmax.fused_marginal_loss, which gives the same values without the logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from realm_jax.ops.fused_softmax import marginal_metrics

Array = jax.Array


def marginal_loss(relevance: Array, mlm_logits: Array, targets: Array, weights: Array):
    """REALM marginal loss and metrics from materialised logits (the readable definition;
    training uses `fused_marginal_loss`, which gives the same values without the logits).

    relevance [B, K] (candidate 0 = null doc), mlm_logits [B, K, P, V], targets [B, P],
    weights [B, P] (1 for real targets). Returns (loss, metrics dict of scalars).
    """
    log_pz = jax.nn.log_softmax(relevance.astype(jnp.float32), axis=-1)  # [B, K]
    # One log-softmax over the vocabulary serves the loss and the accuracy metric.
    log_p_vocab = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), axis=-1)  # [B, K, P, V]
    tgt = jnp.broadcast_to(targets[:, None, :, None], mlm_logits.shape[:-1] + (1,))
    log_py = jnp.take_along_axis(log_p_vocab, tgt, axis=-1)[..., 0]  # [B, K, P]
    # Prediction = argmax of the marginal distribution over the vocabulary (no gradient).
    marginal_vocab = jax.nn.logsumexp(
        jax.lax.stop_gradient(log_pz[:, :, None, None] + log_p_vocab), axis=1
    )  # [B, P, V]
    return marginal_metrics(log_pz, log_py, jnp.argmax(marginal_vocab, axis=-1), targets, weights)
