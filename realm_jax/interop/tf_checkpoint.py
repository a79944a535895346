"""Read TensorFlow checkpoints (the V2 "tensor bundle" a tf.compat.v1 Saver writes) without
TensorFlow: the release's TF1 checkpoints and TF-Hub modules become numpy arrays.

A checkpoint is `<prefix>.index` plus `<prefix>.data-0000N-of-0000M` shards. The index is a
LevelDB-format table (blocks of prefix-compressed keys with restart points, a 5-byte trailer
per block: compression type + masked crc32c, an index block of block handles, a 48-byte footer
with the table's magic number); its keys are variable names ("" holds the BundleHeaderProto)
and its values BundleEntryProto messages (dtype, shape, shard_id, offset, size, crc32c), read
here with a small protobuf wire-format decoder. Every tensor's bytes are checked against the
entry's masked crc32c, as TensorFlow does.

    ckpt = TFCheckpoint("gs://realm-data/cc_news_pretrained/embedder")  # a folder or a prefix
    ckpt.names(); ckpt.shape(name); ckpt.read(name) -> np.ndarray
    load_checkpoint(path) -> {name: np.ndarray}

`path` may be a checkpoint prefix, its .index file, a folder with a `checkpoint` state file, a
TF-Hub module or SavedModel folder (variables/variables.index), ORQA's model_dir
(export/best_default/checkpoint/, the best checkpoint ORQA's exporter keeps) or a folder with
exactly one .index file; local or gs:// (through realm_jax.fs). Tables compressed with snappy
(which tensor bundles never are) and partitioned (sliced) variables are refused by name.
"""

from __future__ import annotations

import dataclasses
import os
import re

import google_crc32c
import numpy as np

from realm_jax import fs
from realm_jax.interop import protowire

TABLE_MAGIC = 0xDB4775248B80FB57  # LevelDB's table magic, kept by TensorFlow's table format
FOOTER_LEN = 48  # two block handles padded to 40 bytes, then the 8-byte magic
TRAILER_LEN = 5  # compression type byte + masked crc32c
CHUNK = 1 << 26  # bytes read (and checksummed) at a time

# TensorFlow's DataType enum -> numpy dtype (DT_STRING = 7 is read separately).
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),  # DT_FLOAT
    2: np.dtype("<f8"),  # DT_DOUBLE
    3: np.dtype("<i4"),  # DT_INT32
    4: np.dtype("u1"),  # DT_UINT8
    5: np.dtype("<i2"),  # DT_INT16
    6: np.dtype("i1"),  # DT_INT8
    8: np.dtype("<c8"),  # DT_COMPLEX64
    9: np.dtype("<i8"),  # DT_INT64
    10: np.dtype("?"),  # DT_BOOL
    17: np.dtype("<u2"),  # DT_UINT16
    18: np.dtype("<c16"),  # DT_COMPLEX128
    19: np.dtype("<f2"),  # DT_HALF
    22: np.dtype("<u4"),  # DT_UINT32
    23: np.dtype("<u8"),  # DT_UINT64
}
DT_STRING, DT_BFLOAT16 = 7, 14


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing or truncated file, bad checksum, a format
    this reader does not handle. The message names the file."""


def mask_crc(crc: int) -> int:
    """TensorFlow's (and LevelDB's) masked crc32c: rotate right by 15, add a constant."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def crc32c(data, crc: int = 0) -> int:
    return google_crc32c.extend(crc, bytes(data) if isinstance(data, memoryview) else data)


# ------------------------------------------------------------------------- protobuf wire format
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at buf[pos]."""
    return protowire.varint(buf, pos, CheckpointError)


def proto_fields(buf: bytes) -> dict[int, list]:
    """{field number: [values]} of a serialized protobuf message: ints for varint and fixed
    fields, bytes for length-delimited ones (sub-messages are parsed by the caller)."""
    out: dict[int, list] = {}
    for field, wire, value in protowire.fields(buf, CheckpointError):
        if wire in (1, 5):
            value = int.from_bytes(value, "little")
        out.setdefault(field, []).append(value)
    return out


_int64 = protowire.int64


def _first(fields: dict, number: int, default=0):
    return fields.get(number, [default])[-1]  # protobuf: the last occurrence wins


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One BundleEntryProto: where a tensor lies and how to check it."""

    name: str
    tf_dtype: int
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int  # masked
    sliced: bool

    @property
    def dtype(self) -> np.dtype | str:
        """The numpy dtype ("string" for DT_STRING, ml_dtypes' bfloat16 for DT_BFLOAT16)."""
        if self.tf_dtype == DT_STRING:
            return "string"
        if self.tf_dtype == DT_BFLOAT16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        if self.tf_dtype not in DTYPES:
            raise CheckpointError(f"{self.name}: unsupported TensorFlow dtype {self.tf_dtype}")
        return DTYPES[self.tf_dtype]


def _entry(name: str, buf: bytes) -> TensorEntry:
    f = proto_fields(buf)
    dims = []
    shape = proto_fields(_first(f, 2, b""))
    for dim in shape.get(2, []):
        dims.append(_int64(_first(proto_fields(dim), 1)))
    return TensorEntry(
        name=name,
        tf_dtype=_first(f, 1),
        shape=tuple(dims),
        shard_id=_first(f, 3),
        offset=_int64(_first(f, 4)),
        size=_int64(_first(f, 5)),
        crc32c=_first(f, 6),
        sliced=bool(f.get(7)),
    )


# ------------------------------------------------------------------------------- table format
def _block(data: bytes, offset: int, size: int, where: str) -> bytes:
    """The contents of the table block at (offset, size), its trailer checked."""
    end = offset + size + TRAILER_LEN
    if offset < 0 or end > len(data):
        raise CheckpointError(f"{where}: truncated (a block ends at byte {end} of {len(data)})")
    contents, kind = data[offset : offset + size], data[offset + size]
    stored = int.from_bytes(data[offset + size + 1 : end], "little")
    if mask_crc(crc32c(data[offset : offset + size + 1])) != stored:
        raise CheckpointError(f"{where}: checksum mismatch in the block at byte {offset}")
    if kind == 1:
        raise CheckpointError(
            f"{where}: the table is snappy-compressed, which this reader does not decode "
            "(TensorFlow's own checkpoints are not compressed)"
        )
    if kind != 0:
        raise CheckpointError(f"{where}: unknown block compression type {kind}")
    return contents


def _block_entries(block: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """(key, value) pairs of one table block, keys restored from their shared prefixes."""
    if len(block) < 4:
        raise CheckpointError(f"{where}: malformed table block")
    num_restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 - 4 * num_restarts
    if end < 0:
        raise CheckpointError(f"{where}: malformed table block ({num_restarts} restarts)")
    out, key, pos = [], b"", 0
    try:
        while pos < end:
            shared, pos = _varint(block, pos)
            unshared, pos = _varint(block, pos)
            value_len, pos = _varint(block, pos)
            if shared > len(key) or pos + unshared + value_len > end:
                raise CheckpointError(f"{where}: malformed table entry at byte {pos}")
            key = key[:shared] + block[pos : pos + unshared]
            pos += unshared
            out.append((key, block[pos : pos + value_len]))
            pos += value_len
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return out


def _handle(value: bytes) -> tuple[int, int]:
    offset, pos = _varint(value, 0)
    size, _ = _varint(value, pos)
    return offset, size


def read_table(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a LevelDB-format table held in `data`, in key order."""
    if len(data) < FOOTER_LEN:
        raise CheckpointError(f"{where}: truncated ({len(data)} bytes; not a checkpoint index)")
    footer = data[-FOOTER_LEN:]
    if int.from_bytes(footer[-8:], "little") != TABLE_MAGIC:
        raise CheckpointError(f"{where}: not a TensorFlow checkpoint index (bad magic; truncated?)")
    _, pos = _varint(footer, 0)  # the metaindex handle (an empty block in TF's tables)
    _, pos = _varint(footer, pos)
    index_offset, pos = _varint(footer, pos)
    index_size, _ = _varint(footer, pos)
    out = []
    for _, handle in _block_entries(_block(data, index_offset, index_size, where), where):
        offset, size = _handle(handle)
        out.extend(_block_entries(_block(data, offset, size, where), where))
    return out


# ------------------------------------------------------------------------------ path handling
def _state_file_prefix(folder: str) -> str | None:
    """The latest checkpoint a `checkpoint` state file names (relative to the folder, or an
    absolute path; one written on another machine falls back to its basename here)."""
    state = fs.join(folder, "checkpoint")
    if not fs.isfile(state):
        return None
    m = re.search(r'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', fs.read_text(state), re.M)
    if not m:
        raise CheckpointError(f"{state}: no model_checkpoint_path in the state file")
    named = m.group(1).encode().decode("unicode_escape")
    absolute = fs.is_remote(named) or os.path.isabs(named)
    for cand in ([named] if absolute else [fs.join(folder, named)]) + [
        fs.join(folder, fs.basename(named))
    ]:
        if fs.isfile(cand + ".index"):
            return cand
    raise CheckpointError(f"{state} names {named!r}, which has no .index file")


def resolve_prefix(path: str) -> str:
    """The checkpoint prefix that `path` stands for (see the module docstring)."""
    path = os.fspath(path).rstrip("/") if fs.is_remote(path) else os.fspath(path)
    if path.endswith(".index") and fs.isfile(path):
        return path[: -len(".index")]
    if fs.isfile(path + ".index"):
        return path
    if fs.isdir(path):
        found = _state_file_prefix(path)
        if found:
            return found
        for sub in (("variables", "variables"), ("export", "best_default", "checkpoint")):
            cand = fs.join(path, *sub)
            if fs.isfile(cand + ".index"):
                return cand
            if fs.isdir(cand):
                return resolve_prefix(cand)
        indexes = sorted(n for n in fs.listdir(path) if n.endswith(".index"))
        if len(indexes) == 1:
            return fs.join(path, indexes[0][: -len(".index")])
        if len(indexes) > 1:
            raise CheckpointError(
                f"{path}: {len(indexes)} checkpoints and no `checkpoint` state file: name one "
                f"({', '.join(i[: -len('.index')] for i in indexes[:4])})"
            )
    where = "" if fs.is_remote(path) or os.path.isabs(path) else f" (relative to {os.getcwd()})"
    raise CheckpointError(
        f"{path}: no TensorFlow checkpoint{where}: looked for {path}.index, a `checkpoint` "
        "state file, variables/variables.index, export/best_default/checkpoint/ and a single "
        "*.index in the folder"
    )


# -------------------------------------------------------------------------------- checkpoints
class TFCheckpoint:
    """An opened checkpoint: its entries read from the index; tensors read on demand."""

    def __init__(self, path: str):
        self.prefix = resolve_prefix(path)
        index = self.prefix + ".index"
        try:
            data = fs.read_bytes(index)
        except OSError as e:
            raise CheckpointError(f"{index}: cannot read: {e}") from e
        self.entries: dict[str, TensorEntry] = {}
        header = None
        for key, value in read_table(data, index):
            if key == b"":
                header = proto_fields(value)
            elif not key.startswith(b"\x00"):  # slice keys of partitioned variables
                name = key.decode("utf-8")
                self.entries[name] = _entry(name, value)
        if header is None:
            raise CheckpointError(f"{index}: no bundle header (not a V2 checkpoint index)")
        if _first(header, 2) != 0:
            raise CheckpointError(f"{index}: big-endian checkpoint, not supported")
        self.num_shards = _first(header, 1, 1)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def _get(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise CheckpointError(f"{self.prefix}: no variable {name!r}")
        return self.entries[name]

    def shard_path(self, shard_id: int) -> str:
        return f"{self.prefix}.data-{shard_id:05d}-of-{self.num_shards:05d}"

    def read(self, name: str, *, verify: bool = True) -> np.ndarray:
        """The tensor `name` as numpy (strings: an object array of bytes), crc-checked."""
        e = self._get(name)
        if e.sliced:
            raise CheckpointError(f"{self.prefix}: {name} is a partitioned (sliced) variable")
        dtype, count = e.dtype, int(np.prod(e.shape, dtype=np.int64))
        if dtype != "string" and e.size != count * dtype.itemsize:
            raise CheckpointError(
                f"{self.prefix}: {name}: entry size {e.size} != {count} x {dtype.itemsize} bytes"
            )
        buf = np.empty(e.size, np.uint8)
        where = f"{self.shard_path(e.shard_id)}: {name}"
        if dtype == "string":  # its checksum covers the lengths as uint64s, not the varints
            self._read_into(e, memoryview(buf), False)
            out, crc = _strings(buf.tobytes(), count, e.shape, where)
        else:
            crc = self._read_into(e, memoryview(buf), verify)
            out = buf.view(dtype).reshape(e.shape)
        if verify and mask_crc(crc) != e.crc32c:
            raise CheckpointError(
                f"{where}: checksum mismatch (bytes {e.offset}..{e.offset + e.size}): the "
                "file is corrupt"
            )
        return out

    def _read_into(self, e: TensorEntry, out: memoryview, verify: bool) -> int:
        path = self.shard_path(e.shard_id)
        crc = 0
        try:
            with fs.open(path, "rb") as f:
                f.seek(e.offset)
                pos = 0
                while pos < e.size:
                    chunk = f.read(min(CHUNK, e.size - pos))
                    if not chunk:
                        raise CheckpointError(
                            f"{path}: truncated: {e.name} needs bytes {e.offset}.."
                            f"{e.offset + e.size}, the file ends at byte {e.offset + pos}"
                        )
                    out[pos : pos + len(chunk)] = chunk
                    crc = crc32c(chunk, crc) if verify else 0
                    pos += len(chunk)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing data shard of {self.prefix}") from None
        return crc

    def read_all(self, names=None, *, verify: bool = True) -> dict[str, np.ndarray]:
        return {n: self.read(n, verify=verify) for n in (names or self.names())}


def _strings(raw: bytes, count: int, shape: tuple, where: str) -> tuple[np.ndarray, int]:
    """A DT_STRING tensor and its crc32c. Layout: each string's length as a varint64, a masked
    crc32c of the lengths, then the strings' bytes; the entry's crc32c covers the lengths, the
    4 checksum bytes and the strings. The lengths are checksummed as fixed-width integers:
    uint32 in TensorFlow 2's writer, uint64 in older ones; whichever matches is used."""
    lengths, pos = [], 0
    try:
        for _ in range(count):
            n, pos = _varint(raw, pos)
            lengths.append(n)
    except CheckpointError:
        raise CheckpointError(f"{where}: malformed string tensor") from None
    stored = raw[pos : pos + 4]
    for width in (4, 8):
        crc = 0
        for n in lengths:
            crc = crc32c(n.to_bytes(width, "little"), crc) if n < 1 << (8 * width) else -1
        if crc >= 0 and int.from_bytes(stored, "little") == mask_crc(crc):
            break
    else:
        raise CheckpointError(f"{where}: checksum mismatch in the string lengths")
    crc, pos = crc32c(stored, crc), pos + 4
    out = np.empty(count, dtype=object)
    for i, n in enumerate(lengths):
        out[i] = raw[pos : pos + n]
        crc = crc32c(out[i], crc)
        pos += n
    if pos != len(raw):
        raise CheckpointError(f"{where}: string tensor of {len(raw)} bytes holds {pos}")
    return out.reshape(shape), crc


def list_variables(path: str) -> list[tuple[str, list[int]]]:
    """[(name, shape)] of a checkpoint, as tf.train.list_variables returns them."""
    ckpt = TFCheckpoint(path)
    return [(n, list(ckpt.shape(n))) for n in ckpt.names()]


def load_checkpoint(path: str, names=None, *, verify: bool = True) -> dict[str, np.ndarray]:
    """{name: array} of every variable (or of `names`) in a checkpoint."""
    return TFCheckpoint(path).read_all(names, verify=verify)


# ------------------------------------------------------------------------------------ writing
TABLE_BLOCK_SIZE = 262144  # TensorFlow's table::Options defaults (tensor bundles keep them)
RESTART_INTERVAL = 16


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    key = _put_varint(number << 3 | wire)
    if wire == 0:
        return key + _put_varint(payload)
    if wire == 5:
        return key + payload.to_bytes(4, "little")
    return key + _put_varint(len(payload)) + payload


class _BlockBuilder:
    """One LevelDB table block: prefix-compressed keys, restart points every `interval`."""

    def __init__(self, interval: int):
        self.interval, self.buf, self.restarts, self.count, self.last = interval, b"", [0], 0, b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.count < self.interval:
            while shared < min(len(key), len(self.last)) and key[shared] == self.last[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buf))
            self.count = 0
        self.buf += _put_varint(shared) + _put_varint(len(key) - shared)
        self.buf += _put_varint(len(value)) + key[shared:] + value
        self.last, self.count = key, self.count + 1

    def size(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        tail = b"".join(r.to_bytes(4, "little") for r in self.restarts)
        return self.buf + tail + len(self.restarts).to_bytes(4, "little")


def _separator(start: bytes, limit: bytes | None) -> bytes:
    """LevelDB's bytewise FindShortestSeparator (limit given) / FindShortSuccessor (None)."""
    if limit is None:
        for i, b in enumerate(start):
            if b != 0xFF:
                return start[:i] + bytes([b + 1])
        return start
    n = 0
    while n < min(len(start), len(limit)) and start[n] == limit[n]:
        n += 1
    if n < min(len(start), len(limit)) and start[n] < 0xFF and start[n] + 1 < limit[n]:
        return start[:n] + bytes([start[n] + 1])
    return start


def write_table(items: list[tuple[bytes, bytes]]) -> bytes:
    """A LevelDB-format table (uncompressed) of (key, value) pairs given in key order."""
    out, index = bytearray(), _BlockBuilder(1)
    block, pending, last = _BlockBuilder(RESTART_INTERVAL), None, b""

    def write(b: _BlockBuilder) -> bytes:
        contents = b.finish() + b"\x00"  # compression type: none
        handle = _put_varint(len(out)) + _put_varint(len(contents) - 1)
        out.extend(contents + mask_crc(crc32c(contents)).to_bytes(4, "little"))
        return handle

    for key, value in items:
        if pending is not None:
            index.add(_separator(last, key), pending)
            pending = None
        block.add(key, value)
        last = key
        if block.size() >= TABLE_BLOCK_SIZE:
            pending, block = write(block), _BlockBuilder(RESTART_INTERVAL)
    if block.count:
        pending = write(block)
    meta = write(_BlockBuilder(RESTART_INTERVAL))
    if pending is not None:
        index.add(_separator(last, None), pending)
    handles = meta + write(index)
    out.extend(handles + b"\x00" * (FOOTER_LEN - 8 - len(handles)))
    out.extend(TABLE_MAGIC.to_bytes(8, "little"))
    return bytes(out)


def write_checkpoint(prefix: str, tensors: dict[str, np.ndarray]) -> str:
    """Write numeric tensors as a one-shard V2 checkpoint (`prefix`.index + .data-00000-of-
    00001), laid out as TensorFlow's Saver lays them out (names sorted, tensors packed in
    that order): for tests and small checkpoints in the release's format (everything is
    built in memory). Returns the prefix."""
    codes = {v: k for k, v in DTYPES.items()}
    data, items = bytearray(), [(b"", _field(1, 0, 1) + _field(3, 2, _field(1, 0, 1)))]
    for name in sorted(tensors):
        arr = np.asarray(tensors[name], order="C")  # (ascontiguousarray makes scalars 1-D)
        if arr.dtype.name == "bfloat16":
            code = DT_BFLOAT16
        elif arr.dtype.newbyteorder("<") in codes:
            code, arr = codes[arr.dtype.newbyteorder("<")], arr.astype(arr.dtype.newbyteorder("<"))
        else:
            raise ValueError(f"{name}: dtype {arr.dtype} is not written (numeric tensors only)")
        raw = arr.tobytes()
        shape = b"".join(_field(2, 2, _field(1, 0, d) if d else b"") for d in arr.shape)
        entry = _field(1, 0, code) + _field(2, 2, shape)
        entry += _field(4, 0, len(data)) if data else b""
        entry += _field(5, 0, len(raw)) if raw else b""
        entry += _field(6, 5, mask_crc(crc32c(raw)))
        items.append((name.encode("utf-8"), entry))
        data.extend(raw)
    fs.makedirs(fs.dirname(prefix) or ".")
    fs.write_bytes(f"{prefix}.data-00000-of-00001", bytes(data))
    fs.write_bytes(prefix + ".index", write_table(items))
    return prefix
