"""`realm-jax world` (data/world.py): the seeded knowledge world, its files read back by the
product's readers (corpus, REALM shards, QA) and the shards by TensorFlow (or, without it, by
the protobuf library) as independent references."""

import collections
import gzip
import json
import os
import re

import pytest

from realm_jax import cli
from realm_jax import tokenization as tk
from realm_jax.config import ConfigError, load_config
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import world as W
from realm_jax.interop import protowire, realm_records, tfrecord
from realm_jax.qa import answers
from tests.conftest import REPO

CONFIG = os.path.join(REPO, "configs", "realm.py")
SMALL = dict(entities=30, distractors=20, sentences_per_entity=4, mention="name", seed=0, shards=2)
# (names: the Settings default "made_up"; the world config sets "words")


def settings(**kw) -> W.Settings:
    return W.Settings(**{**SMALL, **kw})


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("world-name"))
    W.write_world(out, settings())
    return out


@pytest.fixture(scope="module")
def described(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("world-attributes"))
    W.write_world(out, settings(mention="attributes", seed=3))
    return out


def tree(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def people(folder: str) -> list[dict]:
    return jsonl(os.path.join(folder, W.PEOPLE))


def text_documents(folder: str) -> list[tuple[str, str, list]]:
    return list(realm_records.read_documents(os.path.join(folder, W.TEXT_DIR)))


def mentions(value: str, text: str) -> int:
    return len(re.findall(rf"\b{re.escape(value)}\b", text, flags=re.IGNORECASE))


# ------------------------------------------------------------------------------- the world
def test_vocab_cities_professions_and_years_are_one_wordpiece():
    values = [*W.CITIES, *W.PROFESSIONS, *map(str, W.YEARS)]
    lengths = {v: len(e.ids) for v, e in zip(values, tk.wordpieces(values), strict=True)}
    assert {v: n for v, n in lengths.items() if n != 1} == {}
    assert len(set(W.CITIES)) == len(W.CITIES) >= 40
    assert len(set(W.PROFESSIONS)) == len(W.PROFESSIONS) >= 30


def test_same_seed_same_bytes_other_seed_differs(named, tmp_path):
    again = str(tmp_path / "again")
    W.write_world(again, settings())
    first, second = tree(named), tree(again)
    shards = [os.path.join(*n.split("/")) for n in W.shard_names(2)]
    assert set(first) == {W.CORPUS, W.QA, W.PEOPLE, W.MANIFEST, *shards}
    assert first == second
    other = str(tmp_path / "other")
    W.write_world(other, settings(seed=1))
    third = tree(other)
    for rel in (W.CORPUS, W.QA, W.PEOPLE, *shards):
        assert third[rel] != first[rel], rel


def test_people_names_and_attribute_pairs_are_unique(named):
    rows = people(named)
    assert len(rows) == 50 and sum(r["distractor"] for r in rows) == 20
    assert [r["id"] for r in rows] == [f"person-{i:05d}" for i in range(50)]
    names = [r["name"] for r in rows]
    assert len(set(names)) == len(names)
    vocab = W._vocab_words()
    for name in names:
        parts = name.split()
        assert len(parts) == 2 and all(p[0].isupper() and p.isalpha() for p in parts), name
        assert not any(p.lower() in vocab for p in parts), name  # not real words
        others = [n for n in names if n != name]
        assert not any(mentions(name, o) for o in others), name  # none inside another
    for r in rows:
        assert r["city"] in W.CITIES and r["profession"] in W.PROFESSIONS
        assert 1900 <= r["year"] <= 1999
    for a, b in (("profession", "year"), ("city", "year"), ("city", "profession")):
        pairs = [(r[a], r[b]) for r in rows]
        assert len(set(pairs)) == len(pairs), (a, b)


def test_config_checks():
    config = load_config(f"{CONFIG}:world")
    s = W.Settings.from_config(config)
    assert (s.entities, s.distractors, s.mention, s.shards) == (500, 500, "name", 2)
    assert s.names == "words"
    with pytest.raises(ConfigError, match="configs/realm.py:world"):
        W.Settings.from_config(load_config(f"{CONFIG}:smoke"))
    for bad, match in (
        (dict(mention="pronoun"), "mention"),
        (dict(entities=0), "entities"),
        (dict(shards=31), "shards"),
        (dict(entities=3000, distractors=2000), "exceed"),
        (dict(names="initials"), "names"),
    ):
        with pytest.raises(ConfigError, match=match):
            settings(**bad).check()


# ----------------------------------------------------------------------------- the corpus
def test_knowledge_documents_fit_one_block(named):
    path = os.path.join(named, W.CORPUS)
    stats = collections.Counter()
    docs = list(corpus_lib.read_documents(path, stats=stats))
    rows = {r["id"]: r for r in people(named)}
    assert stats["documents"] == len(docs) == 50
    assert [d[0] for d in docs] != sorted(rows)  # a seeded order, not id order
    for doc_id, title, text in docs:
        p = rows[doc_id]
        assert title == p["name"]
        for value in (p["city"], str(p["year"]), p["profession"]):
            assert mentions(value, text) == 1, (value, text)
        ids, _ = tk.block_ids(*[e.ids for e in tk.wordpieces([title, text])], 10_000)
        assert len(ids) <= 48, (len(ids), text)  # one block of configs/realm.py:world


def test_word_names_are_two_one_piece_words_none_shared():
    """names="words": each part ONE wordpiece of the vocab (so BERT's embeddings know it),
    no word in two names, none a city, profession or template word; the text's spans still
    the knowledge document's values."""
    world = W.generate(settings(names="words", entities=200, distractors=100))
    parts = [w.lower() for p in world.people for w in p.name.split()]
    assert len(parts) == len(set(parts)) == 600
    taken = {w.lower() for w in (*W.CITIES, *W.PROFESSIONS)} | {"born", "lives", "works"}
    assert not taken & set(parts)
    for enc in tk.wordpieces(parts):
        assert len(enc.ids) == 1
    with pytest.raises(ConfigError, match="name words"):
        W._word_names(0, len(W._name_words()) // 2 + 1)


# ---------------------------------------------------------------------- the annotated text
def test_text_spans_are_attribute_values_the_knowledge_document_holds(named):
    by_name = {r["name"]: r for r in people(named)}
    corpus = {title: text for _, title, text in corpus_lib.read_documents(f"{named}/corpus.jsonl")}
    docs = text_documents(named)
    assert len(docs) == 30
    assert [d[0].split(":")[0] for d in docs[:1]] == ["world-00000-of-00002.tfrecord.gz"]
    for _, title, sentences in docs:
        p = by_name[title]
        assert not p["distractor"]
        assert len(sentences) == 4
        told = []
        for sentence, spans in sentences:
            assert len(spans) == 1, sentence
            s, e, _ = spans[0]
            value = sentence[s:e]
            attribute = next(a for a in W.ATTRIBUTES if str(p[a]) == value)
            told.append(attribute)
            assert mentions(value, corpus[title]) == 1  # its knowledge document holds it
            assert mentions(value, sentence) == 1
            assert title in sentence  # mention="name"
            fields = dict(p, name=title, a="an" if p["profession"][0] in "aeiou" else "a")
            restated = {t.format(**fields) for a in W.ATTRIBUTES for t in W.KNOWLEDGE[a]}
            assert sentence not in restated  # other words than the knowledge document's
        assert set(told) == set(W.ATTRIBUTES)  # cycled: every attribute restated
        assert told[3] == told[0]


def test_span_bytes_are_exactly_the_attribute_value(named):
    by_name = {r["name"]: r for r in people(named)}
    values = 0
    for rel in W.shard_names(2):
        for raw in tfrecord.read_records(os.path.join(named, rel)):
            ex = realm_records.parse_example(raw)
            (text,) = ex["text"]
            p = by_name[ex["title"][0].decode()]
            starts, limits = ex["span_byte_start"], ex["span_byte_limit"]
            bounds = zip(ex["sentence_byte_start"], ex["sentence_byte_limit"], strict=True)
            for (a, b), s, e in zip(bounds, starts, limits, strict=True):
                assert a <= s < e <= b
                assert text[s:e] in {str(p[k]).encode() for k in W.ATTRIBUTES}
                values += 1
    assert values == 30 * 4


def test_distractors_never_appear_in_the_text_or_the_questions(named):
    rows = people(named)
    distractors = [r for r in rows if r["distractor"]]
    sentences = [s for _, _, sents in text_documents(named) for s, _ in sents]
    titles = {t for _, t, _ in text_documents(named)}
    qa = jsonl(os.path.join(named, W.QA))
    for r in distractors:
        assert r["name"] not in titles
        assert not any(r["name"] in s for s in sentences)
        assert not any(r["name"] in json.dumps(q) or q["gold_passage"] == r["id"] for q in qa)


def test_attribute_mentions_never_name_a_person(described):
    rows = people(described)
    docs = text_documents(described)
    words = {w for r in rows for w in r["name"].split()}
    by_name = {r["name"]: r for r in rows}
    for _, title, sentences in docs:
        p = by_name[title]
        for sentence, [(s, e, _)] in sentences:
            assert not words.intersection(re.findall(r"\w+", sentence)), sentence
            masked = next(a for a in W.ATTRIBUTES if str(p[a]) == sentence[s:e])
            assert mentions(sentence[s:e], sentence) == 1
            known = [a for a in W.ATTRIBUTES if a != masked]
            for a in known:  # described by the two others...
                assert mentions(str(p[a]), sentence) == 1, (a, sentence)
            fits = [r for r in rows if all(mentions(str(r[a]), sentence) for a in known)]
            assert [r["id"] for r in fits] == [p["id"]]  # ...which only this person has


@pytest.fixture(scope="module")
def paraphrased(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("world-described"))
    W.write_world(out, settings(mention="described", seed=5, names="words"))
    return out


# bm25s's English stopwords (realm_jax/index/bm25.py), written out: BM25 ignores them
STOPWORDS = set(
    "a an and are as at be but by for if in into is it no not of on or such that the their "
    "then there these they this to was will with".split()
)


def test_descriptions_share_no_word_with_what_bm25_could_match():
    """Each profession's description: no word of any profession, city or knowledge-document
    template, nor of another description (stopwords aside), so BM25 cannot match it."""
    known = {w.lower() for w in (*W.PROFESSIONS, *W.CITIES)}
    for templates in W.KNOWLEDGE.values():
        known |= {w.lower() for t in templates for w in re.findall(r"[A-Za-z]+", t)}
    assert sorted(W.DESCRIPTIONS) == sorted(W.PROFESSIONS)
    seen: dict[str, str] = {}
    for profession, description in W.DESCRIPTIONS.items():
        words = set(re.findall(r"[a-z]+", description)) - STOPWORDS
        assert words and not words & known, (profession, words & known)
        for w in words:
            assert w not in seen, f"{w!r} describes {seen.get(w)} and {profession}"
            seen[w] = profession


def test_described_sentences_name_the_profession_only_in_other_words(paraphrased):
    rows = people(paraphrased)
    by_name = {r["name"]: r for r in rows}
    names = {w for r in rows for w in r["name"].split()}
    kinds = collections.Counter()
    for _, title, sentences in text_documents(paraphrased):
        p = by_name[title]
        for sentence, [(s, e, _)] in sentences:
            assert not names.intersection(re.findall(r"\w+", sentence)), sentence
            masked = next(a for a in W.ATTRIBUTES if str(p[a]) == sentence[s:e])
            assert mentions(sentence[s:e], sentence) == 1
            kinds[masked] += 1
            if masked == "profession":  # by city and year, as in "attributes"
                assert mentions(p["city"], sentence) and mentions(str(p["year"]), sentence)
                continue
            other = "year" if masked == "city" else "city"
            assert mentions(str(p[other]), sentence) == 1, sentence
            assert W.DESCRIPTIONS[p["profession"]] in sentence, sentence
            assert not any(mentions(x, sentence) for x in W.PROFESSIONS), sentence
            # the literal attribute is shared: BM25's match is ambiguous, the pair is not
            fits = [r for r in rows if mentions(str(r[other]), sentence)]
            pair = [r for r in fits if W.DESCRIPTIONS[r["profession"]] in sentence]
            assert [r["id"] for r in pair] == [p["id"]]
    assert set(kinds) == set(W.ATTRIBUTES)


# ----------------------------------------------------------------- independent references
def _protobuf_example_class():
    """tf.train.Example (tensorflow/core/example/{example,feature}.proto) built with protobuf."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="world_ex.proto", package="wx", syntax="proto3")
    for name, kind in (("BytesList", F.TYPE_BYTES), ("FloatList", F.TYPE_FLOAT)):
        fdp.message_type.add(name=name).field.add(
            name="value", number=1, type=kind, label=F.LABEL_REPEATED
        )
    fdp.message_type.add(name="Int64List").field.add(
        name="value", number=1, type=F.TYPE_INT64, label=F.LABEL_REPEATED
    )
    feat = fdp.message_type.add(name="Feature")
    feat.oneof_decl.add(name="kind")
    for i, (field, msg) in enumerate(
        (("bytes_list", "BytesList"), ("float_list", "FloatList"), ("int64_list", "Int64List")), 1
    ):
        feat.field.add(
            name=field, number=i, type=F.TYPE_MESSAGE, type_name=f".wx.{msg}", oneof_index=0
        )
    feats = fdp.message_type.add(name="Features")
    entry = feats.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, type_name=".wx.Feature")
    feats.field.add(
        name="feature",
        number=1,
        type=F.TYPE_MESSAGE,
        type_name=".wx.Features.FeatureEntry",
        label=F.LABEL_REPEATED,
    )
    fdp.message_type.add(name="Example").field.add(
        name="features", number=1, type=F.TYPE_MESSAGE, type_name=".wx.Features"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("wx.Example"))


def _values(feature) -> list:
    kind = feature.WhichOneof("kind")
    return list(getattr(feature, kind).value) if kind else []


def _written(folder: str) -> list[list[dict]]:
    """The features the generator meant to write, per shard."""
    world = W.generate(settings())
    return [[realm_records.document_features(t, s) for t, s in shard] for shard in world.text]


def test_shards_parse_with_the_protobuf_library(named):
    pytest.importorskip("google.protobuf")
    example = _protobuf_example_class()
    for rel, want in zip(W.shard_names(2), _written(named), strict=True):
        with gzip.open(os.path.join(named, rel), "rb") as f:
            raw = f.read()
        records, pos = [], 0
        while pos < len(raw):  # TFRecord framing, read by hand
            n = int.from_bytes(raw[pos : pos + 8], "little")
            records.append(raw[pos + 12 : pos + 12 + n])
            pos += 16 + n
        got = []
        for r in records:
            ex = example.FromString(r)
            got.append({k: _values(v) for k, v in ex.features.feature.items()})
        assert got == want


def test_shards_parse_with_tensorflow(named):
    tf = pytest.importorskip("tensorflow")
    for rel, want in zip(W.shard_names(2), _written(named), strict=True):
        ds = tf.data.TFRecordDataset(os.path.join(named, rel), compression_type="GZIP")
        got = []
        for raw in ds.as_numpy_iterator():
            ex = tf.train.Example.FromString(raw)
            got.append({k: list(_values(v)) for k, v in ex.features.feature.items()})
        assert got == want


def test_encoders_round_trip():
    for v in (0, 1, 127, 128, 300, 2**63 - 1, -1, -(2**63)):
        got, end = protowire.varint(protowire.encode_varint(v), 0)
        assert protowire.int64(got) == v and end == len(protowire.encode_varint(v))
    assert len(protowire.encode_varint(-1)) == 10
    features = {"b": [b"x", "\u00e9"], "i": [3, -4, 2**40], "f": [0.5], "e": []}
    back = realm_records.parse_example(realm_records.encode_example(features))
    assert back == {"b": [b"x", "\u00e9".encode()], "i": [3, -4, 2**40], "f": [0.5], "e": []}
    with pytest.raises(ValueError, match="feature 'x'"):
        realm_records.encode_example({"x": [1, b"a"]})
    doc = ("T\u00e9", [("\u00c9mile lives in \u0141\u00f3d\u017a.", [(0, 5), (15, 19)])])
    feats = realm_records.document_features(*doc)
    assert feats["text"][0][feats["span_byte_start"][1] : feats["span_byte_limit"][1]] == (
        "\u0141\u00f3d\u017a".encode()
    )


# ----------------------------------------------------------------------------- questions
def test_questions_read_as_squad_style(named):
    qa = answers.read_questions(os.path.join(named, W.QA))
    rows = {r["id"]: r for r in people(named)}
    assert len(qa) == 30 * 3
    for q in qa:
        p = rows[q.gold_passage]
        assert not p["distractor"] and q.title == p["name"] and p["name"] in q.question
        (answer,) = q.answers
        assert answer in {p["city"], str(p["year"]), p["profession"]}
        assert answer not in q.question


# ------------------------------------------------------------------ the command, the workdir
def test_command_writes_every_file_and_reruns(tmp_path, capsys):
    out = str(tmp_path / "w")
    argv = ["world", "--config", f"{CONFIG}:world", "--workdir", out]
    argv += [f"--config.world.{k}={v}" for k, v in SMALL.items()]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "30 people in the text + 20 distractors" in printed
    assert "prepare --config" in printed and "next:" in printed
    written = tree(out)
    shards = [os.path.join(*n.split("/")) for n in W.shard_names(2)]
    assert set(written) == {W.CORPUS, W.QA, W.PEOPLE, W.MANIFEST, *shards}
    manifest = json.loads(written[W.MANIFEST])
    assert manifest["world"] == {**SMALL, "names": "words"} and manifest["complete"]
    assert manifest["counts"]["text_sentences"] == 120 and manifest["counts"]["questions"] == 90
    assert cli.main(argv) == 0  # the same world again: fine, the same bytes
    assert tree(out) == written
    assert cli.main([*argv, "--config.world.seed=5"]) == cli.EXIT_USER_ERROR
    assert "holds a different world" in capsys.readouterr().err
    assert tree(out) == written


def test_workdir_holding_other_files_is_refused(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"title": "t", "text": "x"}\n')
    with pytest.raises(W.WorldError, match="no world.json"):
        W.write_world(str(tmp_path), settings())
    os.remove(tmp_path / "corpus.jsonl")
    W.write_world(str(tmp_path), settings())
    (tmp_path / "text" / "other.tfrecord.gz").write_bytes(b"")  # prepare would read it too
    with pytest.raises(W.WorldError, match="does not write"):
        W.write_world(str(tmp_path), settings())
    (tmp_path / "world.json").write_text("{}")
    with pytest.raises(W.WorldError, match="not a world manifest"):
        W.write_world(str(tmp_path), settings())


def test_config_without_a_world_section_is_a_clear_error(tmp_path, capsys):
    out = str(tmp_path / "w")
    assert cli.main(["world", "--config", f"{CONFIG}:smoke", "--workdir", out]) == 2
    err = capsys.readouterr().err
    assert "realm-jax world: error:" in err and "configs/realm.py:world" in err
    assert not os.path.exists(out)
