"""TFRecord files without TensorFlow: a streaming, checksum-verifying reader and a writer.

Each record is: length (uint64, little-endian), masked crc32c of those 8 bytes, `length` bytes
of data, masked crc32c of the data (the mask is TensorFlow's: rotate right by 15 bits, add
0xa282ead8). A GZIP-compressed file (TFRecordWriter's compression "GZIP") is recognised by
its magic bytes and read through gzip. Corruption or truncation raises TFRecordError naming
the file, the record number and the byte offset. Paths may be local or gs:// (realm_jax.fs).
"""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Iterable, Iterator

import google_crc32c

from realm_jax import fs

_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")


class TFRecordError(ValueError):
    """A TFRecord file that is corrupt, truncated or unreadable (the message says where)."""


def masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _open(path: str):
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError:
        raise TFRecordError(f"{path}: no such file") from None
    except OSError as e:
        raise TFRecordError(f"{path}: cannot read: {e}") from e
    if f.read(2) == b"\x1f\x8b":
        f.seek(0)
        return gzip.GzipFile(fileobj=f, mode="rb")
    f.seek(0)
    return f


def _reader(f, path: str):
    """f.read that turns a GZIP stream's corruption or early end into TFRecordError."""

    def read(size: int, n: int, offset: int) -> bytes:
        try:
            return f.read(size)
        except (EOFError, OSError, zlib.error) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise TFRecordError(
                f"{path}: record {n} (byte {offset}): unreadable data ({reason})"
            ) from None

    return read


def read_records(path: str, *, verify: bool = True) -> Iterator[bytes]:
    """Yield every record's bytes in file order (record 0 first)."""
    with _open(path) as f:
        read = _reader(f, path)
        n = offset = 0
        while True:
            head = read(12, n, offset)
            if not head:
                return
            if len(head) < 12:
                raise TFRecordError(
                    f"{path}: record {n} (byte {offset}): truncated length header "
                    f"({len(head)} of 12 bytes)"
                )
            (length,) = _LEN.unpack_from(head)
            (len_crc,) = _CRC.unpack_from(head, 8)
            if verify and masked_crc(head[:8]) != len_crc:
                raise TFRecordError(
                    f"{path}: record {n} (byte {offset}): length checksum mismatch: the file "
                    "is corrupt (or not a TFRecord file)"
                )
            body = read(length + 4, n, offset)
            if len(body) < length + 4:
                raise TFRecordError(
                    f"{path}: record {n} (byte {offset}): truncated: {length} data bytes + "
                    f"4 checksum bytes expected, {len(body)} found"
                )
            data = body[:length]
            if verify and masked_crc(data) != _CRC.unpack_from(body, length)[0]:
                raise TFRecordError(
                    f"{path}: record {n} (byte {offset}): data checksum mismatch: the file "
                    "is corrupt"
                )
            yield data
            n += 1
            offset += 12 + length + 4


def count_records(path: str) -> int:
    """The number of records (reads and verifies the whole file)."""
    return sum(1 for _ in read_records(path))


def encode_record(data: bytes) -> bytes:
    """One record's bytes as a TFRecord file holds them."""
    head = _LEN.pack(len(data))
    return head + _CRC.pack(masked_crc(head)) + data + _CRC.pack(masked_crc(data))


def write_records(path: str, records: Iterable[bytes]) -> int:
    """Write `records` (bytes, or str as UTF-8) as an uncompressed TFRecord file; returns the
    number written. Local writes are atomic (fs.write_bytes); meant for tests and small
    files (the whole file is built in memory)."""
    parts = []
    for r in records:
        parts.append(encode_record(r.encode("utf-8") if isinstance(r, str) else bytes(r)))
    fs.write_bytes(path, b"".join(parts))
    return len(parts)
