"""The release's block corpus without TensorFlow: TFRecord files (interop/tfrecord.py), ORQA's
blocks.tfr + titles.tfr and HF's block_records.npy (interop/block_records.py), and a prepared
corpus whose block i is record i. Fixtures: tests/fixtures/release/, written by TensorFlow's
TFRecordWriter and numpy's np.save (tests/fixtures/release/make_fixtures.py)."""

import collections
import gzip
import json
import os
import pickle
import shutil

import numpy as np
import pytest

from realm_jax import tokenization as tk
from realm_jax.config import load_config
from realm_jax.data import datasets, local_prepare, records, release_blocks
from realm_jax.data import prepare as P
from realm_jax.interop import block_records as br
from realm_jax.interop import tfrecord as tr
from tests.conftest import REPO

FIX = os.path.join(REPO, "tests", "fixtures", "release")
with open(os.path.join(FIX, "blocks.json"), encoding="utf-8") as _f:
    WRITTEN = json.load(_f)  # what the fixture script wrote: {"texts": [...], "titles": [...]}


def test_tfrecords_equal_what_tensorflow_wrote():
    texts = [r.decode("utf-8") for r in tr.read_records(os.path.join(FIX, "blocks.tfr"))]
    titles = [r.decode("utf-8") for r in tr.read_records(os.path.join(FIX, "titles.tfr"))]
    assert texts == WRITTEN["texts"] and titles == WRITTEN["titles"]
    assert tr.count_records(os.path.join(FIX, "blocks.tfr")) == 20


def test_writer_matches_tensorflows_bytes(tmp_path):
    out = str(tmp_path / "blocks.tfr")
    assert tr.write_records(out, WRITTEN["texts"]) == 20
    with open(out, "rb") as a, open(os.path.join(FIX, "blocks.tfr"), "rb") as b:
        assert a.read() == b.read()
    tr.write_records(str(tmp_path / "empty.tfr"), [])
    assert list(tr.read_records(str(tmp_path / "empty.tfr"))) == []
    with open(os.path.join(FIX, "titles.tfr"), "rb") as f:
        (tmp_path / "titles.tfr.gz").write_bytes(gzip.compress(f.read()))
    got = [r.decode() for r in tr.read_records(str(tmp_path / "titles.tfr.gz"))]
    assert got == WRITTEN["titles"]


def _damaged(tmp_path, edit) -> str:
    data = bytearray(open(os.path.join(FIX, "blocks.tfr"), "rb").read())
    data = edit(data)
    path = tmp_path / "blocks.tfr"
    path.write_bytes(bytes(data))
    return str(path)


def _offset(k: int) -> int:
    """Byte offset of record k in the fixture (12 + len + 4 bytes a record)."""
    return sum(16 + len(t.encode()) for t in WRITTEN["texts"][:k])


def _flip(pos):
    def edit(d):
        d[pos] ^= 0x01
        return d

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_flip(_offset(3) + 20), r"record 3 \(byte {o3}\): data checksum mismatch"),
        (_flip(_offset(5) + 2), r"record 5 \(byte {o5}\): length checksum mismatch"),
        (lambda d: d[: _offset(9) + 40], r"record 9 \(byte {o9}\): truncated: \d+ data bytes"),
        (lambda d: d[: _offset(19) + 5], r"record 19 \(byte {o19}\): truncated length header"),
    ],
)
def test_corrupt_or_truncated_tfrecords(tmp_path, edit, message):
    path = _damaged(tmp_path, edit)
    pattern = message.format(**{f"o{k}": _offset(k) for k in (3, 5, 9, 19)})
    with pytest.raises(tr.TFRecordError, match=f"blocks.tfr: {pattern}"):
        list(tr.read_records(path))


def test_release_blocks_pair_titles(tmp_path):
    pairs = list(br.read_release_blocks(os.path.join(FIX, "blocks.tfr")))
    assert pairs == list(zip(WRITTEN["titles"], WRITTEN["texts"], strict=True))
    shutil.copy(os.path.join(FIX, "blocks.tfr"), tmp_path / "blocks.tfr")
    tr.write_records(str(tmp_path / "titles.tfr"), WRITTEN["titles"][:-1])
    with pytest.raises(br.BlockRecordsError, match="titles.tfr has 19 records"):
        list(br.read_release_blocks(str(tmp_path / "blocks.tfr")))
    assert [t for t, _ in br.read_release_blocks(str(tmp_path / "blocks.tfr"), None)] == [""] * 20


def test_block_records_npy_equals_numpys_own_reading():
    path = os.path.join(FIX, "block_records.npy")
    got = br.load_npy_strings(path)
    want = np.load(path, allow_pickle=True)  # numpy's own (pickle-running) reader
    assert got.dtype == object and got.shape == want.shape == (20,)
    assert list(got) == list(want) == [t.encode() for t in WRITTEN["texts"]]
    pairs = list(br.read_release_blocks(path))  # titles.tfr lies beside it
    assert pairs == list(zip(WRITTEN["titles"], WRITTEN["texts"], strict=True))


def _npy(path, payload: bytes, shape=(1,)) -> str:
    header = repr({"descr": "|O", "fortran_order": False, "shape": shape}).encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + payload)
    return str(path)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_foreign_callables_are_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    cases = {
        "top": pickle.dumps(_Evil(marker)),
        # an element of an otherwise genuine object array
        "element": pickle.dumps(np.array([b"ok", _Evil(marker)], dtype=object)),
        "eval": b'cbuiltins\neval\n(S\'__import__("os").system("touch %s")\'\ntR.'
        % str(marker).encode(),
    }
    for name, payload in cases.items():
        path = _npy(tmp_path / f"{name}.npy", payload, (2,) if name == "element" else (1,))
        with pytest.raises(br.BlockRecordsError, match="refusing"):
            br.load_npy_strings(path)
    assert not marker.exists()
    with pytest.raises(br.BlockRecordsError, match="refusing posix.system|refusing nt.system"):
        br.load_npy_strings(str(tmp_path / "top.npy"))


def test_other_pickles_of_bytes_arrays(tmp_path):
    texts = [t.encode() for t in WRITTEN["texts"][:5]] + [b""]
    arr = np.array(texts, dtype=object)
    for protocol in (2, 3, 5):  # protocol 2 spells bytes as _codecs.encode(text, "latin1")
        path = _npy(tmp_path / f"p{protocol}.npy", pickle.dumps(arr, protocol=protocol), (6,))
        assert list(br.load_npy_strings(path)) == texts
    fixed = tmp_path / "fixed.npy"
    np.save(fixed, np.array(texts[:3], dtype="S"))
    assert list(br.load_npy_strings(str(fixed))) == texts[:3]
    wrong = _npy(tmp_path / "wrong.npy", pickle.dumps(np.array([1.5, 2.5])), (2,))
    with pytest.raises(br.BlockRecordsError, match=r"dtype\('f8'\) is not a dtype of block"):
        br.load_npy_strings(wrong)
    with pytest.raises(br.BlockRecordsError, match="not a .npy file"):
        br.load_npy_strings(os.path.join(FIX, "blocks.tfr"))


def _release_rule(title: str, text: str, max_len: int) -> list[int]:
    """ORQA's bert_utils.pad_or_truncate_pair, unpadded: [CLS] a [SEP] b [SEP], a cut to
    max_len - 3, b to what remains."""
    a = tk.wordpieces([title])[0].ids[: max_len - 3]
    b = tk.wordpieces([text])[0].ids[: max_len - 3 - len(a)]
    return [tk.CLS_ID, *a, tk.SEP_ID, *b, tk.SEP_ID]


def test_prepare_from_release_blocks_keeps_record_order(tmp_path):
    for name in ("blocks.tfr", "titles.tfr"):
        shutil.copy(os.path.join(FIX, name), tmp_path / name)
    cfg = load_config(
        os.path.join(REPO, "configs", "realm.py:smoke"),
        [f"data.corpus={tmp_path / 'blocks.tfr'}", "data.masking=random", "data.eval_fraction=0"],
    )
    ddir = str(tmp_path / "prepared")
    summary = P.prepare(cfg, ddir)
    assert summary["counts"]["blocks"] == 20 and summary["counts"]["truncated_blocks"] == 1
    src = datasets.blocks_source(ddir)
    assert len(src) == 20
    for i, rec in enumerate(src.__getitems__(range(20))):
        title, text = WRITTEN["titles"][i], WRITTEN["texts"][i]
        assert rec["block_id"] == i and rec["title"].decode() == title
        want = _release_rule(title, text, cfg.data.block_len)
        assert rec["token_ids"].tolist() == want
        if i != 7:  # block 7 is longer than a block: its text is cut with its wordpieces
            assert rec["text"].decode() == text
    assert len(src[7]["token_ids"]) == cfg.data.block_len
    assert WRITTEN["texts"][7].startswith(src[7]["text"].decode())
    # titles.tfr is part of the input: changing it changes the fingerprint
    tr.write_records(str(tmp_path / "titles.tfr"), ["x"] * 20)
    assert P.fingerprint(cfg.data) != summary["fingerprint"]
    cfg.data.engine = "beam"
    with pytest.raises(datasets.PrepareError, match="in process"):
        P.choose_engine(cfg.data)


def _release_corpus(tmp_path, copies: int = 3) -> str:
    """The fixture's 20 blocks `copies` times (60 blocks, 3 articles' worth of titles a copy),
    so chunks and shards split inside articles and the held-out split has sentences."""
    texts, titles = WRITTEN["texts"] * copies, WRITTEN["titles"] * copies
    tr.write_records(str(tmp_path / "titles.tfr"), titles)
    tr.write_records(str(tmp_path / "blocks.tfr"), texts)
    return str(tmp_path / "blocks.tfr")


def _arrays_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        g = got[k]
        if isinstance(v, str):
            assert g.decode() == v, k
        else:
            assert np.asarray(g).tolist() == np.asarray(v).tolist(), k


def test_streamed_release_prepare_equals_the_in_memory_build(tmp_path):
    """prepare streams release block records in chunks (data/release_prepare.py) into shards
    of its own writer (data/shards.py): the datasets, ids and counts equal the in-memory build
    of the same corpus (release_blocks.release_blocks + local_prepare.build_examples), with
    chunks and shards cut mid-article."""
    corpus = _release_corpus(tmp_path)
    over = [
        f"data.corpus={corpus}",
        "data.masking=random",
        "data.eval_fraction=0.3",
        "data.release_chunk_blocks=7",
        "data.beam_shard_records=11",
    ]
    cfg = load_config(os.path.join(REPO, "configs", "realm.py:smoke"), over)
    ddir = str(tmp_path / "prepared")
    summary = P.prepare(cfg, ddir)
    stats = collections.Counter()
    blocks = release_blocks.release_blocks(cfg.data, stats)
    train, eval_records, mode = local_prepare.build_examples(cfg.data, blocks, stats)
    stats["examples"], stats["eval_examples"] = len(train), len(eval_records)
    assert mode == summary["masking"] == "random"
    assert train and eval_records  # both splits are exercised
    for key in ("documents", "blocks", "sentences", "examples", "eval_examples"):
        assert summary["counts"][key] == stats[key], key
    for key in ("salient_spans", "truncated_blocks", "skipped_short_sentence"):
        assert summary["counts"].get(key, 0) == stats[key], key
    assert summary["counts"]["blocks"] == 60 and summary["counts"]["documents"] > 3
    src = datasets.blocks_source(ddir)
    assert len(src) == 60
    for b, got in zip(blocks, src.__getitems__(range(60)), strict=True):
        _arrays_equal(got, records.block_record(b))
    for split, want in (("train", train), ("eval", eval_records)):
        got = datasets.examples_source(ddir, split)
        assert len(got) == len(want)
        for g, w in zip(got.__getitems__(range(len(want))), want, strict=True):
            _arrays_equal(g, w)
    shards = os.listdir(os.path.join(ddir, "blocks", "realm_blocks", "1.0.0"))
    assert sorted(s for s in shards if "array_record" in s)[-1].endswith("-00005-of-00006")


def test_streamed_release_prepare_stops_cleanly_at_a_corrupt_record(tmp_path):
    """A damaged record far into the file stops prepare with its number, after blocks before it
    were written: nothing is published, and a previous prepare there is kept."""
    corpus = _release_corpus(tmp_path)
    over = [f"data.corpus={corpus}", "data.masking=random", "data.release_chunk_blocks=4"]
    cfg = load_config(os.path.join(REPO, "configs", "realm.py:smoke"), over)
    ddir = str(tmp_path / "prepared")
    first = P.prepare(cfg, ddir)
    data = bytearray(open(corpus, "rb").read())
    at = _offset(20) + _offset(20) + _offset(9)  # record 49
    data[at + 20] ^= 0x01
    open(corpus, "wb").write(bytes(data))
    with pytest.raises(tr.TFRecordError, match=r"blocks.tfr: record 49 .*checksum mismatch"):
        P.prepare(cfg, ddir, overwrite=True)
    assert [n for n in os.listdir(ddir) if n.startswith(".prepare-tmp")] == []
    # the build failed before publishing: the previous datasets and their summary stand
    assert datasets.read_summary(ddir)["fingerprint"] == first["fingerprint"]
    assert len(datasets.blocks_source(ddir)) == 60


def test_release_blocks_with_a_separate_pretraining_text(tmp_path):
    """Release blocks stream; a separate text (data.sentences, the paper's CC-News side) gives
    the examples, all with block id -1, as for any corpus."""
    corpus = _release_corpus(tmp_path, copies=1)
    text = tmp_path / "news.jsonl"
    lines = [
        {"id": f"n{i}", "title": f"News {i}", "text": " ".join(WRITTEN["texts"][i : i + 2])}
        for i in range(0, 20, 2)
    ]
    text.write_text("".join(json.dumps(x) + "\n" for x in lines))
    over = [f"data.corpus={corpus}", f"data.sentences={text}", "data.masking=random"]
    cfg = load_config(os.path.join(REPO, "configs", "realm.py:smoke"), over)
    ddir = str(tmp_path / "prepared")
    summary = P.prepare(cfg, ddir)
    assert summary["counts"]["blocks"] == 20 and summary["counts"]["examples"] > 0
    ex = datasets.examples_source(ddir, "train")
    assert {int(r["block_id"]) for r in ex.__getitems__(range(len(ex)))} == {-1}
    assert {r["doc_id"].decode() for r in ex.__getitems__(range(len(ex)))} <= {
        x["id"] for x in lines
    }
