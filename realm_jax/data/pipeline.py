"""grain input pipeline for REALM pre-training: masked sentences as fixed-shape numpy batches.

Each JAX process reads only its share of the examples (`ShardByJaxProcess`); the order is a
deterministic function of the seed; the iterator state saves and restores with orbax through
`iterator_save_args` / `iterator_restore_args` (grain's own orbax handler), e.g.

    mngr.save(step, args=ocp.args.Composite(state=..., data_iter=iterator_save_args(it)))
    mngr.restore(step, args=ocp.args.Composite(state=..., data_iter=iterator_restore_args(it)))
"""

from __future__ import annotations

import dataclasses

import grain
import jax
import numpy as np

from realm_jax import tokenization as tk
from realm_jax.data import prepare as prepare_lib


@dataclasses.dataclass(frozen=True)
class MaskSpan(grain.transforms.Map):
    """One example record -> fixed-shape arrays with its salient span replaced by [MASK]."""

    query_len: int
    max_predictions: int

    def map(self, rec: dict) -> dict[str, np.ndarray]:
        q = tk.pad_to(rec["token_ids"], self.query_len)  # [query_len]
        a, b = int(rec["span_start"]), int(rec["span_end"])
        b = min(b, a + self.max_predictions - 1, self.query_len - 1)
        n = b - a + 1
        positions = np.zeros((self.max_predictions,), np.int32)  # [max_predictions]
        targets = np.zeros((self.max_predictions,), np.int32)
        weights = np.zeros((self.max_predictions,), np.float32)
        positions[:n] = np.arange(a, b + 1)
        targets[:n] = q[a : b + 1]
        weights[:n] = 1.0
        q[a : b + 1] = tk.MASK_ID
        return {
            "query_ids": q,
            "mlm_positions": positions,
            "mlm_targets": targets,
            "mlm_weights": weights,
            "block_id": np.int32(rec["block_id"]),
        }


def local_batch_size(global_batch_size: int) -> int:
    """Per-process batch size; the global batch must split evenly over processes."""
    n = jax.process_count()
    if global_batch_size % n:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the {n} JAX processes"
        )
    return global_batch_size // n


def train_loader(
    config, data_dir: str, *, global_batch_size: int, seed: int, num_epochs: int | None = None
) -> grain.DataLoader:
    """A grain DataLoader of this process's share of batches (drop_remainder).

    Batch: query_ids [b, query_len] int32, mlm_positions / mlm_targets [b, max_predictions]
    int32, mlm_weights [b, max_predictions] float32, block_id [b] int32;
    b = global_batch_size / jax.process_count().
    """
    data = config.data
    source = prepare_lib.examples_source(data_dir)
    b = local_batch_size(global_batch_size)
    if len(source) // jax.process_count() < b:
        raise ValueError(
            f"{data_dir}: {len(source)} examples cannot fill one batch of {b} per process"
        )
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        num_epochs=num_epochs,
        seed=seed,
    )
    ops = [
        MaskSpan(data.query_len, data.max_predictions),
        grain.transforms.Batch(batch_size=b, drop_remainder=True),
    ]
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=ops, worker_count=data.worker_count
    )


def iterator_save_args(it) -> grain.checkpoint.CheckpointSave:
    """orbax args that save a grain DataLoader iterator's state."""
    return grain.checkpoint.CheckpointSave(it)


def iterator_restore_args(it) -> grain.checkpoint.CheckpointRestore:
    """orbax args that restore a grain DataLoader iterator's state in place."""
    return grain.checkpoint.CheckpointRestore(it)
