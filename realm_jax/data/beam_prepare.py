"""`prepare` on Apache Beam: the same datasets as the in-process path (data/local_prepare.py),
in TFDS's array_record format, built by Beam pipelines on a local runner or on Dataflow.

Nothing holds the corpus: the input file is cut into byte ranges ("chunks", data.beam_chunk_kb);
a worker reads the lines starting in its range, so every stage streams. A gzip input
(.jsonl.gz, .tsv.gz, .txt.gz) has no byte ranges to seek to: a `stage` pipeline first
decompresses it, streaming, on one worker, into the scratch folder beside the build (local, or
gs:// on Dataflow), and the chunks are cut from that copy; messages and default ids still name
the .gz file and its lines, and a truncated or corrupt .gz stops at the line where its data
stops, as in process. The pipelines:

  scan           every line parsed and checked once: lines per chunk (for file:line numbers and
                 "<stem>:<line>" ids), bad lines, duplicate ids (an 8-byte hash of each id;
                 the ids themselves are compared only where hashes collide).
                 Bad input stops here with the in-process path's message, before any NER.
  blocks         chunk -> documents -> blocks (tokenise, split) -> dense ids -> shards;
                 and the sentence table: every block's sentences, numbered, as JSON lines
  eval_examples, sentence table -> one split's share -> tokenise, spaCy NER (one model per
  examples       worker, loaded in DoFn.setup) -> dense example ids -> shards

With a separate pre-training text (data.sentences: the paper's CC-News sentences beside a
Wikipedia knowledge corpus) the text is scanned like the corpus (its own bad lines and duplicate
ids, counted as sentences_*), the blocks pipelines write no sentence table, and after the
corpus's windows the text's windows run a `text` pipeline (chunk -> documents -> sentences ->
the sentence table, block id -1) and the two example pipelines over it: the records are the
in-process path's, whose examples also come from the text alone once the blocks are built.

Deterministic ids without a global counter: records travel in batches keyed by their place in
the corpus, (chunk, batch within chunk), each made by one worker in input order. Counting the
records of every batch and summing the counts of the batches before it (a small side input, one
int per batch) gives each batch its first id: block_id, the sentence index (the random-masking
seed) and example_id come out exactly as the in-process path numbers them.

Output: each shard file holds a fixed range of ids (data.beam_shard_records), written in id
order by one worker on its local disk (array_record's writer writes local files only) and
copied into the build folder, local or gs://; the driver then gives the shards TFDS's names
and writes dataset_info (finalize), so record i is block (or example) i, which the readers,
the index and the trainer rely on. TFDS's own Beam writer is not used, on purpose: it writes
its shards with array_record's local writer straight into the build folder (no gs://, so no
Dataflow), after a shuffle of every serialized record to order them by key.

Memory: a worker holds one chunk of text and its blocks, one batch of sentences, or one shard,
at a time; what crosses a shuffle or waits for a side input (the batches before their ids are
known, the records grouped by shard) is held by the runner: disk-backed on Dataflow, but in
memory on Beam's local runners, whose FnApiRunner also hands each worker a stage's whole input
as one bundle. So on a local runner the blocks and examples pipelines run once per *window* of
the corpus (data.beam_window_kb, whole chunks), one after another, each window's ids starting
where the previous window's ended and its shards numbered after the previous window's. Peak
memory is then bounded by the window, not the corpus (benchmarks/prepare_beam.py measures 10k to
200k passages, benchmarks/prepare_scale.py a 1M-passage corpus with a 1M-sentence text); on Dataflow
the whole corpus is one window. The separate text is windowed the same way. Nothing else holds
a list of documents, titles or ids, and no side input grows with the corpus (the id offsets are
one int per batch of a window). Only the scans cover a whole input in one pipeline: for the
duplicate check each keeps an 8-byte hash of each document's id, its 4-byte line and a 1-byte
"id defaulted" flag (13 bytes per document, base64 in the runner's list and the driver's JSON,
a few tens at the peak of the check: ~40 MB at 1M documents, ~0.5 GB at Wikipedia's 13M), not
the text; that and the per-chunk line counts are the only state that grows with the input.
On the local runner the scans are also not windowed: a split of the duplicate check by hash
range would bound them too, if inputs far beyond 13M documents ever need it.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
import time
from typing import NamedTuple

import apache_beam as beam
import numpy as np
import tensorflow_datasets as tfds
from apache_beam.io.filesystems import CompressionTypes, FileSystems

from realm_jax import fs
from realm_jax import tokenization as tk
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import masking, records, shards
from realm_jax.data.datasets import PrepareError, is_eval
from realm_jax.interop import realm_records

SENTENCES = "_block_sentences"  # stats key: a window's sentences (blocks' or text's; not reported)
BATCH = 256  # blocks per batch; a batch's sentences go through one NER nlp.pipe call
TEXT_BATCH = 2048  # separate-text sentences per batch (about a block batch's sentences)
# The fields the workers need (a plain dict travels to workers; a locked ConfigDict need not).
OPT_FIELDS = (*records.FP_FIELDS, "corpus", "sentences", "beam_chunk_kb", "beam_shard_records")
# Runners that keep a pipeline's data in this process's memory: they prepare window by window.
LOCAL_RUNNERS = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "PrismRunner")


class _Opts(dict):
    """The data config as a picklable dict that also reads as attributes (data.block_len)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Source(NamedTuple):
    """One input: `name` as configured (messages, default ids, format), `path` the bytes read:
    the same file, or for a .gz its decompressed copy made by the stage pipeline."""

    name: str
    path: str


def supported(data) -> str:
    """'' when the Beam path can prepare this input, else why not (it reads line files: the
    knowledge corpus and the separate text, each .jsonl/.json/.tsv/.txt or its .gz)."""
    for field in ("corpus", "sentences"):
        path = data[field]
        if field == "sentences" and not path:
            continue
        if field == "sentences" and realm_records.is_release_text(path):
            return f"data.sentences={path}: REALM's pre-training TFRecord shards are in-process"
        if os.path.isdir(path) or not corpus_lib.format_name(path).endswith(
            corpus_lib.LINE_FORMATS
        ):
            return (
                f"data.{field}={path}: the Beam path reads .jsonl/.tsv files and their .gz "
                "(a .txt folder is in-process)"
            )
        if corpus_lib.is_plain_text(path):  # documents span lines: no line-sized chunks
            return (
                f"data.{field}={path}: a plain-text .txt (one sentence a line, documents split "
                "by blank lines) is prepared in process"
            )
    return ""


# ------------------------------------------------------------------------------- reading lines
def _size(path: str) -> int:
    return FileSystems.match([path])[0].metadata_list[0].size_in_bytes


def chunk_lines(path: str, k: int, chunk_bytes: int):
    """The raw lines (bytes, newline kept) that start in bytes [k * chunk_bytes, (k+1) * ...):
    every line belongs to exactly one chunk, so chunks read in parallel cover the file once."""
    start, end = k * chunk_bytes, (k + 1) * chunk_bytes
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # a line begun before the chunk: the previous chunk's
        while f.tell() < end:
            line = f.readline()
            if not line:
                return
            yield line


def parse_line(path: str, n, raw: bytes, r: corpus_lib.DocumentChecker, first: bool):
    """One corpus line -> (doc_id, title, text), or None (blank, a TSV header, or bad input,
    which r raises or counts exactly as corpus.read_documents does). path: the input as named
    (a .gz too: its messages and default ids); n is the line number (or a unique placeholder
    during the scan); first: the file's first line (a TSV header?). r's duplicate check is
    not used: the scan finds duplicates across the whole file."""
    where = f"{path}:{n}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return r.bad("bad_utf8", where, f"invalid UTF-8 ({e.reason} at byte {e.start})")
    if not line.strip():
        return None
    line = line.rstrip("\r\n")
    stem = corpus_lib.stem(path)
    if corpus_lib.format_name(path).endswith((".jsonl", ".json")):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return r.bad("bad_json", where, f"malformed JSON ({e.msg})")
        if not isinstance(obj, dict):
            return r.bad("bad_json", where, "a line must be a JSON object")
        doc_id = str(obj["id"]) if obj.get("id") not in (None, "") else f"{stem}:{n}"
        return r.check(where, doc_id, obj.get("title"), obj.get("text"))
    cols = line.split("\t")  # the TSV reader's csv.QUOTE_NONE split is a plain tab split
    if first and [c.lower() for c in cols] in (["id", "title", "text"], ["title", "text"]):
        return None
    if len(cols) == 3:
        doc_id, title, text = cols
    elif len(cols) == 2:
        (title, text), doc_id = cols, f"{stem}:{n}"
    else:
        return r.bad(
            "missing_field", where, f"expected 2 or 3 tab-separated columns, got {len(cols)}"
        )
    return r.check(where, doc_id or f"{stem}:{n}", title, text)


def _id_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little")


def _lenient_reader() -> corpus_lib.DocumentChecker:
    """A reader that counts bad lines instead of raising, and leaves duplicates to the scan."""
    r = corpus_lib.DocumentChecker(True, collections.Counter())
    r.seen = _NeverSeen()
    return r


def _scan_chunk(k: int, src: Source, chunk_bytes: int):
    """Per chunk: (k, lines, bad lines, counts, id hashes, their lines, defaulted?). Line
    numbers are chunk-local here (the chunks before are not counted yet), so a defaulted id
    ("<stem>:<line>") is not known yet: it is flagged, and `duplicates` hashes it once the
    lines before the chunk are counted (it may equal another document's explicit id). The
    duplicate check keeps 8 bytes of hash, 4 of line and 1 of flag per document, not the ids:
    `duplicates` compares the ids themselves only where hashes collide."""
    lines, bad, stats, hashes, where, dflt = 0, [], collections.Counter(), [], [], []
    path, stem = src.name, corpus_lib.stem(src.name)
    for i, raw in enumerate(chunk_lines(src.path, k, chunk_bytes)):
        lines += 1
        r = _lenient_reader()
        n, first = f"@{k}:{i}", k == 0 and i == 0  # a placeholder line number
        doc = parse_line(path, n, raw, r, first)
        skipped = [key for key in r.stats if key.startswith("skipped_")]
        if skipped:  # bad: keep the kind, and the message the raising reader gives
            bad.append((i, skipped[0].removeprefix("skipped_"), _message(path, n, raw, first)))
        elif doc is not None:
            stats["valid"] += 1
            defaulted = doc[0] == f"{stem}:{n}"
            hashes.append(0 if defaulted else _id_hash(doc[0]))
            where.append(i)
            dflt.append(defaulted)
    h, w = np.array(hashes, "<u8").tobytes(), np.array(where, "<i4").tobytes()
    d = np.array(dflt, np.uint8).tobytes()
    yield (k, lines, bad, dict(stats), *(base64.b64encode(x).decode() for x in (h, w, d)))


def _ids_at(src: Source, chunk_bytes: int, k: int, first_line: int, wanted: set) -> dict:
    """{line in chunk k: document id} for the wanted chunk-local lines (a second read of the
    chunk, only where id hashes collide); first_line: the lines before chunk k."""
    out = {}
    for i, raw in enumerate(chunk_lines(src.path, k, chunk_bytes)):
        if i in wanted:
            r, first = _lenient_reader(), first_line + i == 0
            out[i] = parse_line(src.name, first_line + i + 1, raw, r, first)[0]
    return out


def duplicates(src: Source, chunk_bytes: int, chunks: list, first_line: list) -> list:
    """[((chunk, line), doc_id)] of every document whose id an earlier one has, from the
    scan's per-chunk hashes (chunks sorted by chunk; first_line[k]: the lines before chunk k):
    equal hashes are candidates, their ids are read back and compared, so a hash collision is
    never taken for a duplicate."""
    hs = [np.frombuffer(base64.b64decode(c[4]), "<u8").copy() for c in chunks]
    if not hs or not sum(map(len, hs)):
        return []
    stem = corpus_lib.stem(src.name)
    for x, c in zip(hs, chunks, strict=True):  # defaulted ids: "<stem>:<line>", hashed here
        lines = np.frombuffer(base64.b64decode(c[5]), "<i4")
        for j in np.flatnonzero(np.frombuffer(base64.b64decode(c[6]), np.uint8)):
            x[j] = _id_hash(f"{stem}:{first_line[c[0]] + int(lines[j]) + 1}")
    h = np.concatenate(hs)
    k = np.concatenate([np.full(len(x), c[0], np.int32) for x, c in zip(hs, chunks, strict=True)])
    i = np.concatenate([np.frombuffer(base64.b64decode(c[5]), "<i4") for c in chunks])
    _, inverse, counts = np.unique(h, return_inverse=True, return_counts=True)
    cand = np.flatnonzero(counts[inverse] > 1)
    if not len(cand):
        return []
    wanted = collections.defaultdict(set)
    for j in cand:
        wanted[int(k[j])].add(int(i[j]))
    ids = {
        (c, line): d
        for c in wanted
        for line, d in _ids_at(src, chunk_bytes, c, first_line[c], wanted[c]).items()
    }
    first_seen, dups = {}, []
    for pos in sorted(ids):  # corpus order: the first of each id is kept
        if ids[pos] in first_seen:
            dups.append((pos, ids[pos]))
        else:
            first_seen[ids[pos]] = pos
    return dups


class _NeverSeen(set):
    """A `seen` set that never matches: duplicates are the scan's GroupByKey's job."""

    def __contains__(self, item):
        return False


def _message(path: str, n, raw: bytes, first: bool) -> str:
    """The bad-input message of a line without "file:line: " and the skip hint (the driver
    adds both back)."""
    r = corpus_lib.DocumentChecker(False, collections.Counter())
    r.seen = _NeverSeen()
    try:
        parse_line(path, n, raw, r, first)
    except corpus_lib.CorpusError as e:
        return str(e).removeprefix(f"{path}:{n}: ").removesuffix(f" ({corpus_lib.SKIP_HINT})")
    return "bad input"


def _write_json(obj, path: str) -> None:
    with FileSystems.create(path) as f:
        f.write(json.dumps(obj).encode())


def _read_json(path: str):
    with FileSystems.open(path) as f:
        return json.loads(f.read().decode())


def scan(opts: _Opts, runner, options, out: str, src: Source | None = None) -> dict:
    """Run the scan pipeline over src (default: data.corpus); returns {"lines": [per chunk],
    "bad": [...], "dups": [...], "valid": n} with (chunk, local line) positions."""
    src = src or Source(opts.corpus, opts.corpus)
    chunk_bytes = opts.beam_chunk_kb * 1024
    num_chunks = max(1, -(-_size(src.path) // chunk_bytes))
    with beam.Pipeline(runner=runner, options=options) as p:
        _ = (
            p
            | "Chunks" >> beam.Create(range(num_chunks))
            | "Reshuffle" >> beam.Reshuffle()
            | "Scan" >> beam.FlatMap(_scan_chunk, src, chunk_bytes)
            | "AllChunks" >> beam.combiners.ToList()
            | "Write" >> beam.Map(lambda chunks: _write_json(sorted(chunks), out))
        )
    chunks = _read_json(out)
    lines = [0] * num_chunks
    bad, valid = [], 0
    for k, n, b, stats, *_ in chunks:
        lines[k] = n
        bad += [((k, i), kind, msg) for i, kind, msg in b]
        valid += stats.get("valid", 0)
    first_line = np.concatenate([[0], np.cumsum(lines)]).astype(int).tolist()
    dups = duplicates(src, chunk_bytes, chunks, first_line)
    return {"lines": lines, "bad": sorted(bad), "dups": dups, "valid": valid}


def check_scan(
    opts: _Opts,
    res: dict,
    stats: collections.Counter,
    src: Source | None = None,
    prefix: str = "",
) -> dict:
    """Raise the in-process path's CorpusError for the first bad line (skip_bad_input=False),
    or count the skips (under `prefix`: "sentences_" for the separate text, as in process);
    res["tail"], a .gz's data stopping after its last whole line, comes after every line.
    Returns the builders' plan: {"src", "first_line": lines before each chunk, "skip"}."""
    src = src or Source(opts.corpus, opts.corpus)
    first = np.concatenate([[0], np.cumsum(res["lines"])]).tolist()  # lines before chunk k
    problems = sorted(
        [(pos, kind, msg) for pos, kind, msg in res["bad"]]
        + [(pos, "duplicate_id", f"duplicate document id {d!r}") for pos, d in res["dups"]]
    )
    if res.get("tail"):  # at line (all lines + 1): after every other problem
        problems.append(((len(res["lines"]), 0), "unreadable", res["tail"]))
    if problems and not opts.skip_bad_input:
        (k, i), _, msg = problems[0]
        raise corpus_lib.CorpusError(
            f"{src.name}:{first[k] + i + 1}: {msg} ({corpus_lib.SKIP_HINT})"
        )
    for _, kind, _ in problems:
        stats[f"{prefix}skipped_{kind}"] += 1
    stats[f"{prefix}documents"] += res["valid"] - len(res["dups"])
    return {"src": src, "first_line": first, "skip": sorted(pos for pos, _ in res["dups"])}


def _stage(item) -> None:
    """(a .gz input, its copy) -> the decompressed copy, streamed, and <copy>.json: {"lines":
    whole lines copied, "tail": why the data stopped before its end, or None}."""
    name, dest = item
    n, tail, buf = 0, None, bytearray()
    with (
        FileSystems.open(name, compression_type=CompressionTypes.UNCOMPRESSED) as f,
        FileSystems.create(dest, compression_type=CompressionTypes.UNCOMPRESSED) as out,
    ):
        try:
            for raw in corpus_lib.raw_lines(f, name):
                n += 1
                buf += raw
                if len(buf) >= 1 << 22:
                    out.write(bytes(buf))
                    buf.clear()
        except corpus_lib.UnreadableData as e:
            tail = str(e)
        out.write(bytes(buf))
    _write_json({"lines": n, "tail": tail}, dest + ".json")


def stage(names: list[str], runner, options, work: str) -> dict:
    """The stage pipeline: each .gz input decompressed into work/ by one worker; returns
    {name: (Source(name, copy), tail)} (a copy's line numbers are the .gz's)."""
    items = [
        (name, fs.join(work, "staged", f"{i}-{corpus_lib.format_name(fs.basename(name))}"))
        for i, name in enumerate(names)
    ]
    with beam.Pipeline(runner=runner, options=options) as p:
        _ = (
            p
            | "Inputs" >> beam.Create(items)
            | "Spread" >> beam.Reshuffle()
            | "Stage" >> beam.Map(_stage)
        )
    return {name: (Source(name, dest), _read_json(dest + ".json")["tail"]) for name, dest in items}


# ------------------------------------------------------------------------------------ blocking
def _chunk_docs(k: int, opts: _Opts, plan: dict) -> list:
    """Chunk k's valid documents (doc_id, title, text) of plan["src"], in order, without the
    duplicates the scan found."""
    src, skip, first = plan["src"], set(map(tuple, plan["skip"])), plan["first_line"][k]
    r, docs = _lenient_reader(), []
    for i, raw in enumerate(chunk_lines(src.path, k, opts.beam_chunk_kb * 1024)):
        doc = parse_line(src.name, first + i + 1, raw, r, first + i == 0)
        if doc is not None and (k, i) not in skip:
            docs.append(doc)
    return docs


def _chunk_blocks(k: int, opts: _Opts, plan: dict):
    """One chunk's documents -> ((k, j), [Block]) batches in corpus order (local block ids),
    plus ("stats", Counter) of blocks and empty documents."""
    docs = _chunk_docs(k, opts, plan)
    stats, batch, j = collections.Counter(), [], 0
    for chunk in records.chunks(docs, records.CHUNK):
        titles = tk.wordpieces([t for _, t, _ in chunk])
        bodies = tk.wordpieces([b for _, _, b in chunk])
        sents = masking.split_sentences(b for _, _, b in chunk)
        for (doc_id, title, body), t, b, s in zip(chunk, titles, bodies, sents, strict=True):
            new = corpus_lib.split_blocks(doc_id, title, body, t.ids, b, s, opts.block_len, 0)
            if not new:
                stats["skipped_empty_text"] += 1
            stats["blocks"] += len(new)
            stats[SENTENCES] += sum(len(b.sentences) for b in new)
            batch.extend(new)
            while len(batch) >= BATCH:
                yield ((k, j), batch[:BATCH])
                batch, j = batch[BATCH:], j + 1
    if batch:
        yield ((k, j), batch)
    yield beam.pvalue.TaggedOutput("stats", stats)


def _offsets(counts: list, base: int = 0) -> dict:
    """{batch key: base + records in the batches before it} from [(batch key, count)]."""
    out, total = {}, base
    for key, n in sorted(counts):
        out[key] = total
        total += n
    return out


def dense_ids(batches, name: str, base: int = 0):
    """(key, [records]) -> (key, first id, [records]): ids base..base+N-1 in key order (base:
    the records of the windows before this one)."""
    offsets = (
        batches
        | f"{name}Count" >> beam.Map(lambda kv: (kv[0], len(kv[1])))
        | f"{name}Counts" >> beam.combiners.ToList()
        | f"{name}Offsets" >> beam.Map(_offsets, base)
    )
    return batches | f"{name}Ids" >> beam.Map(
        lambda kv, off: (kv[0], off[kv[0]], kv[1]), off=beam.pvalue.AsSingleton(offsets)
    )


def blocks(pipeline, opts: _Opts, plan: dict):
    """(batch key, first block id, [Block]) of the window's chunks, and a stats PCollection."""
    res = (
        pipeline
        | "Chunks" >> beam.Create(plan["chunks"])
        | "Spread" >> beam.Reshuffle()  # one chunk per worker at a time
        | "Blocks" >> beam.FlatMap(_chunk_blocks, opts, plan).with_outputs("stats", main="blocks")
    )
    return dense_ids(res.blocks, "Block", plan["base"]["blocks"]), res.stats


def _block_records(batch):
    """(key, first block id, [Block]) -> (first block id, [block records])."""
    _, first, bs = batch
    return first, [
        records.block_record(dataclasses.replace(b, block_id=first + i)) for i, b in enumerate(bs)
    ]


# ------------------------------------------------------------------------------------ masking
def _sentences(batch, opts: _Opts):
    """A block batch -> one sentence batch (text, block id, doc id, held out?, title) in
    order."""
    key, first, bs = batch
    out = [
        (
            b.text[cs:ce],
            first + i,
            b.doc_id,
            is_eval(records.split_key(opts, b.doc_id, b.title), opts.eval_fraction, opts.seed),
            b.title,
        )
        for i, b in enumerate(bs)
        for cs, ce in b.sentences
    ]
    if out:
        yield key, out


class MaskBatch(beam.DoFn):
    """Sentence batch -> (key, [example records without example_id]) of one split: tokenise,
    drop short sentences, find salient spans (spaCy NER, loaded once per worker in setup)."""

    def __init__(self, opts: _Opts, held_out: bool):
        self.opts, self.held_out = opts, held_out

    def setup(self):
        self.stats = collections.Counter()
        self.masker = records.make_masker(self.opts, self.stats, 1)

    def process(self, batch):
        _, first, sents = batch
        mine = [(first + m, s) for m, s in enumerate(sents) if s[3] == self.held_out]
        self.stats.clear()  # the masker counts its skips here: one batch's worth
        encs = tk.wordpieces([s[0] for _, s in mine])
        keep = [m for m, e in enumerate(encs) if len(e.ids) >= self.opts.min_sentence_tokens]
        cands = self.masker.candidates([mine[m][1][0] for m in keep])
        out = []
        for m, cand in zip(keep, cands, strict=True):
            index, (text, block_id, doc_id, _, title) = mine[m]
            spans = self.masker.choices(index, text, encs[m].offsets, cand)
            if spans:
                rec = records.example_record(
                    -1, block_id, doc_id, title, text, encs[m].ids, spans, self.opts.query_len
                )
                out.append(rec)
                self.stats["salient_spans"] += len(spans)
        self.stats["sentences"] += len(mine)
        self.stats["skipped_short_sentence"] += len(mine) - len(keep)
        self.stats["kept"] += len(out)
        self.stats["mode_" + self.masker.mode] += 1
        yield beam.pvalue.TaggedOutput("stats", collections.Counter(self.stats))
        if out:
            yield batch[0], out


def write_sentences(bl, opts: _Opts, prefix: str, base: int) -> None:
    """Block batches -> the sentence table (JSON lines, one numbered sentence batch a line)
    that both example pipelines read, so documents are tokenised and blocked once."""
    write_table(bl | "Sentences" >> beam.FlatMap(_sentences, opts), prefix, base)


def write_table(batches, prefix: str, base: int) -> None:
    """(key, [(text, block id, doc id, held out, title)]) sentence batches -> the sentence table,
    each batch numbered from base (the sentences of the windows before) in key order."""
    _ = (
        dense_ids(batches, "Sentence", base)
        | "SentenceJson" >> beam.Map(json.dumps)
        | "WriteSentences" >> beam.io.WriteToText(prefix, file_name_suffix=".jsonl")
    )


def _text_batches(k: int, opts: _Opts, plan: dict):
    """One chunk of the separate text -> ((k, j), [(sentence, -1, doc id, held out, title)]) batches
    in text order, as the in-process path lists them (local_prepare.pretraining_sentences),
    plus ("stats", Counter) of the chunk's sentences."""
    docs = _chunk_docs(k, opts, plan)
    stats, rows, j = collections.Counter(), [], 0
    for chunk in records.chunks(docs, records.CHUNK):
        spans = masking.split_sentences(text for _, _, text in chunk)
        for (doc_id, title, text), sp in zip(chunk, spans, strict=True):
            held = is_eval(records.split_key(opts, doc_id, title), opts.eval_fraction, opts.seed)
            rows.extend((text[a:b], -1, doc_id, held, title) for a, b in sp)
            stats[SENTENCES] += len(sp)
            while len(rows) >= TEXT_BATCH:
                yield ((k, j), rows[:TEXT_BATCH])
                rows, j = rows[TEXT_BATCH:], j + 1
    if rows:
        yield ((k, j), rows)
    yield beam.pvalue.TaggedOutput("stats", stats)


def _sentence_batch(line: str):
    key, first, sents = json.loads(line)
    return tuple(key), first, sents


def examples(pipeline, opts: _Opts, prefix: str, held_out: bool, base: int):
    """(first example_id, [records]) batches of one split (ids from base), and a stats
    PCollection."""
    res = (
        pipeline
        | "ReadSentences" >> beam.io.ReadFromText(prefix + "*")
        | "SentenceBatches" >> beam.Map(_sentence_batch)
        | "Mask" >> beam.ParDo(MaskBatch(opts, held_out)).with_outputs("stats", main="ex")
    )

    def numbered(batch):
        _, first, records = batch
        return first, [{**rec, "example_id": first + i} for i, rec in enumerate(records)]

    return dense_ids(res.ex, "Example", base) | "Numbered" >> beam.Map(numbered), res.stats


# -------------------------------------------------------------------------------- TFDS builders
def _add(a: dict, b: dict) -> collections.Counter:
    return collections.Counter(a) + collections.Counter(b)


def _write_stats(stats, path: str) -> None:
    """Sum the stats Counters of every batch into one small JSON file the driver reads."""
    _ = (
        stats
        | "SumStats" >> beam.CombineGlobally(lambda cs: functools.reduce(_add, cs, {}))
        | "WriteStats" >> beam.Map(lambda c: _write_json(dict(c), path))
    )


# ---------------------------------------------------------------------------- array_record sink
# TFDS gives the format (features, serializer, dataset_info); the records are written by the
# pipeline itself, not by TFDS's Beam writer, on purpose: that writer opens array_record files
# with array_record's own writer, which writes local files only (no gs:// build folder, so no
# Dataflow), after a shuffle of every serialized record to order them by key. Here records travel in
# id-ordered batches; each shard is a fixed range of ids (data.beam_shard_records), written by
# one worker to its local disk and copied to the build folder (a local folder or gs://) under a
# name that carries its window, its place and its record count. The driver then renames the
# shards to TFDS's names and writes dataset_info from those counts (finalize).
PART = re.compile(r"-w(\d+)-(\d+)\.n(\d+)$")  # a written shard: window, shard in window, records


def dataset_folder(tmp: str, name: str, cls) -> str:
    """Where TFDS keeps a dataset's files: <tmp>/<name>/<builder name>/<version>."""
    return fs.join(tmp, name, cls.name, str(cls.VERSION))


def _shard_parts(batch, base: int, per: int):
    """(first id, [records]) -> (shard in window, (first id, records)) pieces: shard s of a
    window holds ids base + s * per ... base + (s + 1) * per - 1."""
    first, recs = batch
    i = 0
    while i < len(recs):
        s = (first + i - base) // per
        end = min(len(recs), base + (s + 1) * per - first)
        yield s, (first + i, recs[i:end])
        i = end


class WriteShard(beam.DoFn):
    """(shard, [(first id, records)]) -> one array_record file in the build folder, records in
    id order (TFDS's encoding and serialization, as its writer would store them)."""

    def __init__(self, cls, folder: str, window: int, base: int, per: int):
        self.cls, self.folder, self.window, self.base, self.per = cls, folder, window, base, per

    def setup(self):
        self.serialize = shards.serializer(self.cls)

    def process(self, shard_parts):
        from array_record.python.array_record_module import ArrayRecordWriter

        shard, parts = shard_parts
        parts = sorted(parts, key=lambda p: p[0])
        want = self.base + shard * self.per
        n = 0
        fd, local_path = tempfile.mkstemp(suffix=".array_record")
        os.close(fd)
        try:
            writer = ArrayRecordWriter(local_path, "group_size:1")
            for first, recs in parts:
                if first != want + n:  # ids are dense: a gap or overlap is a bug, not data
                    raise RuntimeError(f"shard {shard}: records from id {first}, {want + n} due")
                for rec in recs:
                    writer.write(self.serialize(rec))
                n += len(recs)
            writer.close()
            name = shards.part_name(self.cls, self.window, shard, n)
            with (
                open(local_path, "rb") as src,
                FileSystems.create(fs.join(self.folder, name)) as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 22)
        finally:
            os.remove(local_path)
        yield n


def write_records(batches, cls, tmp: str, name: str, window: int, base: int, per: int) -> None:
    """(first id, [records]) batches with dense ids from base -> this window's shards of
    dataset `name` (renamed and described by finalize once every window is written)."""
    folder = dataset_folder(tmp, name, cls)
    _ = (
        batches
        | f"{name}Shards" >> beam.FlatMap(_shard_parts, base, per)
        | f"{name}ByShard" >> beam.GroupByKey()
        | f"{name}Write" >> beam.ParDo(WriteShard(cls, folder, window, base, per))
    )


def finalize(tmp: str, name: str, cls) -> int:
    """Rename a dataset's written shards, in (window, shard) order, to TFDS's
    <stem>-<i>-of-<n> names and write its dataset_info.json and features.json from their
    record counts and sizes; returns the number of records (0: nothing was written and the
    dataset is left out, as TFDS cannot describe an empty one)."""
    folder = dataset_folder(tmp, name, cls)
    found = FileSystems.match([fs.join(folder, f"{shards.stem(cls)}-w*")])[0].metadata_list
    written = []
    for m in found:
        part = PART.search(m.path)
        if part is None:  # only WriteShard writes here: anything else is not ours to publish
            raise RuntimeError(f"{m.path}: not a shard this prepare wrote")
        written.append((tuple(int(g) for g in part.groups()), m.path, m.size_in_bytes))
    written.sort()
    if not written:
        return 0
    total, lengths = len(written), [n for (_, _, n), _, _ in written]
    for i, (_, path, _) in enumerate(written):
        final = fs.join(folder, f"{shards.stem(cls)}-{i:05d}-of-{total:05d}")
        FileSystems.rename([path], [final])
    with tempfile.TemporaryDirectory() as scratch:
        info = cls(data_dir=scratch, file_format="array_record").info
    template = tfds.core.ShardedFileTemplate(
        data_dir=folder, dataset_name=cls.name, split="train", filetype_suffix="array_record"
    )
    split = tfds.core.SplitInfo(
        name="train",
        shard_lengths=lengths,
        num_bytes=sum(size for _, _, size in written),
        filename_template=template,
    )
    info.set_splits(tfds.core.SplitDict([split]))
    info.write_to_directory(folder)
    return sum(lengths)


def runner_name(runner: str) -> str:
    """Beam's DirectRunner tries the Prism runner first (a Go binary it downloads), then falls
    back to the FnApiRunner; name the FnApiRunner directly: it works offline and honours
    --direct_num_workers / --direct_running_mode."""
    return "FnApiRunner" if runner in ("", "DirectRunner") else runner


def default_options() -> str:
    """Beam's DirectRunner with one worker process per core."""
    return (
        f"--direct_num_workers={os.cpu_count() or 1} --direct_running_mode=multi_processing "
        "--default_sdk_harness_log_level=WARNING"
    )


# Counts the in-process path always reports (others only when non-zero).
ALWAYS = (
    "documents",
    "blocks",
    "sentences",
    "skipped_short_sentence",
    "examples",
    "eval_examples",
    "salient_spans",
)


def windows(num_chunks: int, chunk_kb: int, window_kb: int, runner: str) -> list[list[int]]:
    """The chunks of each window, in corpus order: whole chunks of about window_kb KiB on a
    local runner (window_kb 0: one window), the whole corpus on any other runner."""
    per = max(1, window_kb // chunk_kb) if window_kb and runner in LOCAL_RUNNERS else num_chunks
    return [list(range(s, min(s + per, num_chunks))) for s in range(0, num_chunks, per)]


def _run_blocks(p, opts: _Opts, plan: dict, tmp: str, stats_path: str) -> None:
    """One window's blocks pipeline: blocks -> blocks dataset shards, the sentence table
    (unless a separate text gives the sentences) and the window's stats."""
    bl, stats = blocks(p, opts, plan)
    _write_stats(stats, stats_path)
    if not opts.sentences:
        write_sentences(bl, opts, plan["sentences"], plan["base"][SENTENCES])
    rows = bl | "BlockRecords" >> beam.Map(_block_records)
    w, base, per = plan["window"], plan["base"]["blocks"], opts.beam_shard_records
    write_records(rows, records.RealmBlocks, tmp, "blocks", w, base, per)


def _run_text(p, opts: _Opts, plan: dict, tmp: str, stats_path: str) -> None:
    """One window of the separate text: its documents -> the sentence table and the window's
    sentence count (the examples pipelines then read the table)."""
    res = (
        p
        | "Chunks" >> beam.Create(plan["chunks"])
        | "Spread" >> beam.Reshuffle()  # one chunk per worker at a time
        | "Text" >> beam.FlatMap(_text_batches, opts, plan).with_outputs("stats", main="rows")
    )
    _write_stats(res.stats, stats_path)
    write_table(res.rows, plan["sentences"], plan["base"][SENTENCES])


def _run_examples(p, opts: _Opts, plan: dict, tmp: str, stats_path: str, name: str) -> None:
    """One window's examples pipeline for one split (name: examples or eval_examples)."""
    held_out, base = name == "eval_examples", plan["base"][name]
    ex, stats = examples(p, opts, plan["sentences"], held_out, base)
    _write_stats(stats, stats_path)
    write_records(
        ex, records.RealmExamples, tmp, name, plan["window"], base, opts.beam_shard_records
    )


def check_runner(data, runner: str, data_dir: str) -> None:
    """Refuse, before anything runs, what a remote runner's workers could not reach: they read
    data.corpus (and data.sentences) and write the build folder themselves, so all must be on
    an object store."""
    if runner in LOCAL_RUNNERS:
        return
    paths = [("data.corpus", data.corpus), ("data.sentences", data.sentences)]
    missing = [
        f"{what} ({path})"
        for what, path in [*paths, ("the data_dir", data_dir)]
        if path and not fs.is_remote(path)
    ]
    if missing:
        raise PrepareError(
            f"--beam_runner={runner}: its workers read the inputs and write the datasets "
            f"themselves, so {' and '.join(missing)} must be "
            f"{'a gs:// path' if len(missing) == 1 else 'gs:// paths'} (tpu/README.md)"
        )


def build(data, tmp: str, stats: collections.Counter, *, runner: str, options: str) -> str:
    """Build blocks/, examples/ and eval_examples/ under tmp, a local folder or gs:// (one
    dataset missing when it would be empty; prepare.py explains); fills stats as the
    in-process path does; returns the effective masking mode. Bad input raises the in-process
    path's CorpusError. The caller has checked the runner against the data_dir (check_runner)
    before making tmp."""
    why = supported(data)
    if why:
        raise PrepareError(f"data.engine='beam': {why}; use --config.data.engine=local")
    opts = _Opts({k: data[k] for k in OPT_FIELDS})
    options, runner = options or default_options(), runner_name(runner)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)  # per-stage INFO chatter
    pipe_opts = beam.options.pipeline_options.PipelineOptions(shlex.split(options))
    work = fs.join(tmp, "beam")  # scratch: staged .gz copies, scan results, sentence tables
    print(f"prepare on Apache Beam: runner {runner}, options {options!r}")
    inputs = [data.corpus] + ([data.sentences] if data.sentences else [])
    sources = {name: (Source(name, name), None) for name in inputs}
    gz = [name for name in inputs if corpus_lib.is_gzip(name)]
    if gz:
        t0 = time.time()
        sources.update(stage(gz, runner, pipe_opts, work))
        print(
            f"prepare on Apache Beam: stage pipeline (decompress .gz) took {time.time() - t0:.1f}s"
        )
    plans = []  # (plan, prefix of its stats): the corpus, then the separate text
    for i, (name, prefix) in enumerate(zip(inputs, ("", "sentences_"), strict=False)):
        src, tail = sources[name]
        t0 = time.time()
        res = scan(opts, runner, pipe_opts, fs.join(work, f"scan-{i}.json"), src)
        plans.append(check_scan(opts, {**res, "tail": tail}, stats, src, prefix))
        print(f"prepare on Apache Beam: scan pipeline ({name}) took {time.time() - t0:.1f}s")
    cplan, tplan = plans[0], (plans[1] if data.sentences else None)
    names = ["blocks", "eval_examples", "examples"]
    splits = ["eval_examples"] * (data.eval_fraction > 0) + ["examples"]
    # Ids of the windows before: blocks, sentences (the random-masking seed), examples by split.
    base = dict.fromkeys([*names, SENTENCES], 0)
    cplan["base"] = base
    if tplan is not None:
        tplan["base"] = base
    rounds = [(cplan, "", "blocks", _run_blocks)]  # (plan, label, stats name, pipeline)
    if tplan is not None:
        rounds.append((tplan, "text ", "sentences", _run_text))
    wins = [
        windows(len(plan["first_line"]) - 1, opts.beam_chunk_kb, data.beam_window_kb, runner)
        for plan, *_ in rounds
    ]
    total_chunks, done = sum(len(plan["first_line"]) - 1 for plan, *_ in rounds), 0
    got, t_start = [], time.time()

    def run(name: str, where: str, plan: dict, pipeline, *args) -> dict:
        path, t0 = fs.join(work, f"{name}-{plan['window']}.stats.json"), time.time()
        with beam.Pipeline(runner=runner, options=pipe_opts) as p:
            pipeline(p, opts, plan, tmp, path, *args)
        print(f"prepare on Apache Beam: {where}{name} pipeline took {time.time() - t0:.1f}s")
        got.append(_read_json(path) if FileSystems.exists(path) else {})
        return got[-1]

    for (plan, label, first_name, pipeline), plan_wins in zip(rounds, wins, strict=True):
        if plan is tplan and not base["blocks"]:
            break  # no blocks: prepare stops (as the in-process path does before the text)
        for w, chunks in enumerate(plan_wins):
            many = len(plan_wins) > 1
            where = (
                f"{label}window {w + 1}/{len(plan_wins)}: " if many else label.replace(" ", ": ")
            )
            table = fs.join(work, f"{first_name}-{w}", "part")  # this window's sentence table
            plan.update(chunks=chunks, window=w, sentences=table)
            made = run(first_name, where, plan, pipeline)
            # The sentences come from this round: the corpus's blocks, or the separate text.
            mine = (plan is tplan) == bool(data.sentences)
            if mine and stats["documents"] and made.get(SENTENCES):
                for name in splits:
                    base[name] += run(name, where, plan, _run_examples, name).get("kept", 0)
            base["blocks"] += made.get("blocks", 0)
            base[SENTENCES] += made.get(SENTENCES, 0) if mine else 0
            done += len(chunks)
            if total_chunks > 1 and len(plan_wins) > 1:
                spent = time.time() - t_start
                print(
                    f"prepare on Apache Beam: {where}{base['blocks']:,} blocks, "
                    f"{base['examples'] + base['eval_examples']:,} examples so far, "
                    f"{spent:.0f}s, ETA {spent / done * (total_chunks - done):.0f}s"
                )
    for name in names:
        cls = records.RealmBlocks if name == "blocks" else records.RealmExamples
        written = finalize(tmp, name, cls)
        if written != base[name]:  # a lost or repeated shard: never publish that
            raise RuntimeError(f"{name}: {written} records written, {base[name]} made")
    stats["eval_examples"] = base["eval_examples"]
    stats["examples"] = base["examples"]
    for g in got:
        stats.update(
            {k: v for k, v in g.items() if not k.startswith(("mode_", "_")) and k != "kept"}
        )
    for key in list(stats):
        if not stats[key] and key not in ALWAYS:
            del stats[key]
    for key in ALWAYS:
        stats[key] += 0
    fs.rmtree(work)
    random = data.masking == "random" or any(g.get("mode_random") for g in got)
    return "random" if random else "salient"
