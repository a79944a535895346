"""Protocol Buffers' wire format, the little realm-jax reads and writes without protobuf:
base-128 varints and a message's (field number, wire type, value) triples. Used by the TF1
checkpoint reader (interop/tf_checkpoint.py: tensor-bundle entries, table blocks) and the reader
of REALM's tf.train.Example shards (interop/realm_records.py); each passes its own error class,
so a malformed message reads as a bad checkpoint or a bad record, with its file named by the
caller. The encoders (encode_*) build the fields of the Examples realm_records writes.
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


# ------------------------------------------------------------------------------------ encoders
# The writing side, for the tf.train.Example shards realm-jax writes (interop/realm_records.py,
# write_documents): the same wire format, built field by field.
WIRE_VARINT, WIRE_FIXED64, WIRE_LEN, WIRE_FIXED32 = 0, 1, 2, 5


def encode_varint(value: int) -> bytes:
    """The base-128 varint of `value`; a negative value is written as protobuf writes an int64
    (its 64-bit two's complement: 10 bytes)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a varint holds an int, not {type(value).__name__}")
    if not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"{value} does not fit 64 bits")
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_key(number: int, wire: int) -> bytes:
    """A field's key: its number and wire type."""
    if number < 1 or wire not in (WIRE_VARINT, WIRE_FIXED64, WIRE_LEN, WIRE_FIXED32):
        raise ValueError(f"field {number}, wire type {wire}: not a valid field key")
    return encode_varint(number << 3 | wire)


def encode_varint_field(number: int, value: int) -> bytes:
    """A varint field (int32, int64, uint64, bool, enum)."""
    return encode_key(number, WIRE_VARINT) + encode_varint(value)


def encode_len_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: bytes, a string's UTF-8, a nested message, a packed list."""
    payload = bytes(payload)
    return encode_key(number, WIRE_LEN) + encode_varint(len(payload)) + payload


def encode_packed_varints(number: int, values) -> bytes:
    """A packed repeated varint field (proto3's default for repeated int64)."""
    return encode_len_field(number, b"".join(encode_varint(v) for v in values))
