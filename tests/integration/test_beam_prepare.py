"""`prepare` on Apache Beam (DirectRunner) gives the in-process path's datasets, record for
record: the same block ids, tokens, spans, splits and summary counts, and the same errors."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("apache_beam")

from realm_jax import cli, fs  # noqa: E402
from realm_jax.data import corpus, datasets  # noqa: E402
from realm_jax.data import prepare as P  # noqa: E402
from tests.support.runs import SAMPLE  # noqa: E402
from tests.support.runs import assert_same_prepared as _assert_same  # noqa: E402
from tests.support.runs import data_config as _config  # noqa: E402
from tests.support.runs import prepared_records as _records

# One in-process worker keeps the test fast; the pipelines are the ones Dataflow would run
# (DoFns pickled into the pipeline and back). Small chunks: several workers' worth of input.
BEAM = "--direct_num_workers=1 --direct_running_mode=in_memory"


def _prepare(cfg, d, engine, **kw):
    cfg.data.engine = engine
    return P.prepare(cfg, d, beam_options=BEAM if engine == "beam" else "", **kw)


def test_beam_matches_in_process_on_the_sample(tmp_path):
    """Salient (spaCy NER) masking over the bundled sample, read in 5 chunks, prepared in 3
    windows of 2 chunks (ids continue across windows; the windows' shards of 100 records,
    some cut short by a window's end, are joined into one dataset in id order)."""
    cfg = _config(SAMPLE, "data.beam_chunk_kb=64")
    local = _prepare(cfg, str(tmp_path / "local"), "local")
    over = ("data.beam_chunk_kb=64", "data.beam_window_kb=128", "data.beam_shard_records=100")
    beam = _prepare(_config(SAMPLE, *over), str(tmp_path / "beam"), "beam")
    assert local["counts"]["examples"] > 500 and local["counts"]["eval_examples"] > 50
    assert beam["counts"]["blocks"] == local["counts"]["blocks"] > 400
    _assert_same(str(tmp_path / "local"), str(tmp_path / "beam"))
    info = tmp_path / "beam" / "blocks" / "realm_blocks" / "1.0.0" / "dataset_info.json"
    lengths = [int(n) for n in json.loads(info.read_text())["splits"][0]["shardLengths"]]
    assert sum(lengths) == beam["counts"]["blocks"] and len(lengths) > 7
    assert max(lengths) == 100 and min(lengths) < 100  # a window's last shard is short


def _dirty_corpus(tmp_path) -> str:
    """60 sample documents with bad lines spread over several 4 KB chunks: malformed JSON, an
    empty text, a duplicate id (in another chunk than the first), a blank line, missing ids."""
    with open(SAMPLE) as f:
        docs = [json.loads(line) for _, line in zip(range(60), f, strict=False)]
    lines = [json.dumps(d) for d in docs]
    lines.insert(7, '{"title": "Broken", "text": ')
    lines.insert(12, json.dumps({"id": "x1", "title": "Empty", "text": "   "}))
    lines.insert(40, json.dumps({**docs[3], "text": docs[5]["text"]}))  # docs[3]'s id again
    lines.insert(20, "")
    for i in (25, 33):
        lines[i] = json.dumps({"title": f"No id {i}", "text": docs[i]["text"]})
    path = tmp_path / "dirty.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_beam_bad_input_errors_and_skips_like_in_process(tmp_path):
    """The same first error (file:line) without skip_bad_input; with it, the same skips and
    records. Random masking: its spans are seeded by the global sentence index."""
    src = _dirty_corpus(tmp_path)
    errors = []
    for engine in ("local", "beam"):
        with pytest.raises(corpus.CorpusError) as e:
            _prepare(_config(src, "data.beam_chunk_kb=4"), str(tmp_path / f"e-{engine}"), engine)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and ":8: malformed JSON" in errors[0]
    assert not os.path.exists(tmp_path / "e-beam" / "blocks")  # stopped before any output
    over = ("data.beam_chunk_kb=4", "data.skip_bad_input=true", "data.masking=random")
    # Windows of 3 chunks: the duplicate id is in a later window than its first use.
    over += ("data.beam_window_kb=12",)
    for engine in ("local", "beam"):
        s = _prepare(_config(src, *over), str(tmp_path / engine), engine)
        c = s["counts"]
        assert (c["skipped_bad_json"], c["skipped_empty_text"], c["skipped_duplicate_id"]) == (
            1,
            1,
            1,
        )
        assert c["documents"] == 60 and s["masking"] == "random"
    _assert_same(str(tmp_path / "local"), str(tmp_path / "beam"))


def test_windows():
    """Whole chunks per window on a local runner; one window elsewhere or with window_kb 0."""
    from realm_jax.data import beam_prepare as B

    assert B.windows(5, 64, 128, "FnApiRunner") == [[0, 1], [2, 3], [4]]
    assert B.windows(5, 64, 100, "FnApiRunner") == [[0], [1], [2], [3], [4]]
    assert B.windows(5, 64, 0, "FnApiRunner") == [[0, 1, 2, 3, 4]]
    assert B.windows(5, 64, 128, "DataflowRunner") == [[0, 1, 2, 3, 4]]


def test_engine_choice(tmp_path, monkeypatch):
    from realm_jax.data import beam_prepare as B

    argv = ["prepare", "--workdir=w", "--beam_runner=DataflowRunner", "--beam_options=--project=p"]
    args = cli._parser().parse_args(argv)
    assert (args.beam_runner, args.beam_options) == ("DataflowRunner", "--project=p")
    cfg = _config(SAMPLE)
    assert P.choose_engine(cfg.data) == "local"  # 408 lines: under data.beam_min_passages
    cfg.data.beam_min_passages = 400
    assert P.choose_engine(cfg.data) == "beam"
    cfg.data.sentences = SAMPLE  # a separate text: its lines count too, and Beam takes it
    cfg.data.beam_min_passages = 800
    assert P.choose_engine(cfg.data) == "beam"
    cfg.data.sentences = ""
    assert P.choose_engine(cfg.data) == "local"
    cfg.data.beam_min_passages = 50_000
    assert P.choose_engine(cfg.data, "DataflowRunner") == "beam"
    cfg.data.corpus = str(tmp_path)  # a folder of .txt files is read in process
    assert P.choose_engine(cfg.data) == "local"
    cfg.data.engine = "local"
    with pytest.raises(datasets.PrepareError, match="needs data.engine=beam"):
        P.choose_engine(cfg.data, "DirectRunner")
    cfg.data.engine = "beam"
    with pytest.raises(datasets.PrepareError, match="a .txt folder is in-process"):
        _prepare(cfg, str(tmp_path / "d"), "beam")
    cfg.data.corpus = SAMPLE
    # Dataflow's workers read the corpus and write the datasets: both must be on gs://.
    where = "data.corpus .* and the data_dir .* must be gs:// paths"
    with pytest.raises(datasets.PrepareError, match=f"DataflowRunner: .*{where}"):
        P.prepare(cfg, str(tmp_path / "e"), beam_runner="DataflowRunner")
    cfg.data.corpus = "gs://bucket/corpus.jsonl"
    assert P.choose_engine(cfg.data) == "beam"  # the in-process reader reads local files
    with pytest.raises(datasets.PrepareError, match="so the data_dir .* must be a gs:// path"):
        B.check_runner(cfg.data, "DataflowRunner", str(tmp_path / "d"))
    B.check_runner(cfg.data, "DataflowRunner", "gs://bucket/data")
    cfg.data.sentences = SAMPLE  # Dataflow's workers read the separate text too
    with pytest.raises(datasets.PrepareError, match=r"data.sentences \(.*\) must be a gs://"):
        B.check_runner(cfg.data, "DataflowRunner", "gs://bucket/data")
    cfg.data.sentences = "gs://bucket/text.txt.gz"
    B.check_runner(cfg.data, "DataflowRunner", "gs://bucket/data")
    # No GCS here (a read of gs://bucket would wait on the network): what a gs:// input holds
    # is read against the local GCS in test_gz_inputs_on_gcs.
    with monkeypatch.context() as m:
        m.setattr(B.realm_records, "is_release_text", lambda path: False)
        m.setattr(B.corpus_lib, "is_plain_text", lambda path: False)
        assert not B.supported(cfg.data)
    cfg.data.sentences = str(tmp_path)  # a folder of .txt: in process
    assert "data.sentences=" in B.supported(cfg.data)
    cfg.data.sentences = ""
    B.check_runner(_config(SAMPLE).data, "FnApiRunner", str(tmp_path / "d"))  # local: anything
    assert not os.path.exists(tmp_path / "e")  # refused before anything was made


def test_duplicate_check_compares_ids_where_hashes_collide(tmp_path, monkeypatch):
    """The scan finds duplicate ids by an 8-byte hash; with every hash made equal (all
    documents collide) the ids read back decide, and the duplicates found are the same."""
    from realm_jax.data import beam_prepare as B

    opts = B._Opts(corpus=_dirty_corpus(tmp_path), beam_chunk_kb=4)
    pipe = B.beam.options.pipeline_options.PipelineOptions(BEAM.split())
    found = B.scan(opts, "FnApiRunner", pipe, str(tmp_path / "a.json"))
    monkeypatch.setattr(B, "_id_hash", lambda doc_id: 7)
    collided = B.scan(opts, "FnApiRunner", pipe, str(tmp_path / "b.json"))
    assert found["dups"] == collided["dups"] and len(found["dups"]) == 1
    ((chunk, _), doc_id) = found["dups"][0]
    with open(SAMPLE) as f:
        docs = [json.loads(line) for _, line in zip(range(4), f, strict=False)]
    assert chunk > 0 and doc_id == docs[3]["id"]  # _dirty_corpus repeats docs[3]'s id later


# ------------------------------------------------------- a separate pre-training text, .gz
# The paper's setup: examples from a separate text (CC-News), blocks from the knowledge corpus
# (Wikipedia). Here: 80 sample passages as the corpus, 100 others as the text.
TEXT_BEAM = ("data.beam_chunk_kb=8", "data.beam_window_kb=16", "data.beam_shard_records=100")


def _sample_docs():
    with open(SAMPLE) as f:
        return [json.loads(line) for line in f]


def _corpus_and_text(folder, text_lines=None) -> tuple[str, str]:
    """corpus.jsonl (80 sample passages) and text.jsonl (100 others, without ids: "text:<line>"
    ids), or the text lines given."""
    os.makedirs(folder, exist_ok=True)
    docs = _sample_docs()
    corpus_path, text_path = (
        os.path.join(folder, "corpus.jsonl"),
        os.path.join(folder, "text.jsonl"),
    )
    with open(corpus_path, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs[:80])
    if text_lines is None:
        text_lines = [json.dumps({"title": d["title"], "text": d["text"]}) for d in docs[200:300]]
    with open(text_path, "w") as f:
        f.writelines(line + "\n" for line in text_lines)
    return corpus_path, text_path


@pytest.mark.system  # CI: Beam = in process on the sample (above); a separate text prepared in
# process (unit/test_realm_records.py, unit/test_data.py)
def test_beam_with_a_separate_text_matches_in_process(tmp_path):
    """data.sentences on Beam: blocks from the corpus (4 windows), examples from the text (5
    windows of 8 KB chunks), salient masking (spaCy NER); the text carries a malformed line and
    a duplicate id in a later window, skipped and counted as sentences_skipped_*. Record for
    record the in-process datasets, summary counts and fingerprint; without skip_bad_input
    both engines stop with the same error naming the text's file and line."""
    docs = _sample_docs()
    text = [json.dumps({"title": d["title"], "text": d["text"]}) for d in docs[200:300]]
    text.insert(10, '{"title": "Broken", ')
    text[70] = json.dumps({"id": "text:5", "title": "Dup", "text": docs[5]["text"]})
    corpus_path, text_path = _corpus_and_text(tmp_path, text)
    errors = []
    for engine in ("local", "beam"):
        cfg = _config(corpus_path, f"data.sentences={text_path}", *TEXT_BEAM)
        with pytest.raises(corpus.CorpusError) as e:
            _prepare(cfg, str(tmp_path / f"e-{engine}"), engine)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and f"{text_path}:11: malformed JSON" in errors[0]
    over = (f"data.sentences={text_path}", "data.skip_bad_input=true", *TEXT_BEAM)
    for engine in ("local", "beam"):
        s = _prepare(_config(corpus_path, *over), str(tmp_path / engine), engine)
        c = s["counts"]
        assert (c["sentences_skipped_bad_json"], c["sentences_skipped_duplicate_id"]) == (1, 1)
        assert (c["documents"], c["sentences_documents"]) == (80, 99)
    assert s["masking"] == "salient" and s["sentences_source"] == text_path
    _assert_same(str(tmp_path / "local"), str(tmp_path / "beam"))
    got = _records(str(tmp_path / "beam"))
    examples = got["examples"] + got["eval_examples"]
    assert {int(r["block_id"]) for r in examples} == {-1}  # from the text, not from blocks
    assert {_text(r["doc_id"]).split(":")[0] for r in examples} == {"text"}  # its default ids


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _gz_copy(path: str, dest: str, members: int = 2) -> str:
    """`path` gzip-compressed into `dest` (concatenated gzip members)."""
    import gzip

    with open(path, "rb") as f:
        data = f.read()
    cut = [len(data) * i // members for i in range(members + 1)]
    with open(dest, "wb") as g:
        for a, b in zip(cut, cut[1:], strict=False):
            g.write(gzip.compress(data[a:b]))
    return dest


def _assert_same_records(want_dir, got_dir):
    """The datasets and counts of two prepares of different files (fingerprints differ)."""
    a, b = _records(want_dir), _records(got_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name]) > 0, name
        for i, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            for field in x:
                same = np.array_equal(np.asarray(x[field]), np.asarray(y[field]))
                assert same, f"{name}[{i}].{field}: {x[field]!r} != {y[field]!r}"
    counts = [datasets.load_summary(d)["counts"] for d in (want_dir, got_dir)]
    assert counts[0] == counts[1]


def test_gz_inputs_equal_their_uncompressed_twins(tmp_path):
    """A .jsonl.gz corpus and a .txt.gz text (title<TAB>text lines, default ids) give, in
    process and on Beam (staged, then chunked), the records of their uncompressed twins."""
    corpus_path, _ = _corpus_and_text(tmp_path)
    txt = str(tmp_path / "text.txt")
    with open(txt, "w") as f:
        for d in _sample_docs()[200:260]:
            f.write(f"{d['title']}\t{d['text']}\n")
    gz_corpus = _gz_copy(corpus_path, corpus_path + ".gz")
    gz_text = _gz_copy(txt, txt + ".gz", members=3)
    plain = ("data.masking=random", f"data.sentences={txt}", *TEXT_BEAM)
    _prepare(_config(corpus_path, *plain), str(tmp_path / "plain"), "local")
    gz = ("data.masking=random", f"data.sentences={gz_text}", *TEXT_BEAM)
    for engine in ("local", "beam"):
        s = _prepare(_config(gz_corpus, *gz), str(tmp_path / engine), engine)
        assert s["engine"] == engine
        _assert_same_records(str(tmp_path / "plain"), str(tmp_path / engine))
    got = _records(str(tmp_path / "beam"))
    ids = {_text(r["doc_id"]) for r in got["examples"] + got.get("eval_examples", [])}
    assert "text:1" in ids and len(ids) > 50  # default ids: the stem without .txt.gz


def test_gz_errors_name_the_file_and_line_in_both_engines(tmp_path):
    """A bad JSON line inside a corpus .gz, and a truncated text .gz: the same one-line error
    (file, line) from both engines, before any output; with skip_bad_input the lines before
    the cut are kept and the rest counted once (sentences_skipped_unreadable), alike."""
    import gzip

    docs = _sample_docs()
    lines = [json.dumps(d) for d in docs[:30]]
    lines.insert(6, '{"title": "Broken", "text": ')
    bad = str(tmp_path / "bad.jsonl.gz")
    with open(bad, "wb") as f:
        f.write(gzip.compress(("\n".join(lines) + "\n").encode()))
    corpus_path, text_path = _corpus_and_text(tmp_path / "in")
    with open(text_path, "rb") as f:
        whole = gzip.compress(f.read())
    cut = str(tmp_path / "cut.jsonl.gz")
    with open(cut, "wb") as f:
        f.write(whole[: len(whole) * 2 // 3])
    cases = [(bad, ()), (corpus_path, (f"data.sentences={cut}",))]
    for src, over in cases:
        errors = []
        for engine in ("local", "beam"):
            with pytest.raises(corpus.CorpusError) as e:
                _prepare(_config(src, *over, *TEXT_BEAM), str(tmp_path / f"e-{engine}"), engine)
            errors.append(str(e.value))
            assert not os.path.exists(tmp_path / f"e-{engine}" / "blocks")
        assert errors[0] == errors[1] and "\n" not in errors[0]
    assert errors[0].startswith(f"{cut}:") and "truncated or corrupt gzip data" in errors[0]
    n = int(errors[0].split(":")[1])
    assert 20 < n < 100  # the line the data stops in: about 2/3 through the 100 lines
    over = ("data.masking=random", f"data.sentences={cut}", "data.skip_bad_input=true")
    for engine in ("local", "beam"):
        s = _prepare(_config(corpus_path, *over, *TEXT_BEAM), str(tmp_path / engine), engine)
        c = s["counts"]
        assert (c["sentences_skipped_unreadable"], c["sentences_documents"]) == (1, n - 1)
    _assert_same(str(tmp_path / "local"), str(tmp_path / "beam"))


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A local GCS (tests/support/fake_gcs.py) for the gs:// input test; skipped without it."""
    from tests.support import fake_gcs

    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # as tests/test_gcs.py
    with fake_gcs.module_server(tmp_path_factory, "realm-gz") as server:
        yield server


@pytest.mark.system  # a fake GCS server and a Beam pipeline; CI: gz locally, prepare on gs://
def test_gz_inputs_on_gcs(gcs, tmp_path):
    """gs:// .gz inputs (corpus and text): streamed through gzip from realm_jax.fs in process,
    and staged by Beam's own gs:// file system (a worker's read on Dataflow); the records
    equal those of the local uncompressed files."""
    corpus_path, text_path = _corpus_and_text(tmp_path)
    remote = {}
    for path in (corpus_path, text_path):
        name = os.path.basename(path) + ".gz"
        local_gz = _gz_copy(path, str(tmp_path / name))
        remote[path] = f"gs://realm-gz/inputs/{name}"
        with open(local_gz, "rb") as f:
            fs.write_bytes(remote[path], f.read())
    over = ("data.masking=random", *TEXT_BEAM)
    want = str(tmp_path / "plain")
    _prepare(_config(corpus_path, f"data.sentences={text_path}", *over), want, "local")
    cfg = _config(remote[corpus_path], f"data.sentences={remote[text_path]}", *over)
    assert P.choose_engine(cfg.data) == "beam"  # gs:// inputs: Beam unless told otherwise
    for engine in ("local", "beam"):
        got = str(tmp_path / engine)
        s = _prepare(
            _config(remote[corpus_path], f"data.sentences={remote[text_path]}", *over), got, engine
        )
        assert s["corpus"] == remote[corpus_path]
        _assert_same_records(want, got)
