"""`prepare` on Apache Beam (DirectRunner) gives the in-process path's datasets, record for
record: the same block ids, tokens, spans, splits and summary counts, and the same errors."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("apache_beam")

from realm_jax import cli, fs  # noqa: E402
from realm_jax.data import corpus, prepared  # noqa: E402
from realm_jax.data import prepare as P  # noqa: E402
from tests.test_data import SAMPLE, _config  # noqa: E402

# One in-process worker keeps the test fast; the pipelines are the ones Dataflow would run
# (DoFns pickled into the pipeline and back). Small chunks: several workers' worth of input.
BEAM = "--direct_num_workers=1 --direct_running_mode=in_memory"


def _prepare(cfg, d, engine, **kw):
    cfg.data.engine = engine
    return P.prepare(cfg, d, beam_options=BEAM if engine == "beam" else "", **kw)


def _records(d):
    """Every record of the three datasets, by dataset name (eval_examples may be absent)."""
    out = {"blocks": [prepared.blocks_source(d)[i] for i in range(len(prepared.blocks_source(d)))]}
    for split, name in (("train", "examples"), ("eval", "eval_examples")):
        if fs.isdir(fs.join(d, name)):  # d may be gs:// (tests/test_gcs.py)
            src = prepared.examples_source(d, split)
            out[name] = [src[i] for i in range(len(src))]
    return out


def _assert_same(local_dir, beam_dir):
    a, b = _records(local_dir), _records(beam_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name]) > 0, name
        for i, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            assert x.keys() == y.keys()
            for field in x:  # ids, doc ids, text, token ids, sentence starts, spans, labels
                same = np.array_equal(np.asarray(x[field]), np.asarray(y[field]))
                assert same, f"{name}[{i}].{field}: {x[field]!r} != {y[field]!r}"
    for i, rec in enumerate(b["blocks"]):
        assert rec["block_id"] == i  # record i is block i: what the index and trainer use
    sa, sb = (prepared.load_summary(d) for d in (local_dir, beam_dir))
    assert sa["counts"] == sb["counts"] and sa["fingerprint"] == sb["fingerprint"]
    assert (sa["engine"], sb["engine"]) == ("local", "beam")
    assert sa["masking"] == sb["masking"]


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


def test_engine_choice(tmp_path):
    from realm_jax.data import beam_prepare as B

    argv = ["prepare", "--workdir=w", "--beam_runner=DataflowRunner", "--beam_options=--project=p"]
    args = cli._parser().parse_args(argv)
    assert (args.beam_runner, args.beam_options) == ("DataflowRunner", "--project=p")
    cfg = _config(SAMPLE)
    assert P.choose_engine(cfg.data) == "local"  # 408 lines: under data.beam_min_passages
    cfg.data.beam_min_passages = 400
    assert P.choose_engine(cfg.data) == "beam"
    cfg.data.beam_min_passages = 50_000
    assert P.choose_engine(cfg.data, "DataflowRunner") == "beam"
    cfg.data.corpus = str(tmp_path)  # a folder of .txt files is read in process
    assert P.choose_engine(cfg.data) == "local"
    cfg.data.engine = "local"
    with pytest.raises(prepared.PrepareError, match="needs data.engine=beam"):
        P.choose_engine(cfg.data, "DirectRunner")
    cfg.data.engine = "beam"
    with pytest.raises(prepared.PrepareError, match="a .txt folder is in-process"):
        _prepare(cfg, str(tmp_path / "d"), "beam")
    cfg.data.corpus = SAMPLE
    # Dataflow's workers read the corpus and write the datasets: both must be on gs://.
    where = "data.corpus .* and the data_dir .* must be gs:// paths"
    with pytest.raises(prepared.PrepareError, match=f"DataflowRunner: .*{where}"):
        P.prepare(cfg, str(tmp_path / "e"), beam_runner="DataflowRunner")
    cfg.data.corpus = "gs://bucket/corpus.jsonl"
    assert P.choose_engine(cfg.data) == "beam"  # the in-process reader reads local files
    with pytest.raises(prepared.PrepareError, match="so the data_dir .* must be a gs:// path"):
        B.check_runner(cfg.data, "DataflowRunner", str(tmp_path / "d"))
    B.check_runner(cfg.data, "DataflowRunner", "gs://bucket/data")
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
