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
from realm_jax.data import prepared as prepare_lib


def mask_example(rec: dict, span: int, query_len: int, max_predictions: int) -> dict:
    """One example record -> fixed-shape arrays with its salient span number `span` replaced
    by [MASK] (a span longer than max_predictions keeps its first max_predictions pieces)."""
    q = tk.pad_to(rec["token_ids"], query_len)  # [query_len]
    a, b = int(rec["span_starts"][span]), int(rec["span_ends"][span])
    b = min(b, a + max_predictions - 1, query_len - 1)
    n = b - a + 1
    positions = np.zeros((max_predictions,), np.int32)  # [max_predictions]
    targets = np.zeros((max_predictions,), np.int32)
    weights = np.zeros((max_predictions,), np.float32)
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


@dataclasses.dataclass(frozen=True)
class MaskSpan(grain.transforms.RandomMap):
    """Masks one of the example's salient spans, drawn anew each time the example is read.

    grain seeds `rng` from the sampler's seed and the record's position in the global order,
    which grows across epochs: each epoch draws its own span (as the release draws one per
    generated example), the draw is a pure function of (seed, position), and a restored
    iterator continues with exactly the draws it would have made."""

    query_len: int
    max_predictions: int

    def random_map(self, rec: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
        span = int(rng.integers(len(rec["span_starts"])))
        out = mask_example(rec, span, self.query_len, self.max_predictions)
        if "example_id" in rec:  # host-side only: the loop takes it out before the device
            out["example_id"] = np.int64(rec["example_id"])
        return out


def local_batch_size(global_batch_size: int) -> int:
    """Per-process batch size; the global batch must split evenly over processes."""
    n = jax.process_count()
    if global_batch_size % n:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the {n} JAX processes"
        )
    return global_batch_size // n


def shuffled_batches(
    source,
    transform,
    *,
    what: str,
    global_batch_size: int,
    seed: int,
    num_epochs=None,
    worker_count: int = 0,
) -> grain.DataLoader:
    """A grain DataLoader of this process's share of `source` (ShardByJaxProcess), shuffled
    by `seed` epoch after epoch, each record through `transform` (a grain Map/RandomMap),
    batched to global_batch_size / jax.process_count() with drop_remainder. `what` names
    the records in the error for a source that cannot fill a batch."""
    b = local_batch_size(global_batch_size)
    if len(source) // jax.process_count() < b:
        raise ValueError(f"{len(source)} {what} cannot fill one batch of {b} per process")
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        num_epochs=num_epochs,
        seed=seed,
    )
    ops = [transform, grain.transforms.Batch(batch_size=b, drop_remainder=True)]
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=ops, worker_count=worker_count
    )


def train_loader(
    config, data_dir: str, *, global_batch_size: int, seed: int, num_epochs: int | None = None
) -> grain.DataLoader:
    """A grain DataLoader of this process's share of masked-sentence batches.

    Batch: query_ids [b, query_len] int32, mlm_positions / mlm_targets [b, max_predictions]
    int32, mlm_weights [b, max_predictions] float32, block_id [b] int32, example_id [b] int64
    (the prepared examples' ids, kept on the host by the loop: train.record_example_ids);
    b = global_batch_size / jax.process_count().
    """
    data = config.data
    return shuffled_batches(
        prepare_lib.examples_source(data_dir),
        MaskSpan(data.query_len, data.max_predictions),
        what=f"examples in {data_dir}",
        global_batch_size=global_batch_size,
        seed=seed,
        num_epochs=num_epochs,
        worker_count=data.worker_count,
    )


def iterator_save_args(it) -> grain.checkpoint.CheckpointSave:
    """orbax args that save a grain DataLoader iterator's state."""
    return grain.checkpoint.CheckpointSave(it)


def iterator_restore_args(it) -> grain.checkpoint.CheckpointRestore:
    """orbax args that restore a grain DataLoader iterator's state in place."""
    return grain.checkpoint.CheckpointRestore(it)


def eval_batches(config, data_dir: str, *, batch_size: int, max_examples: int):
    """The held-out examples as a fixed list of this process's batches (the same every
    evaluation: the first `max_examples` (all when <= 0), whole global batches only, each
    example's span drawn by a generator seeded with its id)."""
    source = prepare_lib.examples_source(data_dir, "eval")
    n = len(source) if max_examples <= 0 else min(len(source), max_examples)
    b = local_batch_size(batch_size)
    n_batches = n // batch_size
    if n_batches == 0:
        raise ValueError(
            f"{data_dir}: {len(source)} held-out examples cannot fill one evaluation batch of "
            f"{batch_size}: lower train.eval_batch_size or raise data.eval_fraction"
        )
    d, out = config.data, []
    first = jax.process_index() * b
    for i in range(n_batches):
        recs = [source[i * batch_size + first + j] for j in range(b)]
        ex = [
            mask_example(
                r,
                int(np.random.default_rng(int(r["example_id"])).integers(len(r["span_starts"]))),
                d.query_len,
                d.max_predictions,
            )
            for r in recs
        ]
        out.append({k: np.stack([e[k] for e in ex]) for k in ex[0]})
    return out
