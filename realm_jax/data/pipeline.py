"""grain input pipeline for REALM pre-training: masked sentences as fixed-shape numpy batches.

The order of the global batches is a deterministic function of the seed alone
(`GlobalBatchSampler`): global batch t is the same examples, with the same span draws, whatever
the number of JAX processes or grain workers reading it, and process p of P reads rows
[p*B/P, (p+1)*B/P) of it. So a checkpoint's iterator state translates to another process count
(a pod slice with another host count) or worker count: `iterator_restore_args` restores any
process's saved state onto this process, e.g.

    mngr.save(step, args=ocp.args.Composite(state=..., data_iter=iterator_save_args(it)))
    mngr.restore(step, args=ocp.args.Composite(state=..., data_iter=iterator_restore_args(it)))

The saved files are grain's own (`process_{i}-of-{n}.json`, grain's DataLoader state).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from realm_jax import tokenization as tk
from realm_jax.checkpoint import CheckpointMismatch
from realm_jax.config import ConfigError
from realm_jax.data import datasets, masking

log = logging.getLogger(__name__)


def mask_positions(q: np.ndarray, positions: np.ndarray, max_predictions: int) -> dict:
    """Replace `positions` (sorted, at most max_predictions) of the padded query `q` by [MASK]
    in place; the MLM arrays, padded to max_predictions. Every masked piece becomes [MASK]
    in every mode: BERT's 80/10/10 replacement is not used, so that the masking modes differ
    only in which tokens are masked."""
    n = len(positions)
    out = np.zeros((max_predictions,), np.int32)  # [max_predictions]
    targets = np.zeros((max_predictions,), np.int32)
    weights = np.zeros((max_predictions,), np.float32)
    out[:n] = positions
    targets[:n] = q[positions]
    weights[:n] = 1.0
    q[positions] = tk.MASK_ID
    return {
        "query_ids": q,
        "mlm_positions": out,
        "mlm_targets": targets,
        "mlm_weights": weights,
    }


def mask_example(rec: dict, span: int, query_len: int, max_predictions: int) -> dict:
    """One example record -> fixed-shape arrays with its salient span number `span` replaced
    by [MASK] (a span longer than max_predictions keeps its first max_predictions pieces)."""
    q = tk.pad_to(rec["token_ids"], query_len)  # [query_len]
    a, b = int(rec["span_starts"][span]), int(rec["span_ends"][span])
    b = min(b, a + max_predictions - 1, query_len - 1)
    out = mask_positions(q, np.arange(a, b + 1), max_predictions)
    return {**out, "block_id": np.int32(rec["block_id"])}


def mask_record(
    rec: dict, rng: np.random.Generator, mode: str, query_len: int, max_predictions: int
) -> dict:
    """One example record masked by data.mask_mode `mode` with draws from `rng`: "salient"
    one of its stored spans (mask_example), "random_span" / "uniform" positions chosen from
    its wordpieces (data/masking.py)."""
    if mode == "salient":  # the draw salient masking has always made: bit-identical batches
        span = int(rng.integers(len(rec["span_starts"])))
        return mask_example(rec, span, query_len, max_predictions)
    q = tk.pad_to(rec["token_ids"], query_len)  # [query_len]
    positions = masking.choose_positions(mode, q, rng, max_predictions)
    out = mask_positions(q, positions, max_predictions)
    return {**out, "block_id": np.int32(rec["block_id"])}


ROW_KEYS = ("block_id", "extra_ids", "article_block")  # an example's fields naming blocks


def to_positions(out: dict, positions: np.ndarray) -> dict:
    """An example's block ids (prepared rows; -1 none) as positions of an updated corpus
    version (versions.View.positions; -1 where the version no longer serves the block)."""
    out = dict(out)
    for key in ROW_KEYS:
        if key in out:
            v = np.asarray(out[key])
            out[key] = np.where(v >= 0, positions[np.maximum(v, 0)], -1).astype(v.dtype)
    return out


@dataclasses.dataclass(frozen=True)
class MaskSpan(grain.transforms.RandomMap):
    """Masks the example by `mask_mode` (data.mask_mode; default REALM's salient span), drawn
    anew each time the example is read.

    grain seeds `rng` from the sampler's seed and the record's position in the global order,
    which grows across epochs: each epoch draws its own mask (as the release draws one span
    per generated example), the draw is a pure function of (seed, position), and a restored
    iterator continues with exactly the draws it would have made."""

    query_len: int
    max_predictions: int
    mask_mode: str = "salient"
    # title -> block id: each example also gets gold_block, its own block or, for a separate
    # text's sentence, the first block of its document's title (-1: none), which REALM's
    # copying curriculum puts among the candidates (train.own_block_steps); None: no gold_block
    gold_of: dict | None = None
    # a second retriever's candidates per (example, span) (data/span_candidates.py): each
    # example also gets extra_ids [m], those of the span it is masked at (train.bm25_candidates;
    # none when m = 0), and article_block, a block of its article holding that span (-1 none;
    # train.article_block_steps)
    extra: object = None  # SpanCandidates or None
    # an updated corpus version's position of each prepared block id (versions.View.positions:
    # -1 for a block it no longer serves): the example's own block, its second retriever's
    # blocks and its article's block, all prepared rows, are read as positions in that version
    positions: np.ndarray | None = None

    def __post_init__(self):
        masking.check_mask_mode(self.mask_mode)  # before any record is read
        if self.extra is not None and self.mask_mode != "salient":
            raise ConfigError(
                f"train.bm25_candidates needs data.mask_mode=salient (its candidates are "
                f"retrieved per salient span), not {self.mask_mode!r}"
            )

    def random_map(self, rec: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
        if self.extra is None:
            out = mask_record(rec, rng, self.mask_mode, self.query_len, self.max_predictions)
        else:  # mask_record's salient draw, the span kept for its candidates
            span = int(rng.integers(len(rec["span_starts"])))
            out = mask_example(rec, span, self.query_len, self.max_predictions)
            row = self.extra.row(int(rec["example_id"]), span)
            if self.extra.depth:
                out["extra_ids"] = np.asarray(self.extra.ids[row])
            if self.extra.article is not None:  # the copying curriculum's block for it
                out["article_block"] = np.int32(self.extra.article[row])
        if self.gold_of is not None:
            out["gold_block"] = np.int32(gold_block(rec, self.gold_of, self.positions))
        if self.positions is not None:
            out = to_positions(out, self.positions)
        if "example_id" in rec:  # host-side only: the loop takes it out before the device
            out["example_id"] = np.int64(rec["example_id"])
        return out


def gold_block(rec: dict, gold_of: dict, positions: np.ndarray | None = None) -> int:
    """An example's own block, else the first block of its document's title (gold_of's
    blocks: positions of the version read, when `positions` maps rows to them), else -1."""
    own = int(rec["block_id"])
    if own >= 0 and positions is not None:
        own = int(positions[own])  # -1: an update deleted or replaced it
    if own >= 0:
        return own
    title = rec.get("title", b"")
    return int(gold_of.get(title.decode("utf-8") if isinstance(title, bytes) else title, -1))


def local_batch_size(global_batch_size: int) -> int:
    """Per-process batch size; the global batch must split evenly over processes."""
    n = jax.process_count()
    if global_batch_size % n:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the {n} JAX processes"
        )
    return global_batch_size // n


class GlobalBatchSampler:
    """A grain sampler whose global batches do not depend on the process or worker count.

    Global position g = 0, 1, 2, ... is record `MapDataset.range(N).shuffle(seed)[g]`
    (reshuffled each epoch) with its RandomMap rng seeded by seed + g: exactly the order of a
    one-process grain IndexSampler(shuffle=True, seed). Global batch t is positions
    [t*B, (t+1)*B), and process p of P reads rows [p*b, (p+1)*b) of it (b = B/P).

    Where this differs from grain's IndexSampler with ShardByJaxProcess (what realm-jax used
    before): that one cuts the records into P contiguous shards shuffled apart, so with more
    than one process its order depends on P and a saved position means nothing to another
    process count. Here `__getitem__` undoes grain's own striping instead: the DataLoader asks
    for index k*P + p for process p's k-th record, and with W worker processes worker w
    batches the records w, w+W, w+2W, ... and the batches come out round robin. So batch t is
    the same for every (P, W), and a saved position moves between them.
    """

    def __init__(
        self,
        num_records: int,
        *,
        global_batch_size: int,
        seed: int,
        process_count: int,
        worker_count: int = 0,
        num_epochs: int | None = None,
    ):
        if global_batch_size % process_count:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the "
                f"{process_count} JAX processes"
            )
        self.num_records = num_records
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_epochs = num_epochs
        self.process_count = process_count
        self.worker_count = worker_count  # grain's: 0 = in-process (one stream, like W = 1)
        self.local_batch_size = global_batch_size // process_count
        self._keys = grain.MapDataset.range(num_records).shuffle(seed=seed)
        # Whole global batches only (drop_remainder), so that every process ends together.
        self._len = (
            sys.maxsize
            if num_epochs is None
            else num_epochs * num_records // global_batch_size * global_batch_size
        )

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        # grain validates a restored state against repr(sampler): only what fixes the global
        # order belongs here, not the process or worker count (a state moves between those).
        return (
            f"GlobalBatchSampler(num_records={self.num_records}, "
            f"global_batch_size={self.global_batch_size}, seed={self.seed}, "
            f"num_epochs={self.num_epochs})"
        )

    def global_position(self, index: int) -> int:
        """The global position of the record grain asks for as sampler index `index`."""
        p, k = index % self.process_count, index // self.process_count
        workers = max(self.worker_count, 1)
        w, m = k % workers, k // workers  # worker w's m-th record
        q, r = divmod(m, self.local_batch_size)  # row r of worker w's q-th batch
        t = q * workers + w  # this process's t-th batch: global batch t
        return t * self.global_batch_size + p * self.local_batch_size + r

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        if index < 0 or index >= self._len:
            raise IndexError(f"sampler index {index} out of range [0, {self._len})")
        g = self.global_position(index)
        return grain.RecordMetadata(
            index=index,
            record_key=int(self._keys[g]),
            rng=np.random.Generator(np.random.Philox(key=self.seed + g)),
        )


class ShardedLoader(grain.DataLoader):
    """grain's DataLoader over a GlobalBatchSampler; its iterators carry the sampler
    (`global_sampler`), which `iterator_restore_args` needs to move a saved position to
    another process or worker count."""

    def __init__(self, *, sampler: GlobalBatchSampler, **kwargs):
        super().__init__(sampler=sampler, **kwargs)
        self.global_sampler = sampler

    def __iter__(self):
        it = super().__iter__()
        it.global_sampler = self.global_sampler
        return it


def shuffled_batches(
    source,
    transform,
    *,
    what: str,
    global_batch_size: int,
    seed: int,
    num_epochs=None,
    worker_count: int = 0,
) -> ShardedLoader:
    """A grain DataLoader of this process's rows of the global batches of `source`, shuffled
    by `seed` epoch after epoch (GlobalBatchSampler), each record through `transform` (a grain
    Map/RandomMap), batched to global_batch_size / jax.process_count(). `what` names the
    records in the error for a source that cannot fill a global batch. With `num_epochs`, the
    whole global batches of that many epochs (with worker_count > 0 the last few may be
    dropped: each worker drops its own remainder)."""
    b = local_batch_size(global_batch_size)
    if len(source) < global_batch_size:
        raise ValueError(
            f"{len(source)} {what} cannot fill one batch of {global_batch_size} ({b} per process)"
        )
    shard = grain.sharding.ShardByJaxProcess()
    sampler = GlobalBatchSampler(
        len(source),
        global_batch_size=global_batch_size,
        seed=seed,
        process_count=shard.shard_count,
        worker_count=worker_count,
        num_epochs=num_epochs,
    )
    ops = [transform, grain.transforms.Batch(batch_size=b, drop_remainder=True)]
    return ShardedLoader(
        data_source=source,
        sampler=sampler,
        operations=ops,
        worker_count=worker_count,
        shard_options=shard,
    )


def train_loader(
    config,
    data_dir: str,
    *,
    global_batch_size: int,
    seed: int,
    num_epochs: int | None = None,
    gold_of: dict | None = None,
    extra=None,
    positions: np.ndarray | None = None,
) -> grain.DataLoader:
    """A grain DataLoader of this process's share of masked-sentence batches.

    Batch: query_ids [b, query_len] int32, mlm_positions / mlm_targets [b, max_predictions]
    int32, mlm_weights [b, max_predictions] float32, block_id [b] int32, example_id [b] int64
    (the prepared examples' ids, kept on the host by the loop: train.record_example_ids);
    b = global_batch_size / jax.process_count(). With gold_of (title -> block id), also
    gold_block [b] int32 (MaskSpan). With extra (data/span_candidates.SpanCandidates), also
    extra_ids [b, m] int32: a second retriever's blocks for the span masked (-1: none).
    With positions (versions.View.positions), every block id is a position of that corpus
    version (to_positions).

    On a gs:// data_dir the examples are read in place, record by record, as the batches
    want them (datasets.ShardedSource): no host copies the examples first. A process's rows
    of the global batches come from one shuffle of the whole example set (GlobalBatchSampler),
    so every host reads records of every shard (no per-host partition of the files: one would
    tie the order to the host count), but each record of an epoch is read by one host only:
    1/hosts of the examples a host, one GCS read a record.
    """
    data = config.data
    # before the data is opened: an unknown data.mask_mode is a config error, not a data one
    mode = data.get("mask_mode", "salient")
    mask = MaskSpan(data.query_len, data.max_predictions, mode, gold_of, extra, positions)
    return shuffled_batches(
        datasets.examples_source(data_dir),
        mask,
        what=f"examples in {data_dir}",
        global_batch_size=global_batch_size,
        seed=seed,
        num_epochs=num_epochs,
        worker_count=data.worker_count,
    )


# ----------------------------------------------------------- iterator state, any process count

_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")  # grain's handler's file names


def batches_consumed(state: dict, process_index: int, process_count: int, local_batch: int) -> int:
    """How many batches the DataLoader iterator whose saved `state` (grain's DataLoader state,
    as process `process_index` of `process_count` saved it, `local_batch` rows a batch) had
    handed out: the global batch it resumes at. ValueError when the state is not one a
    DataLoader over whole batches leaves (then it is not translated)."""
    workers, last = int(state["worker_count"]), state["last_seen_indices"]
    p, n_proc = process_index, process_count
    if workers == 0:  # grain: last seen = p - P + records * P
        per_worker = [(int(last["0"]) - p + n_proc, n_proc)]
    else:  # worker i: last seen = p - W*P + i*P + records_i * W*P
        per_worker = [
            (int(last[str(i)]) - p - i * n_proc + workers * n_proc, workers * n_proc)
            for i in range(workers)
        ]
    records = []
    for offset, stride in per_worker:
        if offset < 0 or offset % stride:
            raise ValueError(f"data iterator state {last} is not process {p} of {n_proc}'s")
        records.append(offset // stride)
    if any(r % local_batch for r in records):
        raise ValueError(f"data iterator state {last} is not at a whole batch of {local_batch}")
    n = sum(r // local_batch for r in records)
    want = loader_state(state, n, p, n_proc, workers, local_batch, state["sampler"])
    if want["last_seen_indices"] != {str(k): int(v) for k, v in last.items()}:
        raise ValueError(f"data iterator state {last} is not a round-robin position of workers")
    return n


def loader_state(
    saved: dict,
    batches: int,
    process_index: int,
    process_count: int,
    worker_count: int,
    local_batch: int,
    sampler_repr: str,
) -> dict:
    """grain's DataLoader state of process `process_index` of `process_count` (`worker_count`
    workers, `local_batch` rows a batch) after `batches` batches; the other fields (grain's
    version, the data source) as in `saved`. The inverse of batches_consumed."""
    p, n_proc, workers = process_index, process_count, worker_count
    if workers == 0:
        last = {"0": p - n_proc + batches * local_batch * n_proc}
        last_worker = -1
    else:  # round robin: worker i has made ceil((batches - i) / W) of them
        last = {
            str(i): p
            - workers * n_proc
            + i * n_proc
            + (batches - i + workers - 1) // workers * local_batch * workers * n_proc
            for i in range(workers)
        }
        last_worker = batches % workers - 1
    return {
        **saved,
        "last_seen_indices": last,
        "last_worker_index": last_worker,
        "worker_count": workers,
        "sampler": sampler_repr,
    }


def _legacy_order(saved: dict, sampler: GlobalBatchSampler) -> str | None:
    """How a state saved by an IndexSampler (realm-jax before GlobalBatchSampler) relates to
    `sampler`'s order: "exact" at one process and no worker with the same records and seed
    (the same order), "approximate" at another process or worker count (its order depended on
    them), "other" for other records or another seed; None for a state not an IndexSampler's."""
    m = re.match(
        r"IndexSampler\(num_records=(\d+),.*shard_count=(\d+),.*seed=(\d+)\)", saved["sampler"]
    )
    if m is None:
        return None
    if (int(m[1]), int(m[3])) != (sampler.num_records, sampler.seed):
        return "other"
    return "exact" if int(m[2]) == 1 and int(saved["worker_count"]) == 0 else "approximate"


def _read_saved_state(directory: epath.Path) -> tuple[dict, int, int]:
    """(state, process index, process count) of the saved state this process resumes from:
    its own file when the checkpoint was written by as many processes as this job has (exactly
    grain's handler), else the lowest-numbered process's file of the checkpoint's count (every
    process of a run is at the same global batch)."""
    p, n_proc = jax.process_index(), jax.process_count()
    own = directory / f"process_{p}-of-{n_proc}.json"
    if own.exists():
        return json.loads(own.read_text()), p, n_proc
    saved = sorted(
        (int(m[2]), int(m[1]), f)
        for f in directory.iterdir()
        if (m := _STATE_FILE.fullmatch(f.name))
    )
    if not saved or saved[0][0] == n_proc:  # no state, or this process's file is missing
        raise ValueError(f"File {own} does not exist.")
    count, index, path = saved[0]
    return json.loads(path.read_text()), index, count


def _processes_and_workers(processes: int, workers: int) -> str:
    return (
        f"{processes} JAX process{'' if processes == 1 else 'es'} "
        f"({workers} grain worker{'' if workers == 1 else 's'} each)"
    )


def restore_state(directory: epath.Path, sampler: GlobalBatchSampler) -> bytes:
    """This process's DataLoader state (grain's JSON) from the data_iter item of a checkpoint,
    translated when the checkpoint was written by another number of processes or workers.

    Same count, same workers, same order: the saved state unchanged (an exact resume, as
    grain's handler does). Otherwise the global batch the run had reached is read from one
    process's state (`batches_consumed`) and this process's state at that batch is built
    (`loader_state`): the run goes on with exactly the batches an uninterrupted run would
    have had. A state of another data order is a CheckpointMismatch (not damage)."""
    p, n_proc, workers = jax.process_index(), jax.process_count(), sampler.worker_count
    saved, saved_p, saved_n = _read_saved_state(directory)
    ours = repr(sampler)
    if saved["sampler"] == ours and (saved_n, saved["worker_count"]) == (n_proc, workers):
        return json.dumps(saved).encode()
    legacy = _legacy_order(saved, sampler)
    if saved["sampler"] != ours and legacy in (None, "other"):
        raise CheckpointMismatch(
            f"the data iterator in {directory} was saved for another data order: "
            f"{saved['sampler']}, this run's is {ours}. Revert the change to resume this run, "
            "or pass a new --workdir to start a new one (nothing was moved or deleted)"
        )
    if sampler.global_batch_size % saved_n:
        raise CheckpointMismatch(
            f"the data iterator in {directory} was saved by {saved_n} processes, which do not "
            f"divide this run's global batch of {sampler.global_batch_size}"
        )
    n = batches_consumed(saved, saved_p, saved_n, sampler.global_batch_size // saved_n)
    written = _processes_and_workers(saved_n, saved["worker_count"])
    now = _processes_and_workers(n_proc, workers)
    if legacy == "approximate":
        log.warning(
            "data iterator in %s: saved by an older realm-jax whose data order depended on "
            "the process and worker count (%s); continuing at global batch %d of the "
            "count-independent order (this epoch may repeat or skip some examples once)",
            directory,
            written,
            n,
        )
    elif (saved_n, saved["worker_count"]) != (n_proc, workers):
        log.info(
            "data iterator: checkpoint written by %s, this job has %s: re-sharded at global "
            "batch %d (the same batches follow as in an uninterrupted run)",
            written,
            now,
            n,
        )
    state = loader_state(saved, n, p, n_proc, workers, sampler.local_batch_size, ours)
    return json.dumps(state).encode()


class IteratorHandler(grain.checkpoint.CheckpointHandler):
    """grain's orbax handler (the same files), restoring a ShardedLoader's iterator from a
    checkpoint of any process or worker count (restore_state); any other iterator exactly as
    grain does."""

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
        item = item or args.item
        sampler = getattr(item, "global_sampler", None)
        if sampler is None:
            return super().restore(directory, item=item, args=args)
        item.set_state(restore_state(directory, sampler))
        item.start_prefetch()
        return item


@ocp.args.register_with_handler(IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
    """orbax args: save a grain iterator's state (grain's files)."""

    item: Any


@ocp.args.register_with_handler(IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
    """orbax args: restore a grain iterator's state in place, from any process count."""

    item: Any


def iterator_save_args(it) -> IteratorSave:
    """orbax args that save a grain DataLoader iterator's state."""
    return IteratorSave(it)


def iterator_restore_args(it) -> IteratorRestore:
    """orbax args that restore a grain DataLoader iterator's state in place (a checkpoint of
    another process or worker count included: restore_state)."""
    return IteratorRestore(it)


def eval_batches(config, data_dir: str, *, batch_size: int, max_examples: int, positions=None):
    """The held-out examples as a fixed list of this process's batches (the same every
    evaluation: the first `max_examples` (all when <= 0), whole global batches only, each
    example masked by the run's data.eval_mask_mode, else data.mask_mode, with a generator
    seeded by its id). Each batch
    also holds, host-side, its examples' document titles ("title", an object array). With
    positions (versions.View.positions), block ids are that corpus version's positions."""
    source = datasets.examples_source(data_dir, "eval")
    n = len(source) if max_examples <= 0 else min(len(source), max_examples)
    b = local_batch_size(batch_size)
    n_batches = n // batch_size
    if n_batches == 0:
        raise ValueError(
            f"{data_dir}: {len(source)} held-out examples cannot fill one evaluation batch of "
            f"{batch_size}: lower train.eval_batch_size or raise data.eval_fraction"
        )
    d, out = config.data, []
    mode = masking.check_mask_mode(d.get("eval_mask_mode") or d.get("mask_mode", "salient"))
    first = jax.process_index() * b
    for i in range(n_batches):
        recs = [source[i * batch_size + first + j] for j in range(b)]
        ex = [
            mask_record(
                r,
                np.random.default_rng(int(r["example_id"])),
                mode,
                d.query_len,
                d.max_predictions,
            )
            for r in recs
        ]
        if positions is not None:
            ex = [to_positions(e, positions) for e in ex]
        batch = {k: np.stack([e[k] for e in ex]) for k in ex[0]}
        if "title" in recs[0]:  # host-side (the evaluator's title metrics), never on device
            batch["title"] = np.asarray([_text(r["title"]) for r in recs], dtype=object)
        out.append(batch)
    return out


def _text(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
