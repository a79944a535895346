"""Protocol Buffers' wire format, the little realm-jax reads without protobuf: base-128
varints and a message's (field number, wire type, value) triples. Used by the TF1 checkpoint
reader (interop/tf_checkpoint.py: tensor-bundle entries, table blocks) and the reader of REALM's
tf.train.Example shards (interop/realm_records.py); each passes its own error class, so a
malformed message reads as a bad checkpoint or a bad record, with its file named by the caller.
"""

from __future__ import annotations

from collections.abc import Iterator


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def varint(buf: bytes, pos: int, error: type[Exception] = WireError) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at buf[pos]."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise error("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise error("varint longer than 10 bytes")


Field = tuple[int, int, "int | bytes"]  # (field number, wire type, value)


def fields(buf: bytes, error: type[Exception] = WireError) -> Iterator[Field]:
    """(field number, wire type, value) of each field of a message, in order: an int for a
    varint (wire type 0), the raw bytes for the others (1: 8 bytes, 5: 4 bytes, 2: the
    length-delimited payload). Groups (wire types 3 and 4) are refused: nothing read here
    uses them."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = varint(buf, pos, error)
        num, wire = key >> 3, key & 7
        if num == 0:
            raise error("field number 0")
        if wire == 0:
            val, pos = varint(buf, pos, error)
        elif wire in (1, 2, 5):
            if wire == 2:
                size, pos = varint(buf, pos, error)
            else:
                size = 8 if wire == 1 else 4
            if pos + size > n:
                raise error(f"field {num} truncated: it runs past the end of its message")
            val, pos = bytes(buf[pos : pos + size]), pos + size
        else:
            raise error(f"field {num}: unsupported wire type {wire}")
        yield num, wire, val


def int64(value: int) -> int:
    """A varint read as protobuf's int64 (negative numbers are 10-byte two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value
