"""FLOP counts from the config (no profiler): forward FLOPs of BERT encoders and REALM's step.

A multiply-add counts 2 FLOPs. Training = 3x forward for everything parameterised (forward +
backward for activations + backward for weights); retrieval's scoring has no backward.
"""

from __future__ import annotations


def encoder_flops(m, tokens: int, length: int) -> float:
    """Forward FLOPs of a BERT encoder over `tokens` tokens in sequences of `length`."""
    h, inter = m.hidden_size, m.intermediate_size
    per_token_layer = 2 * (4 * h * h + 2 * h * inter) + 2 * 2 * length * h  # dense + attention
    return float(tokens) * m.num_layers * per_token_layer


def embedder_flops(m, seqs: int, length: int) -> float:
    return encoder_flops(m, seqs * length, length) + seqs * 2 * (
        m.hidden_size**2 + m.hidden_size * m.proj_size
    )


def realm_step_flops(config, num_blocks: int) -> dict[str, float]:
    """FLOPs of one REALM train step, by part."""
    from realm_jax.model.bert import ModelConfig

    e = ModelConfig.from_config(config.model, "embedder")
    m = ModelConfig.from_config(config.model, "reader")
    d, t = config.data, config.train
    b, k = t.batch_size, t.num_candidates
    lq, lj = d.query_len, d.query_len + d.block_len - 1
    parts = {
        "query_embedder": 3 * embedder_flops(e, b, lq),
        # K-1 retrieved blocks at the block length; the null block at its own length (3).
        "doc_embedder": 3 * (embedder_flops(e, b * (k - 1), d.block_len) + embedder_flops(e, b, 3)),
        # K-1 retrieved blocks at the joint length; the null document is [CLS] x [SEP] [SEP].
        "reader": 3
        * (encoder_flops(m, b * (k - 1) * lj, lj) + encoder_flops(m, b * (lq + 1), lq + 1)),
        "mlm_head": 3
        * b
        * k
        * d.max_predictions
        * 2
        * (m.hidden_size**2 + m.hidden_size * m.vocab_size),
        "retrieval": 2.0 * b * num_blocks * m.proj_size,
    }
    parts["total"] = sum(parts.values())
    return parts
