"""Tiny synthetic REALM inputs shared by the train-step tests and the multi-process worker."""

import os

import numpy as np

from realm_jax.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_OVERRIDES = [
    "model.vocab_size=512",
    "model.embedder.hidden_size=32",
    "model.reader.hidden_size=32",
    "model.embedder.num_heads=2",
    "model.reader.num_heads=2",
    "model.embedder.num_layers=1",
    "model.reader.num_layers=1",
    "model.embedder.intermediate_size=64",
    "model.reader.intermediate_size=64",
    "model.embedder.max_position_embeddings=64",
    "model.reader.max_position_embeddings=64",
    "model.proj_dropout=0.0",
    "data.block_len=16",
    "data.query_len=12",
    "data.max_predictions=3",
    "train.batch_size=8",
    "train.num_candidates=4",
    "train.warmup_steps=0",
    "train.steps=10",
]


def tiny_networks(*nets: str, max_positions: int = 128) -> list[str]:
    """A 1 x 32 BERT (2 heads, 64 wide in between) for each of `nets` ("embedder", "reader"):
    the config overrides."""
    return [
        f"model.{net}.{key}={value}"
        for net in nets
        for key, value in (
            ("hidden_size", 32),
            ("num_layers", 1),
            ("num_heads", 2),
            ("intermediate_size", 64),
            ("max_position_embeddings", max_positions),
        )
    ]


# One 1 x 32 BERT for the embedders and the reader, positions up to 128: the end-to-end tests
# model (tests/test_trainer.py, tests/test_qa_finetune.py).
TINY_NETWORKS = tiny_networks("embedder", "reader")
NUM_BLOCKS = 61  # not a multiple of 8: exercises index padding


def tiny_config(*extra):
    return load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"), CONFIG_OVERRIDES + list(extra)
    )


def synthetic_index(config, seed=0):
    """Token table [N, Lb] of `[CLS] title [SEP] body [SEP]` and random embeddings [N, 128]."""
    rng = np.random.default_rng(seed)
    lb = config.data.block_len
    tokens = np.zeros((NUM_BLOCKS, lb), np.int32)
    for i in range(NUM_BLOCKS):
        n_title, n_body = rng.integers(1, 4), rng.integers(2, lb - 7)
        row = [101, *rng.integers(200, 500, n_title), 102, *rng.integers(200, 500, n_body), 102]
        tokens[i, : len(row)] = row
    emb = rng.normal(size=(NUM_BLOCKS, config.model.proj_size)).astype(np.float32)
    return emb, tokens


def synthetic_batch(config, seed=1):
    """A global batch of masked queries with 1-3 targets each."""
    rng = np.random.default_rng(seed)
    b, lq, p = config.train.batch_size, config.data.query_len, config.data.max_predictions
    q = np.zeros((b, lq), np.int32)
    pos = np.zeros((b, p), np.int32)
    tgt = np.zeros((b, p), np.int32)
    w = np.zeros((b, p), np.float32)
    for i in range(b):
        n = rng.integers(5, lq - 1)
        q[i, :n] = [101, *rng.integers(200, 500, n - 2), 102]
        m = rng.integers(1, p + 1)
        at = rng.choice(np.arange(1, n - 1), size=m, replace=False)
        pos[i, :m], tgt[i, :m], w[i, :m] = at, q[i, at], 1.0
        q[i, at] = 103
    block_id = rng.integers(-1, NUM_BLOCKS, size=b).astype(np.int32)
    return dict(query_ids=q, mlm_positions=pos, mlm_targets=tgt, mlm_weights=w, block_id=block_id)
