"""REALM's pre-training corpus (google-research/language, language/realm): the sentences the
release's example generator masks and their annotated salient spans, read without TensorFlow
(data/local_prepare.py makes examples of them).

The release ships it as GZIP-compressed TFRecord shards of serialized tf.train.Example, one
document each (the small subset: gs://realm-data/realm-data-small/pretrain_corpus_small/
wikipedia_annotated_with_dates_public*.tfrecord.gz), with the features
  title, text                                bytes (UTF-8)
  sentence_byte_start, sentence_byte_limit   int64 lists: each sentence's bytes in text
  span_byte_start, span_byte_limit           int64 lists: the salient spans (named entities
                                             and dates), bytes in text
(starts inclusive, limits exclusive). As the release's generator does (text_features_to_query),
a span belongs to the first sentence that holds it whole and is dropped when none does.

Use from prepare: data.sentences names REALM's shards when it ends in .tfrecord.gz, .tfr.gz,
.tfrecord or .tfr (one file, or a glob pattern such as .../wikipedia_annotated_with_dates_
public*.tfrecord.gz: every matching file, in sorted order), is a glob whose matches all end so,
or is a folder holding such files (all of them, sorted; one that also holds .txt files is
refused). Each sentence of each
document is then one pre-training sentence (its surrounding whitespace trimmed) whose salient
span candidates are the document's spans (label SALIENT), mapped to wordpieces as spaCy's
entities are (data/masking.py, Masker.choices): spaCy is not run. A sentence without a span is
skipped and counted (skipped_no_span) as on the NER path; spans dropped for crossing sentences are
counted as sentences_skipped_span_across_sentences. The release holds out its first 5 shards
for evaluation; prepare holds out data.eval_fraction of the titles, as for any text.

Bad input (a corrupt or truncated shard: at its record; an Example that does not parse, text
that is not UTF-8, offsets outside the text or inside a character) raises RealmRecordsError
"<file>: record <n>: ..." (one line), or with skip_bad_input=True is skipped and counted as
sentences_skipped_<kind> (a corrupt shard: the rest of that shard). Paths may be gs://.
In code: `read_documents(spec)`, `parse_example(bytes)`, `shard_paths(spec)`.

Writing (`realm-jax world` writes its text so): `write_documents(path, docs)` writes documents
given as the reader yields them, (title, sentences) with character spans, as one GZIP TFRecord
shard of Examples with the features above (the text: the sentences joined by single spaces);
`encode_example(features)` serializes one tf.train.Example (protobuf's wire format, feature names
in sorted order, int64 lists packed as TensorFlow writes them).
"""

from __future__ import annotations

import collections
import glob
import gzip
import os
import struct
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from etils import epath

from realm_jax import fs
from realm_jax.corpus_errors import SKIP_HINT, CorpusError
from realm_jax.interop import protowire, tfrecord

SHARD_SUFFIXES = (".tfrecord.gz", ".tfr.gz", ".tfrecord", ".tfr")
LABEL = "SALIENT"  # the release's spans carry no entity type
RELEASE_EVAL_SHARDS = 5  # the release's example generator holds out its first 5 shards

Sentence = tuple[str, list[tuple[int, int, str]]]  # (text, char spans in it with a label)
Document = tuple[str, str, list[Sentence]]  # (doc_id, title, sentences)


class RealmRecordsError(CorpusError):
    """REALM pre-training shards that cannot be read (the message names file and record)."""


class ExampleError(ValueError):
    """Bytes that are not a serialized tf.train.Example (the reader adds file and record)."""


# ------------------------------------------------------------ tf.train.Example wire format
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    return protowire.varint(buf, pos, ExampleError)


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a message, in order."""
    return protowire.fields(buf, ExampleError)


_int64 = protowire.int64


def _int64_list(buf: bytes) -> list[int]:
    out = []
    for num, wire, val in _fields(buf):
        if num != 1:
            continue
        if wire == 0:  # unpacked
            out.append(_int64(val))
        elif wire == 2:  # packed
            pos = 0
            while pos < len(val):
                v, pos = _varint(val, pos)
                out.append(_int64(v))
        else:
            raise ExampleError(f"int64_list value with wire type {wire}")
    return out


def _float_list(buf: bytes) -> list[float]:
    out = []
    for num, wire, val in _fields(buf):
        if num != 1:
            continue
        if wire == 5:  # unpacked
            out.append(struct.unpack("<f", val)[0])
        elif wire == 2 and len(val) % 4 == 0:  # packed
            out.extend(struct.unpack(f"<{len(val) // 4}f", val))
        else:
            raise ExampleError("malformed float_list")
    return out


def _feature(buf: bytes) -> list:
    """A Feature's values (its oneof kind: bytes_list 1, float_list 2, int64_list 3)."""
    value: list = []
    for num, wire, val in _fields(buf):
        if wire != 2 or num not in (1, 2, 3):
            continue
        if num == 1:
            value = [v for n, w, v in _fields(val) if n == 1 and w == 2]
        elif num == 2:
            value = _float_list(val)
        else:
            value = _int64_list(val)
    return value


def parse_example(buf: bytes) -> dict[str, list]:
    """{feature name: list of values (bytes, float or int)} of a serialized tf.train.Example
    (Example.features = 1; Features.feature = map<string, Feature> = 1). Raises ExampleError."""
    out: dict[str, list] = {}
    for num, wire, features in _fields(bytes(buf)):
        if num != 1 or wire != 2:
            continue
        for n, w, entry in _fields(features):
            if n != 1 or w != 2:
                continue
            key, feat = b"", b""
            for k, kw, v in _fields(entry):
                if k == 1 and kw == 2:
                    key = v
                elif k == 2 and kw == 2:
                    feat = v
            try:
                name = key.decode("utf-8")
            except UnicodeDecodeError:
                raise ExampleError("a feature name is not UTF-8") from None
            out[name] = _feature(feat)
    return out


# ------------------------------------------------------------------------------- shard paths
def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def is_release_text(spec: str) -> bool:
    """Whether data.sentences names REALM's pre-training shards (the rule in the docstring)."""
    if not spec:
        return False
    spec = str(spec).rstrip("/")
    if spec.endswith(SHARD_SUFFIXES):
        return True
    if _has_glob(spec):
        matches = _glob(spec)
        return bool(matches) and all(m.endswith(SHARD_SUFFIXES) for m in matches)
    if not fs.isdir(spec):
        return False
    return any(rel.endswith(SHARD_SUFFIXES) for rel in fs.walk_files(spec))


def _glob(pattern: str) -> list[str]:
    if not fs.is_remote(pattern):
        return [p for p in glob.glob(pattern) if os.path.isfile(p)]
    parts = pattern.split("/")
    i = next(k for k, part in enumerate(parts) if _has_glob(part))
    base, rest = "/".join(parts[:i]), "/".join(parts[i:])
    return [os.fspath(p) for p in epath.Path(base).glob(rest) if not p.is_dir()]


def shard_paths(spec: str) -> list[str]:
    """The shard files data.sentences names, sorted (the release's order)."""
    where = f"data.sentences={spec}"
    spec = str(spec).rstrip("/")
    if _has_glob(spec):
        paths = _glob(spec)
        if not paths:
            raise RealmRecordsError(f"{where}: the pattern matches no file")
    elif fs.isdir(spec):
        rels = list(fs.walk_files(spec))
        if any(r.endswith(".txt") for r in rels):
            raise RealmRecordsError(
                f"{where}: the folder holds both .txt files and TFRecord shards; name the "
                f"shards with a glob ({fs.join(spec, '*.tfrecord.gz')})"
            )
        paths = [fs.join(spec, *r.split("/")) for r in rels if r.endswith(SHARD_SUFFIXES)]
    elif fs.exists(spec):
        paths = [spec]
    else:
        where += "" if fs.is_remote(spec) or os.path.isabs(spec) else f" (from {os.getcwd()})"
        raise RealmRecordsError(f"{where}: no such file or folder")
    return sorted(paths)


# ---------------------------------------------------------------------------------- documents
def _char_index(raw: bytes) -> np.ndarray:
    """[len(raw) + 1]: the character index of each byte offset of UTF-8 `raw`; -1 for an
    offset inside a character."""
    lead = (np.frombuffer(raw, np.uint8) & 0xC0) != 0x80  # not a continuation byte
    index = np.concatenate([[0], np.cumsum(lead)])
    return np.where(np.append(lead, True), index, -1)


def _ranges(ex: dict, start: str, limit: str, chars: np.ndarray) -> list[tuple[int, int]]:
    """(start, limit) character ranges from byte offset lists; ExampleError when invalid."""
    a, b = ex.get(start, []), ex.get(limit, [])
    if len(a) != len(b) or any(not isinstance(x, int) for x in a + b):
        raise ExampleError(f"{start} and {limit}: {len(a)} and {len(b)} int64 values")
    out = []
    for s, e in zip(a, b, strict=True):
        if not 0 <= s <= e < len(chars) or chars[s] < 0 or chars[e] < 0:
            what = "outside the text" if not 0 <= s <= e < len(chars) else "inside a character"
            raise ExampleError(f"{start}/{limit} ({s}, {e}): {what} of {len(chars) - 1} bytes")
        out.append((int(chars[s]), int(chars[e])))
    return out


def document_sentences(ex: dict, stats: collections.Counter) -> tuple[str, list[Sentence]]:
    """(title, sentences) of one parsed Example; each sentence with its spans as character
    ranges in the (trimmed) sentence. ExampleError (or UnicodeDecodeError) when malformed."""
    text = ex.get("text", [])
    if len(text) != 1 or not isinstance(text[0], bytes):
        raise ExampleError("no 'text' bytes feature")
    title = ex.get("title", [b""])
    title = title[0].decode("utf-8").strip() if title and isinstance(title[0], bytes) else ""
    raw = text[0]
    body = raw.decode("utf-8")
    chars = _char_index(raw)
    sents = _ranges(ex, "sentence_byte_start", "sentence_byte_limit", chars)
    spans = _ranges(ex, "span_byte_start", "span_byte_limit", chars)
    mine: list[list[tuple[int, int]]] = [[] for _ in sents]
    for s, e in dict.fromkeys(spans):  # the release keys its spans by offsets: no duplicates
        k = next((k for k, (a, b) in enumerate(sents) if a <= s and e <= b), None)
        if k is None:
            stats["skipped_span_across_sentences"] += 1
        else:
            mine[k].append((s, e))
    out = []
    for (a, b), sp in zip(sents, mine, strict=True):
        piece = body[a:b]
        lead = len(piece) - len(piece.lstrip())
        sentence = piece.strip()
        if not sentence:
            continue
        cands = []
        for s, e in sp:
            s, e = max(s - a - lead, 0), min(e - a - lead, len(sentence))
            if e > s:
                cands.append((s, e, LABEL))
        stats["spans"] += len(cands)
        out.append((sentence, sorted(cands)))
    return title, out


def _bad(skip: bool, stats: collections.Counter, kind: str, where: str, msg: str) -> None:
    if not skip:
        raise RealmRecordsError(f"{where}: {msg} ({SKIP_HINT})")
    stats[f"skipped_{kind}"] += 1


def read_documents(
    spec: str, *, skip_bad_input: bool = False, stats: collections.Counter | None = None
) -> Iterator[Document]:
    """(doc_id "<shard file name>:<record>", title, sentences) of every document of the shards
    `spec` names, shard by shard in sorted order, records in file order."""
    stats = stats if stats is not None else collections.Counter()
    for path in shard_paths(spec):
        name = fs.basename(path)
        records = tfrecord.read_records(path)
        n = 0
        while True:
            try:
                raw = next(records, None)
            except tfrecord.TFRecordError as e:
                _bad(skip_bad_input, stats, "unreadable", path, str(e).removeprefix(f"{path}: "))
                break
            if raw is None:
                break
            where = f"{path}: record {n}"
            try:
                title, sentences = document_sentences(parse_example(raw), stats)
            except ExampleError as e:
                _bad(skip_bad_input, stats, "bad_example", where, f"not a REALM document: {e}")
            except UnicodeDecodeError as e:
                _bad(skip_bad_input, stats, "bad_utf8", where, f"invalid UTF-8 ({e.reason})")
            else:
                stats["documents"] += 1
                yield f"{name}:{n}", title, sentences
            n += 1


def input_files(spec: str) -> list[str]:
    """The files whose contents define the text (for prepare's fingerprint)."""
    return shard_paths(spec)


# ------------------------------------------------------------------------------------- writing
def _feature_bytes(name: str, values: Sequence) -> bytes:
    """A serialized Feature: bytes_list (1) of bytes/str, float_list (2) of floats, int64_list
    (3) of ints (packed; an empty list is an empty int64_list)."""
    values = list(values)
    if values and all(isinstance(v, bytes | str) for v in values):
        raw = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
        return protowire.encode_len_field(
            1, b"".join(protowire.encode_len_field(1, v) for v in raw)
        )
    if values and all(isinstance(v, float) for v in values):
        packed = struct.pack(f"<{len(values)}f", *values)
        return protowire.encode_len_field(2, protowire.encode_len_field(1, packed))
    if all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values):
        ints = [int(v) for v in values]
        if any(not -(1 << 63) <= v < 1 << 63 for v in ints):
            raise ValueError(f"feature {name!r}: a value does not fit int64")
        payload = protowire.encode_packed_varints(1, ints) if ints else b""
        return protowire.encode_len_field(3, payload)
    kinds = sorted({type(v).__name__ for v in values})
    raise ValueError(
        f"feature {name!r}: values of type {', '.join(kinds)}; expected a list of bytes (or "
        "str), of ints or of floats"
    )


def encode_example(features: dict[str, Sequence[bytes] | Sequence[int]]) -> bytes:
    """A serialized tf.train.Example holding `features` ({name: list of values}: bytes or str
    as a bytes_list, ints as an int64_list, floats as a float_list), names in sorted order so
    that the same features give the same bytes. parse_example reads it back."""
    entries = []
    for name in sorted(features):
        if not isinstance(name, str) or not name:
            raise ValueError(f"feature name {name!r}: expected a non-empty string")
        entry = protowire.encode_len_field(1, name.encode("utf-8")) + protowire.encode_len_field(
            2, _feature_bytes(name, features[name])
        )
        entries.append(protowire.encode_len_field(1, entry))  # Features.feature: map entries
    return protowire.encode_len_field(1, b"".join(entries))  # Example.features


WriteDocument = tuple[str, Sequence[tuple[str, Sequence[tuple]]]]  # (title, sentences)


def document_features(title: str, sentences: Sequence[tuple[str, Sequence[tuple]]]) -> dict:
    """The features of one document: title, its sentences joined by single spaces as text,
    and the byte offsets of each sentence and each span. A sentence is (text, spans), a span
    (start, end[, label]): a character range in that sentence (end exclusive; a label is
    ignored: the format has none), as document_sentences yields them. ValueError when a
    sentence is empty or has surrounding whitespace, or a span is empty or outside its
    sentence."""
    parts: list[bytes] = []
    feats: dict[str, list] = {k: [] for k in ("sentence_byte_start", "sentence_byte_limit")}
    feats.update(span_byte_start=[], span_byte_limit=[])
    pos = 0
    for k, (sentence, spans) in enumerate(sentences):
        where = f"document {title!r}: sentence {k}"
        if not sentence.strip() or sentence != sentence.strip():
            raise ValueError(f"{where}: {sentence!r} is empty or has surrounding whitespace")
        if parts:
            parts.append(b" ")
            pos += 1
        raw = sentence.encode("utf-8")
        feats["sentence_byte_start"].append(pos)
        feats["sentence_byte_limit"].append(pos + len(raw))
        for span in spans:
            s, e = int(span[0]), int(span[1])
            if not 0 <= s < e <= len(sentence):
                raise ValueError(f"{where}: span ({s}, {e}) is empty or outside the sentence")
            feats["span_byte_start"].append(pos + len(sentence[:s].encode("utf-8")))
            feats["span_byte_limit"].append(pos + len(sentence[:e].encode("utf-8")))
        parts.append(raw)
        pos += len(raw)
    return {"title": [title.encode("utf-8")], "text": [b"".join(parts)], **feats}


def write_documents(path: str, docs: Iterable[WriteDocument]) -> int:
    """Write documents, each (title, sentences) as document_features takes them, as one REALM
    shard at `path` (local or gs://): GZIP-compressed TFRecord of tf.train.Example, the format
    read_documents reads (it yields the same titles, sentences and spans). The gzip header
    holds no time and no name, so the same documents give the same bytes; the file is built
    in memory and written whole (atomically where local). Returns the number of documents."""
    records = [tfrecord.encode_record(encode_example(document_features(t, s))) for t, s in docs]
    fs.write_bytes(path, gzip.compress(b"".join(records), compresslevel=6, mtime=0))
    return len(records)
