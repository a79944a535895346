"""The read side of prepared data: a complete prepare's summary, random-access TFDS sources
of the blocks and the (held-out) examples, the block token table, the held-out split rule.

Layout of a prepared data_dir: see data/prepare.py (the write side). A data_dir may be a gs://
URL: summary.json is read from there and the dataset files it lists are checked. Its datasets
are then read where they lie (REALM_JAX_REMOTE_READS=direct, the default): each array_record
shard is opened in place on gs:// by array_record's own GCS reader (riegeli's GcsReader, in the
pinned array_record 0.8.6) the first time a record of it is wanted, and checked then (its size
against summary.json, its record count against the dataset's info; riegeli checks the hash of
every chunk it reads). So a host reads only what it uses: the trainer and the refresh job read
the block rows of their own devices (sharded_block_tokens) from the shards that hold them, and
the pre-training examples are read record by record as the batches want them; nothing is
copied up front and nothing is written to disk. REALM_JAX_REMOTE_READS=copy keeps the former
way: the whole data dir copied once per host into a verified local cache folder and read
there."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading

import numpy as np
import tensorflow_datasets as tfds

from realm_jax import fs

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # v3: examples carry their document's title


SUMMARY = "summary.json"
DATASETS = ("blocks", "examples", "eval_examples")
_checked: set[tuple[str, float]] = set()  # (data_dir, created) whose files were checked


class PrepareError(RuntimeError):
    """A data_dir that cannot be (re)used as asked."""


def is_eval(key: str, fraction: float, seed: int) -> bool:
    """Whether a title (or doc id) is held out: a hash of (seed, key) below `fraction`, so the
    split is the same on every run and needs no list of held-out keys."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def fraction_for_one(keys, seed: int) -> float:
    """The smallest data.eval_fraction (2 decimals, rounded up) that holds out at least one
    of `keys` (titles or doc ids) under is_eval's hash split; 0 when there are none."""
    hashes = [
        int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:8], "big") / 2**64
        for k in set(keys)
    ]
    if not hashes:
        return 0.0
    return min(0.99, (int(min(hashes) * 100) + 1) / 100)


NO_HELD_OUT = "no_held_out"  # summary key: why a prepare with eval_fraction > 0 held out none


def has_held_out(data_dir: str, what: str) -> bool:
    """Whether the prepared data has held-out examples; when not, one warning line saying why
    and what to prepare instead, and `what` (a run's held-out evaluation) is skipped. Called
    before any checkpoint is written."""
    s = load_summary(data_dir)
    if s["counts"].get("eval_examples"):
        return True
    why = s.get(NO_HELD_OUT) or (
        f"data.eval_fraction={s.get('config', {}).get('eval_fraction')} held out none"
    )
    log.warning("%s has no held-out examples: %s is off for this run (%s)", data_dir, what, why)
    return False


def read_summary(data_dir: str) -> dict | None:
    try:
        return json.loads(fs.read_bytes(fs.join(data_dir, SUMMARY)))
    except FileNotFoundError:
        return None


def _check_files(data_dir: str, s: dict) -> None:
    """Every dataset file summary.json lists must exist with its size (once per prepare).
    Summaries written before the list was kept (a local rename-published prepare) have none
    and are trusted as before."""
    key = (fs.abspath(data_dir), s.get("created"))
    if key in _checked or "files" not in s:
        return
    for rel, size in sorted(s["files"].items()):
        path = fs.join(data_dir, *rel.split("/"))
        try:
            got = fs.size(path)
        except (FileNotFoundError, OSError):
            got = None
        if got != size:
            what = "is missing" if got is None else f"has {got} bytes, {SUMMARY} says {size}"
            raise PrepareError(
                f"{data_dir} is damaged: {rel} {what}. Re-run `realm-jax prepare --overwrite`"
            )
    _checked.add(key)


def load_summary(data_dir: str) -> dict:
    """The summary of a complete prepare; a clear error for a missing or partial one."""
    s = read_summary(data_dir)
    if s is None or not s.get("complete"):
        names = fs.listdir(data_dir)
        partial = any(n.startswith(".prepare-tmp-") or n in ("blocks", "examples") for n in names)
        what = "an incomplete (interrupted?) prepare" if partial else "no prepared data"
        raise PrepareError(
            f"{data_dir} holds {what}: no {SUMMARY}. Run `realm-jax prepare` "
            "(with --overwrite if needed) first."
        )
    if s.get("format_version") != FORMAT_VERSION:
        raise PrepareError(
            f"{data_dir} was prepared in format v{s.get('format_version')} by an older "
            f"realm-jax; this one reads v{FORMAT_VERSION}: re-run `realm-jax prepare "
            "--overwrite`"
        )
    _check_files(data_dir, s)
    return s


def cache_root() -> str:
    """Where gs:// prepared data is copied to be read (fs.cache_root: $REALM_JAX_CACHE, else
    ~/.cache/realm-jax)."""
    return fs.cache_root()


def local_copy(data_dir: str, s: dict) -> str:
    """A local folder holding data_dir's datasets: data_dir itself when local; for a gs://
    data_dir a verified copy under cache_root(), one per prepare (keyed by its fingerprint and
    creation time), downloaded once per host and renamed into place whole (fs.cached_copy)."""
    if not fs.is_remote(data_dir):
        return os.path.abspath(data_dir)
    if "files" not in s:
        raise PrepareError(f"{data_dir}: {SUMMARY} lists no files (prepared by an older realm-jax)")
    tag = hashlib.sha256(f"{fs.abspath(data_dir)}:{s['fingerprint']}:{s['created']}".encode())
    local = os.path.join(cache_root(), "prepared", tag.hexdigest()[:16])
    try:
        return fs.cached_copy(data_dir, dict(s["files"]), local)
    except fs.StorageError as e:
        raise PrepareError(str(e)) from None


@functools.lru_cache(maxsize=8)
def _open(path: str, fingerprint: str):
    del fingerprint  # only part of the cache key: a re-prepared folder is opened afresh
    return tfds.builder_from_directory(path).as_data_source(split="train")


def _source(data_dir: str, name: str, builder: str):
    s = load_summary(data_dir)
    key = f"{s['fingerprint']}:{s.get('created')}"
    if fs.is_remote(data_dir) and remote_reads() == "direct":
        if "files" not in s:
            raise PrepareError(
                f"{data_dir}: {SUMMARY} lists no files (prepared by an older realm-jax)"
            )
        prefix = f"{name}/{builder}/1.0.0/"
        sizes = tuple(
            sorted((k[len(prefix) :], v) for k, v in s["files"].items() if k.startswith(prefix))
        )
        return _open_in_place(fs.join(data_dir, name, builder, "1.0.0"), key, sizes)
    return _open(os.path.join(local_copy(data_dir, s), name, builder, "1.0.0"), key)


# ------------------------------------------------------------------ shards read where they lie

REMOTE_READS = "REALM_JAX_REMOTE_READS"
REMOTE_MODES = ("direct", "copy")
OPEN_TIMEOUT_S = 180.0  # the first open of a gs:// shard (the native client finds credentials)


def remote_reads() -> str:
    """How a gs:// data_dir is read ($REALM_JAX_REMOTE_READS): "direct" (the default: every
    shard read in place, only the records wanted) or "copy" (the whole data dir copied once
    per host into cache_root() first: the former way, for a machine where array_record's
    native GCS client cannot reach the bucket)."""
    mode = os.environ.get(REMOTE_READS, "") or "direct"
    if mode not in REMOTE_MODES:
        raise ValueError(f"${REMOTE_READS}={mode!r}: must be one of {REMOTE_MODES}")
    return mode


def _native_gcs_env() -> None:
    """array_record's GCS reader is google-cloud-cpp, which finds a GCS emulator by
    CLOUD_STORAGE_EMULATOR_ENDPOINT; the Python clients (gcsfs, google-cloud-storage) by
    STORAGE_EMULATOR_HOST. Point the first at the second's emulator when only that is set, so
    both read the same store (the tests' fake GCS, a local emulator)."""
    global _copied_endpoint
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    endpoint = os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT")
    # follow STORAGE_EMULATOR_HOST when it moves (a new emulator), unless the endpoint was
    # set by someone else
    if host and (not endpoint or endpoint == _copied_endpoint):
        os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = _copied_endpoint = host


_copied_endpoint: str | None = None  # the endpoint _native_gcs_env set, if it did


def _footer_bytes(records: int) -> int:
    """How much of a shard's end to fetch at open: about its record index (8 bytes a record
    with a chunk per record) and the footer, between 64 KiB and array_record's 1 MiB."""
    return min(1 << 20, max(1 << 16, 32 * records))


def _reader(path: str, options: str):
    """An ArrayRecordReader of `path` (local or gs://), opened in a helper thread: an
    unreachable store or missing credentials for the native client shows as an error after
    OPEN_TIMEOUT_S rather than a silent hang."""
    from array_record.python import array_record_module

    if not fs.is_remote(path):
        return array_record_module.ArrayRecordReader(path, options)
    _native_gcs_env()
    out: list = []

    def run():
        try:
            out.append(array_record_module.ArrayRecordReader(path, options))
        except Exception as e:  # noqa: BLE001 - reported below, in the caller's thread
            out.append(e)

    t = threading.Thread(target=run, name="array-record-open", daemon=True)
    t.start()
    t.join(OPEN_TIMEOUT_S)
    if not out:
        raise PrepareError(
            f"{path}: array_record's GCS reader did not open it in {OPEN_TIMEOUT_S:.0f}s (no "
            "credentials for Google Cloud's C++ client, or the store is unreachable?); set "
            f"{REMOTE_READS}=copy to copy the data dir to local disk instead"
        )
    if isinstance(out[0], Exception):
        raise PrepareError(f"{path}: cannot open: {out[0]}") from out[0]
    return out[0]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One array_record file of a dataset: where it is, its records, its size (summary.json)."""

    path: str
    records: int
    size: int


class ShardedSource:
    """Random-access records of one prepared dataset (record i = the TFDS source's record i),
    its array_record shards opened where they lie, each on the first read of one of its
    records. A shard is checked when it is opened: its size must be summary.json's and its
    record count the dataset info's (a re-prepared or damaged data dir is a PrepareError, not
    wrong records); riegeli checks the hash of every chunk it reads. Records are decoded by
    the dataset's own TFDS features, as the TFDS source decodes them.

    `opened` (shard index -> the path) and `records_read` count what this process read (the
    tests count them). Picklable for grain's worker processes (each opens its own readers)."""

    def __init__(self, name: str, folder: str, shards: list[Shard], features):
        self.name, self.folder, self.shards, self.features = name, folder, shards, features
        self._ends = list(np.cumsum([sh.records for sh in shards]))  # exclusive ends
        self._init_readers()

    def _init_readers(self) -> None:
        self._readers: dict[int, object] = {}
        self._lock = threading.Lock()
        self.opened: dict[int, str] = {}
        self.records_read = 0

    def __getstate__(self) -> dict:
        return {k: self.__dict__[k] for k in ("name", "folder", "shards", "features", "_ends")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_readers()

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends else 0

    def __repr__(self) -> str:
        # grain validates a restored iterator against repr(data source): the TFDS source's,
        # so a run resumes across REALM_JAX_REMOTE_READS modes and local / gs:// data dirs
        return f"ArrayRecordDataSource(name={self.name}, split='train', decoders=None)"

    def locate(self, key: int) -> tuple[int, int]:
        """(shard index, position in it) of record `key`."""
        key = int(key)
        if not 0 <= key < len(self):
            raise IndexError(f"record {key} out of range [0, {len(self)})")
        s = bisect.bisect_right(self._ends, key)
        return s, key - (int(self._ends[s - 1]) if s else 0)

    def _damaged(self, s: int, what: str) -> PrepareError:
        return PrepareError(
            f"{self.shards[s].path} {what}: the data dir was damaged or re-prepared under this "
            "run. Re-run `realm-jax prepare --overwrite` (or restart on the new data)"
        )

    def _open_shard(self, s: int, options: str):
        """A reader of shard `s`, checked: its size (summary.json's) before it is opened, its
        record count (the dataset info's) after."""
        sh = self.shards[s]
        try:
            got = fs.size(sh.path)
        except (FileNotFoundError, OSError):
            got = None
        if got != sh.size:
            what = "is missing" if got is None else f"has {got} bytes, {SUMMARY} says {sh.size}"
            raise self._damaged(s, what)
        reader = _reader(sh.path, options)
        try:
            n = reader.num_records()
        except RuntimeError as e:  # riegeli: a footer or index that does not verify
            raise self._damaged(s, f"does not read ({e})") from None
        if n != sh.records:
            reader.close()
            raise self._damaged(s, f"holds {n} records, the dataset info says {sh.records}")
        with self._lock:
            self.opened.setdefault(s, sh.path)
        return reader

    def _read(self, s: int, reader, *args) -> list[bytes]:
        try:
            return reader.read(*args)
        except RuntimeError as e:  # riegeli: a chunk whose hash does not verify
            raise self._damaged(s, f"does not read ({e})") from None

    def _random_reader(self, s: int):
        reader = self._readers.get(s)
        if reader is not None:
            return reader
        with self._lock:
            if s in self._readers:
                return self._readers[s]
        sh = self.shards[s]
        reader = self._open_shard(
            s, f"readahead_buffer_size:0,footer_prefetch_bytes:{_footer_bytes(sh.records)}"
        )
        with self._lock:
            if s in self._readers:  # another thread opened it meanwhile
                reader.close()
            else:
                self._readers[s] = reader
            return self._readers[s]

    def _decode(self, record: bytes) -> dict:
        return self.features.deserialize_example_np(record)

    def __getitem__(self, key) -> dict:
        s, pos = self.locate(key.__index__())
        rec = self._read(s, self._random_reader(s), [pos])[0]
        self.records_read += 1
        return self._decode(rec)

    def __getitems__(self, keys) -> list[dict]:
        return [self[k] for k in keys]

    def __iter__(self):
        yield from self.read_range(0, len(self))

    def read_range(self, start: int, stop: int, chunk: int = 4096):
        """Records start..stop-1 in order, read sequentially (one stream a shard, with
        read-ahead) from the shards that hold them only; a reader opened for the range."""
        stop = min(stop, len(self))
        while start < stop:
            s, pos = self.locate(start)
            sh = self.shards[s]
            n = min(stop - start, sh.records - pos)
            ahead = int(min(16 << 20, max(1 << 16, sh.size * n // max(sh.records, 1))))
            opts = (
                f"readahead_buffer_size:{ahead},max_parallelism:1,"
                f"footer_prefetch_bytes:{_footer_bytes(sh.records)}"
            )
            reader = self._open_shard(s, opts)
            try:
                for a in range(pos, pos + n, chunk):
                    recs = self._read(s, reader, a, min(a + chunk, pos + n))
                    self.records_read += len(recs)
                    yield from (self._decode(r) for r in recs)
            finally:
                reader.close()
            start += n

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()


@functools.lru_cache(maxsize=8)
def _open_in_place(folder: str, fingerprint: str, sizes: tuple[tuple[str, int], ...]):
    """A ShardedSource of the TFDS dataset in `folder` (gs://), its shards read in place;
    `sizes` are summary.json's (file name -> bytes) for its files."""
    del fingerprint  # only part of the cache key: a re-prepared folder is opened afresh
    info = tfds.builder_from_directory(folder).info
    size_of = dict(sizes)
    shards = []
    for fi in info.splits["train"].file_instructions:
        base = os.path.basename(os.fspath(fi.filename))
        if fi.skip or fi.take != fi.examples_in_shard or base not in size_of:
            raise PrepareError(f"{folder}: {base} is not a whole shard listed in {SUMMARY}")
        shards.append(Shard(fs.join(folder, base), int(fi.examples_in_shard), size_of[base]))
    log.info(
        "reading %s in place: %d shards, %d records (%s=direct)",
        folder,
        len(shards),
        sum(sh.records for sh in shards),
        REMOTE_READS,
    )
    return ShardedSource(info.name, folder, shards, info.features)


def blocks_source(data_dir: str):
    """Random-access TFDS data source of the blocks (record i = block i)."""
    return _source(data_dir, "blocks", "realm_blocks")


def examples_source(data_dir: str, split: str = "train"):
    """Random-access TFDS data source of the pre-training examples (split "train") or of the
    held-out ones ("eval")."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    if split == "eval" and not load_summary(data_dir)["counts"].get("eval_examples"):
        raise PrepareError(
            f"{data_dir} has no held-out examples: prepare with --config.data.eval_fraction > 0 "
            "(the default holds out 5% of titles), or set train.eval_every=0"
        )
    return _source(data_dir, "examples" if split == "train" else "eval_examples", "realm_examples")


def _records(src, start: int, stop: int, chunk: int = 4096):
    """Records start..stop-1 of a source in order: a ShardedSource's sequential range read,
    a TFDS source's batched random reads."""
    if isinstance(src, ShardedSource):
        yield from src.read_range(start, stop, chunk)
        return
    for a in range(start, min(stop, len(src)), chunk):
        yield from src.__getitems__(range(a, min(a + chunk, stop, len(src))))


def load_blocks(data_dir: str, chunk: int = 4096) -> tuple[np.ndarray, list[str], list[str]]:
    """All blocks: (token_ids int32 [N, block_len] zero-padded, doc_ids, titles)."""
    src, block_len = blocks_source(data_dir), load_summary(data_dir)["block_len"]
    ids = np.zeros((len(src), block_len), np.int32)  # [N, block_len]
    doc_ids, titles = [], []
    for i, rec in enumerate(_records(src, 0, len(src), chunk)):
        t = rec["token_ids"][:block_len]
        ids[i, : len(t)] = t
        doc_ids.append(rec["doc_id"].decode())
        titles.append(rec["title"].decode())
    return ids, doc_ids, titles


def load_block_rows(
    data_dir: str, ranges: list[tuple[int, int]], chunk: int = 4096, titles: dict | None = None
) -> dict[tuple[int, int], np.ndarray]:
    """The token ids of the blocks in the given row ranges only: {(start, stop): int32
    [stop - start, block_len] zero-padded}; rows at or past the block count (the padding of a
    row-sharded table) are zeros. On a gs:// data_dir only the shards holding these rows are
    opened and only their records read. With `titles` (a dict), titles[(start, stop)] is the
    list of the range's block titles (up to the block count)."""
    src, block_len = blocks_source(data_dir), load_summary(data_dir)["block_len"]
    out = {}
    for start, stop in ranges:
        ids = np.zeros((stop - start, block_len), np.int32)  # [stop - start, block_len]
        names = []
        for i, rec in enumerate(_records(src, start, min(stop, len(src)), chunk)):
            t = rec["token_ids"][:block_len]
            ids[i, : len(t)] = t
            names.append(rec["title"].decode())
        out[(start, stop)] = ids
        if titles is not None:
            titles[(start, stop)] = names
    return out


@dataclasses.dataclass(frozen=True)
class RowShardedTokens:
    """The block token table on a mesh: `rows` [Npad, block_len] uint16, rows sharded over
    every device (sharding.rows_sharding) and zero-padded to a multiple of the device count,
    as index.embedding.pad_index + sharding.put_rows make it from the whole table; built by
    sharded_block_tokens from each process's own rows only. shape is the unpadded table's
    (num_blocks, block_len), as the host table's. `titles`: every block's title id, when
    asked (TitleIds)."""

    rows: object  # jax.Array
    num_blocks: int
    titles: TitleIds | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_blocks, int(self.rows.shape[1]))


def sharded_block_tokens(data_dir: str, mesh, with_titles: bool = False) -> RowShardedTokens:
    """The block token table row-sharded over `mesh`, each process reading only the rows of
    its own devices (load_block_rows): a trainer or refresh host reads 1/hosts of the blocks
    instead of all of them. Equal to sharding.put_rows(sharding.pad_rows(load_blocks()[0])).

    with_titles: also every block's title id (the held-out evaluation's: TitleIds), each
    process hashing the titles of its own rows and the processes exchanging the ids
    (_gather_title_ids). A collective:
    every process calls it."""
    import jax

    from realm_jax import sharding

    n = len(blocks_source(data_dir))
    shape = (sharding.padded_rows(n, mesh), int(load_summary(data_dir)["block_len"]))
    rows = sharding.rows_sharding(mesh)
    index_map = rows.addressable_devices_indices_map(shape)
    ranges = sorted({(i[0].start or 0, i[0].stop or shape[0]) for i in index_map.values()})
    local_titles = {} if with_titles else None
    parts = load_block_rows(data_dir, ranges, titles=local_titles)
    parts = {r: token_table(p) for r, p in parts.items()}
    array = jax.make_array_from_callback(
        shape, rows, lambda idx: parts[(idx[0].start or 0, idx[0].stop or shape[0])]
    )
    titles = TitleIds(_gather_title_ids(local_titles, n), data_dir) if with_titles else None
    return RowShardedTokens(array, n, titles)


def token_table(ids: np.ndarray) -> np.ndarray:
    """A process's rows of the device token table in uint16 (2 bytes an id, as
    index/embedding.py token_dtype chooses for the bundled 30,522-word vocabulary): every
    process the same dtype, whatever its rows hold; an id past 65535 is an error, not a wrap."""
    if ids.size and int(ids.max()) > np.iinfo(np.uint16).max:
        raise ValueError(f"block token id {int(ids.max())} does not fit the uint16 token table")
    return ids.astype(np.uint16)


def title_hash(title: str) -> int:
    """A title's 64-bit id (blake2b): the same on every process, with no exchange of strings
    (collisions among Wikipedia's 5.9M titles: about 1e-6 expected)."""
    return int.from_bytes(hashlib.blake2b(title.encode(), digest_size=8).digest(), "little") - (
        1 << 63
    )


class TitleIds:
    """Every block's title as a 64-bit id [N] (title_hash), for the held-out evaluation's
    same-title metrics and the curriculum's first block of a title, instead of N strings and
    a dict keyed by them on every host (13.35M titles at the paper's scale: about 1.5 GB of
    Python objects a host against 107 MB here; issue 58). `name(block)` reads one title back."""

    def __init__(self, ids: np.ndarray, data_dir: str | None = None, namer=None):
        """namer(block) -> its title, where the blocks are not the prepared data's rows (an
        updated corpus version's positions: versions.View); else read from `data_dir`."""
        self.ids = np.asarray(ids, np.int64)  # [N]
        self.data_dir, self.namer = data_dir, namer
        uniq, first, inverse, counts = np.unique(
            self.ids, return_index=True, return_inverse=True, return_counts=True
        )
        self._uniq, self._first = uniq, first  # sorted ids, the first block of each
        self.count = counts[inverse].astype(np.float64)  # [N] blocks sharing each's title

    @classmethod
    def of(cls, titles: list[str], data_dir: str | None = None, namer=None) -> TitleIds:
        return cls(np.asarray([title_hash(t) for t in titles], np.int64), data_dir, namer)

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, title: str, default: int = -1) -> int:
        """The first block of `title`, else `default` (a dict's get, as gold_of was)."""
        h = title_hash(title)
        at = int(np.searchsorted(self._uniq, h))
        return int(self._first[at]) if at < len(self._uniq) and self._uniq[at] == h else default

    def name(self, block: int) -> str:
        """Block `block`'s title, read from the prepared data (for a message)."""
        if not 0 <= block < len(self.ids) or (self.data_dir is None and self.namer is None):
            return "?"
        if self.namer is not None:
            return self.namer(block)
        return block_text(self.data_dir, block)[0]


def _gather_title_ids(local: dict[tuple[int, int], list[str]], n: int) -> np.ndarray:
    """Every block's title id [N] on every process from each process's {(start, stop):
    titles}: each hashes its own and the int64 ids are gathered (a collective), never the
    strings."""
    import jax

    out = np.zeros(n, np.int64)
    seen = np.zeros(n, bool)
    mine = [
        (a, np.asarray([title_hash(t) for t in names], np.int64)) for (a, _), names in local.items()
    ]
    if jax.process_count() == 1:
        parts = [mine]
    else:
        from jax.experimental import multihost_utils

        flat = np.concatenate([np.concatenate([[a, len(h)], h]) for a, h in mine] or [[]])
        raw = flat.astype(np.int64).view(np.uint8)  # bytes: JAX would narrow int64 to int32
        lens = np.asarray(multihost_utils.process_allgather(np.int32(len(raw)))).reshape(-1)
        buf = np.zeros(int(lens.max()), np.uint8)
        buf[: len(raw)] = raw
        every = np.asarray(multihost_utils.process_allgather(buf))  # [processes, longest]
        parts = [
            _unflatten(every[p, : int(length)].view(np.int64)) for p, length in enumerate(lens)
        ]
    for part in parts:
        for a, h in part:
            out[a : a + len(h)], seen[a : a + len(h)] = h, True
    if not seen.all():
        raise RuntimeError("titles: some blocks are held by no process's devices")
    return out


def _unflatten(flat: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """[(start, ids)] from [start, length, ids..., start, length, ...]."""
    out, i = [], 0
    while i < len(flat):
        a, length = int(flat[i]), int(flat[i + 1])
        out.append((a, flat[i + 2 : i + 2 + length]))
        i += 2 + length
    return out


def load_titles(data_dir: str, chunk: int = 4096) -> list[str]:
    """Every block's title. It reads every block record (a record is read whole), though it
    keeps only the titles: on a pod, sharded_block_tokens(with_titles=True) reads 1/hosts."""
    src = blocks_source(data_dir)
    return [rec["title"].decode() for rec in _records(src, 0, len(src), chunk)]


def block_text(data_dir: str, block_id: int) -> tuple[str, str]:
    """(title, body text) of one block."""
    rec = blocks_source(data_dir)[int(block_id)]
    return rec["title"].decode(), rec["text"].decode()


def vocab_size(s: dict) -> int:
    """The size of the vocabulary a prepare's token ids come from: its summary's (prepares
    before it was recorded: the bundled tokenizer's, the only one they could use)."""
    from realm_jax import tokenization as tk

    return int(s.get("vocab_size") or tk.vocab_size())


def check_vocab(config, ddir: str) -> None:
    """model.vocab_size must cover the prepared token ids: a smaller embedding table would be
    indexed out of range, which embeds NaNs silently (every loss NaN). Called by every command
    that embeds the prepared data or a tokenized question, before anything is built."""
    from realm_jax.config import ConfigError

    have, need = int(config.model.vocab_size), vocab_size(load_summary(ddir))
    if have < need:
        raise ConfigError(
            f"model.vocab_size={have} is smaller than the vocabulary of the token ids prepared in "
            f"{ddir} ({need} wordpieces): ids from {have} up would index past the embedding "
            f"table (NaN losses); set --config.model.vocab_size={need} (or more)"
        )


def check_prepared(config, ddir: str) -> None:
    """The prepared data must have the lengths the config trains with, and its token ids fit
    the model's vocabulary (check_vocab)."""
    check_vocab(config, ddir)
    built = load_summary(ddir)["config"]
    bad = [
        f"data.{k} is {config.data[k]} but {ddir} was prepared with {built[k]}"
        for k in ("block_len", "query_len", "max_predictions")
        if built.get(k) != config.data[k]
    ]
    if bad:
        raise ValueError("; ".join(bad) + ": re-run `realm-jax prepare --overwrite`")
