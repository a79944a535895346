"""REALM's pre-training shards (interop/realm_records.py): the tf.train.Example decoder, the GZIP
TFRecord reading, and prepare taking their sentences and annotated salient spans (no NER)."""

import collections
import gzip
import os
import struct

import numpy as np
import pytest

from realm_jax.config import load_config
from realm_jax.data import datasets, local_prepare, masking
from realm_jax.data import prepare as P
from realm_jax.interop import realm_records, tfrecord
from tests.conftest import REPO

SAMPLE = os.path.join(REPO, "data", "sample", "corpus.jsonl")

# Document A (Example built by the protobuf library when installed): 4 sentences, the first's
# limit keeps its trailing space. Byte offsets differ from char offsets after "ł" (2 bytes).
TEXT_A = (
    "Marie Curie was born in Warsaw in 1867. She moved to Paris with her sister Bronisława. "
    "In Zürich, Émile met Curie in 1891 at the café. The weather was fine that day."
)
SENTS_A = [(0, 40), (40, 87), (88, 138), (139, 169)]
SPANS_A = [
    (0, 11),  # Marie Curie
    (24, 30),  # Warsaw
    (34, 38),  # 1867
    (0, 11),  # Marie Curie again: one candidate
    (53, 58),  # Paris
    (75, 86),  # Bronisława
    (75, 98),  # "Bronisława. In Zürich": crosses a sentence boundary, dropped
    (91, 98),  # Zürich
    (100, 106),  # Émile
    (120, 124),  # 1891
]
# Document B (hand-encoded: int64 lists not packed): 2 sentences of non-ASCII text.
TEXT_B = "Le prix Nobel de physique fut décerné à Pierre Curie en 1903. Ölçek and Łódź are far."
SENTS_B = [(0, 64), (65, 93)]
SPANS_B = [(43, 55), (59, 63), (77, 84)]  # Pierre Curie, 1903, Łódź

# What prepare must make of them, worked out by hand: (text, doc_id, [(first, last)] in
# token_ids, [CLS] at 0). The last sentence of A has no span: skipped_no_span.
EXPECTED = [
    ("Marie Curie was born in Warsaw in 1867.", "a.tfrecord.gz:0", [(1, 3), (7, 7), (9, 9)]),
    ("She moved to Paris with her sister Bronisława.", "a.tfrecord.gz:0", [(4, 4), (8, 11)]),
    (
        "In Zürich, Émile met Curie in 1891 at the café.",
        "a.tfrecord.gz:0",
        [(2, 2), (4, 4), (9, 9)],
    ),
    (
        "Le prix Nobel de physique fut décerné à Pierre Curie en 1903.",
        "b.tfr.gz:0",
        [(14, 16), (18, 18)],
    ),
    ("Ölçek and Łódź are far.", "b.tfr.gz:0", [(4, 4)]),
]


# ------------------------------------------------------------------------- protobuf encoding
def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _len_field(num: int, data: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def hand_example(features: dict) -> bytes:
    """A serialized tf.train.Example: bytes/float lists, int64 lists NOT packed (a writer may
    do either), plus an unknown field the decoder must skip."""
    entries = b""
    for name, values in features.items():
        if values and isinstance(values[0], bytes):
            kind = _len_field(1, b"".join(_len_field(1, v) for v in values))
        elif values and isinstance(values[0], float):
            kind = _len_field(
                2, b"".join(_varint(1 << 3 | 5) + struct.pack("<f", v) for v in values)
            )
        else:
            kind = _len_field(3, b"".join(_varint(1 << 3 | 0) + _varint(v) for v in values))
        entries += _len_field(1, _len_field(1, name.encode()) + _len_field(2, kind))
    unknown = _varint(7 << 3 | 0) + _varint(300)
    return unknown + _len_field(1, entries)


def _example_class():
    """tf.train.Example defined from its .proto (tensorflow/core/example/*.proto) with the
    protobuf library, or None when protobuf is not installed."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError:
        return None
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="realm_test_example.proto", package="realmtest", syntax="proto3"
    )
    for name, ftype in (
        ("BytesList", F.TYPE_BYTES),
        ("FloatList", F.TYPE_FLOAT),
        ("Int64List", F.TYPE_INT64),
    ):
        m = fdp.message_type.add(name=name)
        m.field.add(name="value", number=1, type=ftype, label=F.LABEL_REPEATED)
    feat = fdp.message_type.add(name="Feature")
    feat.oneof_decl.add(name="kind")
    for num, (field, msg) in enumerate(
        (("bytes_list", "BytesList"), ("float_list", "FloatList"), ("int64_list", "Int64List")), 1
    ):
        feat.field.add(
            name=field,
            number=num,
            type=F.TYPE_MESSAGE,
            type_name=f".realmtest.{msg}",
            label=F.LABEL_OPTIONAL,
            oneof_index=0,
        )
    feats = fdp.message_type.add(name="Features")
    entry = feats.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(
        name="value",
        number=2,
        type=F.TYPE_MESSAGE,
        type_name=".realmtest.Feature",
        label=F.LABEL_OPTIONAL,
    )
    feats.field.add(
        name="feature",
        number=1,
        type=F.TYPE_MESSAGE,
        type_name=".realmtest.Features.FeatureEntry",
        label=F.LABEL_REPEATED,
    )
    ex = fdp.message_type.add(name="Example")
    ex.field.add(
        name="features",
        number=1,
        type=F.TYPE_MESSAGE,
        type_name=".realmtest.Features",
        label=F.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("realmtest.Example"))


def library_example(features: dict) -> bytes:
    """The same Example serialized by the protobuf library (int64 lists packed, as TF writes
    them); the hand encoder when protobuf is missing."""
    cls = _example_class()
    if cls is None:
        return hand_example(features)
    ex = cls()
    for name, values in features.items():
        f = ex.features.feature[name]
        if values and isinstance(values[0], bytes):
            f.bytes_list.value.extend(values)
        elif values and isinstance(values[0], float):
            f.float_list.value.extend(values)
        else:
            f.int64_list.value.extend(values)
    return ex.SerializeToString()


def realm_doc(title: str, text: str, sents, spans) -> dict:
    return {
        "title": [title.encode()],
        "text": [text.encode()],
        "sentence_byte_start": [a for a, _ in sents],
        "sentence_byte_limit": [b for _, b in sents],
        "span_byte_start": [a for a, _ in spans],
        "span_byte_limit": [b for _, b in spans],
    }


def write_shard(path, records: list[bytes]) -> str:
    """A GZIP TFRecord file as TFRecordWriter(compression GZIP) writes it."""
    with open(path, "wb") as f:
        f.write(gzip.compress(b"".join(tfrecord.encode_record(r) for r in records)))
    return str(path)


@pytest.fixture
def shards(tmp_path):
    d = tmp_path / "pretrain"
    d.mkdir()
    write_shard(
        d / "a.tfrecord.gz", [library_example(realm_doc("Marie Curie", TEXT_A, SENTS_A, SPANS_A))]
    )
    write_shard(d / "b.tfr.gz", [hand_example(realm_doc("Prix Nobel", TEXT_B, SENTS_B, SPANS_B))])
    return str(d)


def _config(corpus, sentences, *overrides):
    return load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"),
        [
            f"data.corpus={corpus}",
            f"data.sentences={sentences}",
            "data.eval_fraction=0",
            "data.engine=auto",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    with open(SAMPLE) as f, open(out, "w") as g:
        g.writelines(line for _, line in zip(range(3), f, strict=False))
    return str(out)


@pytest.fixture
def no_ner(monkeypatch):
    """spaCy's NER must not run: loading or using it fails the test."""

    def boom(*a, **k):
        raise AssertionError("NER was run on REALM's annotated shards")

    monkeypatch.setattr(masking, "load_ner", boom)
    monkeypatch.setattr(masking.Masker, "candidates", boom)


# ------------------------------------------------------------------------------------ decoder
def test_the_offsets_above_are_right():
    raw_a, raw_b = TEXT_A.encode(), TEXT_B.encode()
    assert [raw_a[a:b].decode().strip() for a, b in SENTS_A][:3] == [e[0] for e in EXPECTED[:3]]
    assert [raw_b[a:b].decode() for a, b in SENTS_B] == [e[0] for e in EXPECTED[3:]]
    assert raw_a[75:86].decode() == "Bronisława" and raw_a[91:98].decode() == "Zürich"
    assert [raw_b[a:b].decode() for a, b in SPANS_B] == ["Pierre Curie", "1903", "Łódź"]


def test_decoder_known_values():
    feats = {
        "title": [b"T\xc3\xa9st", b""],
        "text": ["Zürich ünd Łódź".encode()],
        "ints": [0, 1, 127, 128, 300, 2**40, -5, -(2**63), 2**63 - 1],
        "floats": [0.5, -2.25],
    }
    for enc in (hand_example, library_example):
        ex = realm_records.parse_example(enc(feats))
        assert ex == feats, enc.__name__
    assert realm_records.parse_example(b"") == {}
    lib = _example_class()
    if lib is not None:  # an empty Feature (no kind set) is an empty list
        m = lib()
        m.features.feature["empty"].SetInParent()
        assert realm_records.parse_example(m.SerializeToString()) == {"empty": []}
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x0b", b"\xff" * 11):
        with pytest.raises(realm_records.ExampleError):
            realm_records.parse_example(bad)


def test_document_sentences_byte_to_char_offsets():
    stats = collections.Counter()
    ex = realm_records.parse_example(
        hand_example(realm_doc("Prix Nobel", TEXT_B, SENTS_B, SPANS_B))
    )
    title, sents = realm_records.document_sentences(ex, stats)
    assert title == "Prix Nobel"
    assert sents == [
        (EXPECTED[3][0], [(40, 52, "SALIENT"), (56, 60, "SALIENT")]),
        (EXPECTED[4][0], [(10, 14, "SALIENT")]),
    ]
    ex = realm_records.parse_example(library_example(realm_doc("A", TEXT_A, SENTS_A, SPANS_A)))
    _, sents = realm_records.document_sentences(ex, stats)
    assert [len(c) for _, c in sents] == [3, 2, 3, 0]  # duplicate kept once, crossing dropped
    assert sents[1][1][1][:2] == (35, 45)  # Bronisława: chars, not bytes
    assert stats["skipped_span_across_sentences"] == 1
    for bad_spans, why in (([(82, 86)], "inside a character"), ([(0, 500)], "outside the text")):
        ex = realm_records.parse_example(hand_example(realm_doc("A", TEXT_A, SENTS_A, bad_spans)))
        with pytest.raises(realm_records.ExampleError, match=why):
            realm_records.document_sentences(ex, stats)


def test_shard_paths_glob_folder_file(shards, tmp_path):
    a, b = os.path.join(shards, "a.tfrecord.gz"), os.path.join(shards, "b.tfr.gz")
    assert realm_records.shard_paths(shards) == [a, b]
    assert realm_records.shard_paths(os.path.join(shards, "*.gz")) == [a, b]
    assert realm_records.shard_paths(b) == [b]
    for spec in (shards, os.path.join(shards, "*.tfrecord.gz"), os.path.join(shards, "*"), b):
        assert realm_records.is_release_text(spec)
    assert not realm_records.is_release_text(os.path.join(shards, "*.jsonl"))
    assert not realm_records.is_release_text(SAMPLE) and not realm_records.is_release_text("")
    with pytest.raises(realm_records.RealmRecordsError, match="matches no file"):
        realm_records.shard_paths(os.path.join(shards, "*.tfrecord"))
    (tmp_path / "pretrain" / "notes.txt").write_text("x")
    with pytest.raises(realm_records.RealmRecordsError, match="both .txt"):
        realm_records.shard_paths(shards)


# ------------------------------------------------------------------------------------ prepare
def test_prepare_takes_sentences_and_spans_from_the_shards(tmp_path, shards, corpus, no_ner):
    d = str(tmp_path / "data")
    s = P.prepare(_config(corpus, shards), d)
    assert s["engine"] == "local" and s["masking"] == "salient"
    c = s["counts"]
    assert c["sentences"] == 6 and c["skipped_no_span"] == 1 and c["examples"] == 5
    assert c["sentences_documents"] == 2 and c["sentences_skipped_span_across_sentences"] == 1
    assert c["salient_spans"] == 11
    src = datasets.examples_source(d)
    got = []
    for i in range(len(src)):
        r = src[i]
        assert r["block_id"] == -1 and r["example_id"] == i
        assert r["span_labels"] == b",".join([b"SALIENT"] * len(r["span_starts"]))
        spans = list(zip(r["span_starts"].tolist(), r["span_ends"].tolist(), strict=True))
        got.append((r["text"].decode(), r["doc_id"].decode(), spans))
    assert got == EXPECTED
    assert np.all(src[0]["token_ids"][:2] == [101, 5032])  # [CLS] marie
    # a glob naming the same shards is the same input
    assert P.fingerprint(_config(corpus, os.path.join(shards, "*.gz")).data) == s["fingerprint"]


def test_random_masking_ignores_the_spans(tmp_path, shards, corpus, no_ner):
    data = _config(corpus, shards).data
    texts, _, _, _, _, given = local_prepare.pretraining_sentences(data, [], collections.Counter())
    assert len(texts) == len(given) == 6
    s = P.prepare(_config(corpus, shards, "data.masking=random"), str(tmp_path / "d"))
    assert s["masking"] == "random" and s["counts"]["examples"] == 6


def test_beam_refuses_the_shards_in_one_line(shards, corpus):
    for over in (["data.engine=beam"], []):
        cfg = _config(corpus, shards, *over)
        runner = "" if over else "DirectRunner"
        with pytest.raises(datasets.PrepareError, match="in process") as e:
            P.choose_engine(cfg.data, runner)
        assert "\n" not in str(e.value)
    assert P.choose_engine(_config(corpus, shards).data) == "local"
    pytest.importorskip("apache_beam")
    from realm_jax.data import beam_prepare

    assert "in-process" in beam_prepare.supported(_config(corpus, shards).data)


def _corrupt_cases(d):
    """{what the error says: shard}, each bad at record 1 (record 0 is a good document)."""
    good = library_example(realm_doc("Marie Curie", TEXT_A, SENTS_A, SPANS_A))
    framed = tfrecord.encode_record(good) * 2
    bad_crc = bytearray(framed)
    bad_crc[len(framed) // 2 + 40] ^= 1  # inside record 1's data
    paths = {"checksum": str(d / "crc.tfrecord.gz")}
    with open(paths["checksum"], "wb") as f:
        f.write(gzip.compress(bytes(bad_crc)))
    noise = np.random.default_rng(0).bytes(4000)  # incompressible: the cut falls inside it
    whole = gzip.compress(tfrecord.encode_record(good) + tfrecord.encode_record(noise))
    paths["unreadable data"] = str(d / "cut.tfrecord.gz")
    with open(paths["unreadable data"], "wb") as f:
        f.write(whole[:-2000])  # a download that stopped part way
    paths["not a REALM document"] = write_shard(d / "junk.tfrecord.gz", [good, b"\x0a\x09oops"])
    return paths


def test_corrupt_shard_is_one_line_naming_file_and_record(tmp_path, corpus, no_ner):
    folder = tmp_path / "bad"
    folder.mkdir()
    for what, path in _corrupt_cases(folder).items():
        with pytest.raises(realm_records.RealmRecordsError) as e:
            list(realm_records.read_documents(path))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{path}: record 1") and what in msg, msg
        stats = collections.Counter()
        docs = list(realm_records.read_documents(path, skip_bad_input=True, stats=stats))
        assert len(docs) == 1 and stats["skipped_unreadable"] + stats["skipped_bad_example"] == 1
    with pytest.raises(realm_records.RealmRecordsError, match="record 1") as e:
        P.prepare(_config(corpus, path), str(tmp_path / "data"))
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "data" / "summary.json")


def test_gs_shards_glob_folder_and_read(tmp_path_factory, shards):
    from realm_jax import fs
    from tests.support import fake_gcs

    with fake_gcs.module_server(tmp_path_factory, "realm-records"):
        root = "gs://realm-records/pretrain"
        for name in ("a.tfrecord.gz", "b.tfr.gz"):
            with open(os.path.join(shards, name), "rb") as f:
                fs.write_bytes(f"{root}/{name}", f.read())
        want = [f"{root}/a.tfrecord.gz", f"{root}/b.tfr.gz"]
        assert realm_records.shard_paths(root) == want
        assert realm_records.shard_paths(f"{root}/*.gz") == want
        assert realm_records.is_release_text(f"{root}/*.gz") and realm_records.is_release_text(root)
        docs = list(realm_records.read_documents(f"{root}/*.tfr.gz"))
        assert [(d, t, [s for s, _ in sents]) for d, t, sents in docs] == [
            ("b.tfr.gz:0", "Prix Nobel", [e[0] for e in EXPECTED[3:]])
        ]
