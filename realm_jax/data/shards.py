"""TFDS array_record datasets written shard by shard, records in id order, without TFDS's writer.

TFDS's GeneratorBasedBuilder writer collects every serialized record of a split before writing
(its shuffler; with `disable_shuffling` every key is small, so past 1 GB they all spill into one
bucket that is read back whole): a copy of the whole split in memory. These writers hold one
record at a time: each shard file gets `per` consecutive records, is written to its final folder
under a name carrying (window, shard, record count), and `beam_prepare.finalize` later renames
the shards to TFDS's names and writes dataset_info, exactly as for the Beam path's shards
(`WriteShard` there serializes with `serializer` below). The readers (data/datasets.py) see no
difference between the two.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tensorflow_datasets as tfds


def serializer(cls) -> Callable[[dict], bytes]:
    """record dict -> bytes, TFDS's encoding and serialization of cls.FEATURES (what its writer
    would store)."""
    from tensorflow_datasets.core import example_serializer

    features = tfds.features.FeaturesDict(cls.FEATURES)
    ser = example_serializer.ExampleSerializer(features.get_serialized_info())
    return lambda rec: ser.serialize_example(features.encode_example(rec))


def stem(cls) -> str:
    return f"{cls.name}-train.array_record"


def part_name(cls, window: int, shard: int, n: int) -> str:
    """A written shard's name before finalize: beam_prepare.PART parses it."""
    return f"{stem(cls)}-w{window:05d}-{shard:05d}.n{n}"


class ShardWriter:
    """Writes records (dicts of cls.FEATURES) to consecutive shards of `per` records in a local
    folder; `close()` returns how many were written. A shard is named only once complete, so
    an interrupted writer leaves nothing finalize would publish."""

    def __init__(self, cls, folder: str, per: int, window: int = 0):
        if per < 1:
            raise ValueError(f"records per shard must be >= 1, got {per}")
        self.cls, self.folder, self.per, self.window = cls, folder, per, window
        self.serialize = serializer(cls)
        self.total = 0
        self._shard = 0
        self._n = 0
        self._writer = None
        os.makedirs(folder, exist_ok=True)

    def _partial(self) -> str:
        return os.path.join(self.folder, f".{stem(self.cls)}-w{self.window:05d}-{self._shard:05d}")

    def write(self, rec: dict) -> None:
        if self._writer is None:
            from array_record.python.array_record_module import ArrayRecordWriter

            self._writer = ArrayRecordWriter(self._partial(), "group_size:1")
        self._writer.write(self.serialize(rec))
        self._n += 1
        self.total += 1
        if self._n == self.per:
            self._finish()

    def _finish(self) -> None:
        self._writer.close()
        name = part_name(self.cls, self.window, self._shard, self._n)
        os.replace(self._partial(), os.path.join(self.folder, name))
        self._writer, self._n = None, 0
        self._shard += 1

    def close(self) -> int:
        if self._writer is not None:
            self._finish()
        return self.total
