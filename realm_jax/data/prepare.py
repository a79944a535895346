"""`realm-jax prepare`: raw corpus -> TFDS array_record datasets (no TensorFlow needed).

Layout of a prepared data_dir:
  <data_dir>/blocks/realm_blocks/1.0.0/      block_id, doc_id, title, text, token_ids
                                             (record i has block_id i; token_ids unpadded
                                             [CLS] title [SEP] body [SEP], int32)
                                             sentence_starts (each body sentence's first
                                             position in token_ids: ICT's queries)
  <data_dir>/examples/realm_examples/1.0.0/  example_id, block_id (-1: separate text), doc_id,
                                             text, token_ids ([CLS] x [SEP], <= query_len),
                                             span_starts, span_ends (every usable salient span,
                                             inclusive positions in token_ids; the pipeline
                                             draws one per epoch), span_labels ("DATE,PERSON")
  <data_dir>/eval_examples/realm_examples/1.0.0/  the same for the held-out documents:
                                             data.eval_fraction of the titles (or doc ids),
                                             chosen by a hash, so no sentence of a held-out
                                             article is trained on; their blocks stay in the
                                             corpus (retrieval may find them)
  <data_dir>/summary.json                    counts, fingerprint, config, the vocabulary's
                                             size (vocab_size); written LAST: a folder
                                             without it is incomplete and loaders refuse it.
Datasets are built in <data_dir>/.prepare-tmp-<pid>/ and renamed into place at the end. For a
gs:// data_dir the in-process path builds them in a local temp folder and uploads them, the
Beam path's workers write them into <data_dir>/.prepare-tmp-<pid>/ there, and they are copied
into place; summary.json (listing every dataset file and its size) goes last.
Readers open a dataset folder directly (`tfds.builder_from_directory(...).as_data_source()`,
the same ArrayRecord data source `tfds.data_source` returns, without a registered name): that
read side is data/datasets.py.

This module chooses an engine (choose_engine), fingerprints the input and publishes; the
engines build: local_prepare.py (in process), beam_prepare.py (Apache Beam) and
release_prepare.py (the release's block records, streamed). They share data/records.py and
none imports this module.
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
import json
import os
import sys
import tempfile
import time

from realm_jax import fs, workdir
from realm_jax import tokenization as tk
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import download, local_prepare, records, squad_json
from realm_jax.data.datasets import (
    DATASETS,
    FORMAT_VERSION,
    NO_HELD_OUT,
    SUMMARY,
    PrepareError,
    read_summary,
)
from realm_jax.interop import block_records, realm_records

BEAM_MIN_PASSAGES = 50_000  # data.engine=auto: corpora of this many lines go to Beam


# --------------------------------------------------------------------------------- fingerprint
def _hash_file(h, path: str) -> None:
    h.update(path.encode() + b"\0")
    try:
        with fs.open(path, "rb") as f:  # a gs:// corpus too (Beam on Dataflow reads one)
            for chunk in iter(functools.partial(f.read, 1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise corpus_lib.CorpusError(f"{path}: cannot read file: {e}") from e


def fingerprint(data) -> str:
    """sha256 of the input files' contents, the vocab and the fields that shape the output."""
    h = hashlib.sha256(f"realm-jax-prepare-v{FORMAT_VERSION}".encode())
    if not data.corpus:
        raise corpus_lib.CorpusError(
            "data.corpus is empty: name the corpus to prepare, e.g. "
            "--config.data.corpus=my_corpus.jsonl (configs/realm.py:own has no default corpus)"
        )
    for field in ("corpus", "sentences"):
        src = data[field]
        if field == "sentences" and realm_records.is_release_text(src):  # a glob too
            for path in realm_records.input_files(src):
                _hash_file(h, path)
            continue
        if src and not fs.exists(src):
            where = "" if os.path.isabs(src) else f" (relative to {os.getcwd()})"
            raise corpus_lib.CorpusError(f"data.{field}={src!r}: no such file or folder{where}")
        if not src:
            continue
        release = field == "corpus" and block_records.is_release_corpus(src)
        for path in block_records.input_files(src) if release else corpus_lib.input_files(src):
            _hash_file(h, path)
    _hash_file(h, tk.VOCAB_PATH)
    h.update(json.dumps({k: data[k] for k in records.FP_FIELDS}, sort_keys=True).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------ prepare


def _fresh_tmp(data_dir: str, *, shared: bool = False) -> str:
    """An empty build folder; leftovers of interrupted prepares are removed first. For an
    object-store data_dir (gs://) a local temp folder (the in-process path's array_record
    writer writes local files, and _publish uploads them), unless `shared`: a build on other
    machines (Beam's workers) writes into <data_dir>/.prepare-tmp-<pid>/ there, and _publish
    copies it."""
    if fs.is_remote(data_dir) and not shared:
        return tempfile.mkdtemp(prefix="realm-prepare-")
    fs.makedirs(data_dir)
    for name in fs.listdir(data_dir):
        if name.startswith(".prepare-tmp-"):
            print(f"removing {name}, left by an interrupted prepare")
            fs.rmtree(fs.join(data_dir, name))
    tmp = fs.join(data_dir, f".prepare-tmp-{os.getpid()}")
    fs.makedirs(tmp)
    return tmp


def _publish(tmp: str, data_dir: str, summary: dict) -> None:
    """Swap the finished datasets into place; summary.json (the completion marker) goes last
    and lists every dataset file with its size (summary["files"]), which readers check
    (data/datasets.py): on an object store, where the datasets are uploaded file by file with
    no atomic rename, that is what tells a complete prepare from an interrupted one."""
    names = [n for n in DATASETS if fs.isdir(fs.join(tmp, n))]
    summary["files"] = {
        f"{n}/{rel}": fs.size(fs.join(tmp, n, *rel.split("/")))
        for n in names
        for rel in fs.walk_files(fs.join(tmp, n))
    }
    final = fs.join(data_dir, SUMMARY)
    fs.remove(final)  # from here on the old datasets are no longer loadable
    for name in DATASETS:
        fs.rmtree(fs.join(data_dir, name))
        if name not in names:
            continue
        if fs.is_remote(data_dir) and not fs.is_remote(tmp):
            fs.upload_tree(os.path.join(tmp, name), fs.join(data_dir, name))
        else:  # atomic locally; on gs:// a copy of each object (the summary commits it)
            fs.rename(fs.join(tmp, name), fs.join(data_dir, name))
    fs.write_bytes(final, json.dumps(summary, indent=2, sort_keys=True).encode())
    fs.rmtree(tmp)


def _skipped(stats) -> str:
    """'skipped_x 3, skipped_y 1' (or 'nothing skipped'): the counts that explain empty output."""
    parts = [f"{k} {v}" for k, v in sorted(stats.items()) if k.startswith("skipped") and v]
    return ", ".join(parts) or "nothing skipped"


def _print_summary(s: dict) -> None:
    print(f"prepared {s['data_dir']} in {s['elapsed_s']:.1f}s (masking: {s['masking']})")
    for key in ("documents", "blocks", "sentences", "examples", "eval_examples"):
        print(f"  {key:<28}{s['counts'].get(key, 0):>10}")
    for key, v in sorted(s["counts"].items()):
        if "skipped" in key:
            print(f"  {key:<28}{v:>10}")


def _no_blocks(data, stats) -> PrepareError:
    why = (
        f"none of its {stats['documents']} documents left body text in blocks of "
        f"data.block_len={data.block_len} wordpieces ([CLS] title [SEP] body [SEP]); "
        "raise data.block_len"
        if stats["documents"]
        else f"no documents (empty input, or every document skipped: {_skipped(stats)})"
    )
    return PrepareError(f"{data.corpus}: no usable documents: {why}")


def _no_examples(data, stats, num_eval: int, mode: str) -> PrepareError:
    if num_eval:
        why = (
            f"all {num_eval} examples are held out for evaluation "
            f"(data.eval_fraction={data.eval_fraction}); lower data.eval_fraction"
        )
    elif mode == "salient":
        why = (
            f"no sentence of {stats['sentences']} has a usable salient span (named entity "
            "or date); try --config.data.masking=random"
        )
    else:
        why = f"no sentence of {stats['sentences']} has a usable span"
    return PrepareError(f"{data.corpus}: no pre-training examples: {why} ({_skipped(stats)})")


def _build_local(data, data_dir: str, stats) -> tuple[str, str]:
    """The in-process path: the corpus in memory; returns (build folder, masking mode). The
    release's block records stream instead (data/release_prepare.py)."""
    if block_records.is_release_corpus(data.corpus):
        return _build_release(data, data_dir, stats)
    blocks = local_prepare.build_blocks(data, stats)
    if not blocks:
        raise _no_blocks(data, stats)
    train, held_out, mode = local_prepare.build_examples(data, blocks, stats)
    if not train:
        raise _no_examples(data, stats, len(held_out), mode)
    tmp = _fresh_tmp(data_dir)  # bad input stops above, before anything is written
    write = records.write_dataset
    rows = (records.block_record(b) for b in blocks)
    write(records.RealmBlocks, rows, os.path.join(tmp, "blocks"))
    write(records.RealmExamples, train, os.path.join(tmp, "examples"))
    if held_out:  # TFDS cannot write an empty dataset; loaders say what is missing
        write(records.RealmExamples, held_out, os.path.join(tmp, "eval_examples"))
    return tmp, mode


def _build_release(data, data_dir: str, stats) -> tuple[str, str]:
    from realm_jax.data import release_prepare

    tmp = _fresh_tmp(data_dir)
    return _checked(data, tmp, stats, lambda: release_prepare.build(data, tmp, stats))


def _checked(data, tmp: str, stats, build) -> tuple[str, str]:
    """(tmp, masking mode) after build() fills the build folder tmp and the counts; no blocks
    or no examples stops with the reason, and any failure removes tmp (nothing published)."""
    try:
        mode = build()
        if not stats["blocks"]:
            raise _no_blocks(data, stats)
        if not stats["examples"]:
            raise _no_examples(data, stats, stats["eval_examples"], mode)
    except BaseException:
        fs.rmtree(tmp)
        raise
    return tmp, mode


def _build_beam(data, data_dir: str, stats, runner: str, options: str) -> tuple[str, str]:
    """The Apache Beam path (data/beam_prepare.py): streams the corpus; same output."""
    try:
        from realm_jax.data import beam_prepare
    except ImportError as e:
        raise PrepareError(
            f"data.engine=beam needs apache-beam ({e}): pip install -r requirements.txt"
        ) from e
    runner = beam_prepare.runner_name(runner or "DirectRunner")
    beam_prepare.check_runner(data, runner, data_dir)  # before anything is made
    # A gs:// data_dir is built in place (<data_dir>/.prepare-tmp-<pid>/): the workers write
    # their shards there themselves, which is what lets a Dataflow job write at all.
    tmp = _fresh_tmp(data_dir, shared=fs.is_remote(data_dir))
    build = functools.partial(beam_prepare.build, data, tmp, stats, runner=runner, options=options)
    return _checked(data, tmp, stats, build)


def choose_engine(data, beam_runner: str = "") -> str:
    """'local' or 'beam' from data.engine; auto: Beam for line files (corpus and separate text
    together) of at least data.beam_min_passages lines, or on gs://, or when a --beam_runner
    is named; else in process."""
    engine = data.get("engine", "auto")
    if block_records.is_release_corpus(data.corpus):  # read in process (interop/block_records.py)
        if engine == "beam" or beam_runner:
            raise PrepareError(f"{data.corpus}: release block records are prepared in process")
        return "local"
    if realm_records.is_release_text(data.sentences):  # read in process (interop/realm_records.py)
        if engine == "beam" or beam_runner:
            raise PrepareError(
                f"data.sentences={data.sentences}: REALM's pre-training TFRecord shards are "
                "prepared in process (data.engine=local or auto, no --beam_runner)"
            )
        return "local"
    if engine == "local":
        if beam_runner:
            raise PrepareError(f"--beam_runner={beam_runner} needs data.engine=beam (or auto)")
        return "local"
    if engine == "beam" or beam_runner:
        return "beam"
    inputs = [p for p in (data.corpus, data.sentences) if p]
    if any(
        os.path.isdir(p)
        or (not fs.is_remote(p) and corpus_lib.is_plain_text(p))
        or squad_json.looks_like(p)  # one JSON object: no lines to share out
        for p in inputs
    ):
        return "local"  # the Beam path reads line files (beam_prepare.supported)
    if any(fs.is_remote(p) for p in inputs):
        return "beam"  # gs:// inputs at scale: Beam's workers read them in parallel
    want = data.get("beam_min_passages", BEAM_MIN_PASSAGES)
    lines = sum(corpus_lib.count_lines(p, want) or 0 for p in inputs)
    return "beam" if lines >= want else "local"


def downloaded(data):
    """`data` with its https:// inputs (corpus, sentences) replaced by their local copies,
    downloaded once into the cache (data/download.py); `data` itself when there are none."""
    urls = [f for f in ("corpus", "sentences") if download.is_url(data.get(f, ""))]
    if not urls:
        return data
    data = copy.deepcopy(data)
    with data.unlocked():
        for f in urls:
            data[f] = download.local(data[f])
    return data


def prepare(
    config,
    data_dir: str,
    *,
    overwrite: bool = False,
    beam_runner: str = "",
    beam_options: str = "",
) -> dict:
    """Build (or reuse) the blocks and examples datasets under data_dir; returns the summary.
    data.engine picks the in-process path or Apache Beam (beam_runner, beam_options: the
    runner's name and its flags; defaults: DirectRunner, one worker per core)."""
    data = downloaded(config.data)
    fp = fingerprint(data)
    old = read_summary(data_dir)
    if old is not None and not overwrite:
        if old.get("fingerprint") == fp:
            print(f"{data_dir} is already prepared from the same input and config: reusing it")
            _print_summary(old)
            return old
        raise PrepareError(
            f"{data_dir} holds data prepared from a different corpus or config "
            f"(fingerprint {old.get('fingerprint', '?')[:12]} != {fp[:12]}); pass --overwrite "
            "(overwrite=True) to rebuild it, or choose another --config.data.data_dir"
        )
    start, stats = time.time(), collections.Counter()
    engine = choose_engine(data, beam_runner)
    if engine == "beam":
        tmp, mode = _build_beam(data, data_dir, stats, beam_runner, beam_options)
    else:
        tmp, mode = _build_local(data, data_dir, stats)
    summary = {
        "complete": True,
        "created": time.time(),
        "fingerprint": fp,
        "format_version": FORMAT_VERSION,
        "data_dir": data_dir,
        "corpus": config.data.corpus,  # as given (a URL, not its cached copy)
        "sentences_source": config.data.sentences,
        "masking": mode,
        "engine": engine,
        "block_len": data.block_len,
        "query_len": data.query_len,
        "vocab_size": tk.vocab_size(),  # every token id is below it (datasets.check_vocab)
        "config": {k: data[k] for k in records.FP_FIELDS},
        "counts": dict(stats),
        "elapsed_s": round(time.time() - start, 2),
    }
    if data.eval_fraction > 0 and not stats["eval_examples"] and engine == "local":
        summary[NO_HELD_OUT] = _no_held_out(data, tmp)
    _publish(tmp, data_dir, summary)
    _print_summary(summary)
    if summary.get(NO_HELD_OUT):
        print(
            f"realm-jax prepare: warning: no held-out examples: {summary[NO_HELD_OUT]}",
            file=sys.stderr,
        )
    return summary


def _no_held_out(data, tmp: str) -> str:
    """Why a small corpus got no held-out examples, and the eval_fraction that gives some."""
    from realm_jax.data.datasets import fraction_for_one

    src = _source_in(tmp)
    recs = src.__getitems__(range(len(src))) if len(src) <= 200_000 else []
    pairs = {(r["doc_id"].decode(), r["title"].decode()) for r in recs}
    keys = {records.split_key(data, d, t) for d, t in pairs}
    kind = "titles" if data.eval_split_key == "title" else "doc ids"
    if len(keys) > 1:
        then = (
            f"; re-prepare with --overwrite --config.data.eval_fraction="
            f"{fraction_for_one(keys, data.seed)} to hold out at least one"
        )
    else:  # one article: hold out documents instead
        docs = {d for d, _ in pairs}
        frac = max(data.eval_fraction, fraction_for_one(docs, data.seed))
        then = (
            "; re-prepare with --overwrite --config.data.eval_split_key=doc_id "
            f"--config.data.eval_fraction={frac} to hold out documents"
            if len(docs) > 1
            else ""
        )
    return (
        f"data.eval_fraction={data.eval_fraction} held out none of the corpus's {len(keys)} "
        f"{kind} (each is held out with that probability), so runs on it have no held-out "
        f"evaluation{then}"
    )


def _source_in(tmp: str):
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(os.path.join(tmp, "blocks", "realm_blocks", "1.0.0"))
    return builder.as_data_source(split="train")


# ------------------------------------------------------------------------------------ loaders


def stale_outputs(run_dir: str) -> list[str]:
    """The run's checkpoints/, index/ and corpus/ (`update`'s versions) folders that hold
    something: built from the data a `prepare --overwrite` replaces (block ids, embeddings and
    masked examples change)."""
    from realm_jax.data import versions

    out = []
    folders = (workdir.checkpoint_dir(run_dir), workdir.index_dir(run_dir))
    for folder in (*folders, versions.corpus_dir(run_dir)):
        if any(not n.startswith(".") for n in fs.listdir(folder)):
            out.append(folder)
    return out


def command(config, args) -> int:
    """`realm-jax prepare`: into config.data.data_dir or <workdir>/data."""
    data_dir = workdir.data_dir(config, args.workdir)
    old = read_summary(data_dir)
    stale = stale_outputs(args.workdir) if args.overwrite and old is not None else []
    if stale and old.get("fingerprint") != fingerprint(downloaded(config.data)):
        print(
            f"realm-jax prepare: warning: {' and '.join(stale)} were built from the old data in "
            f"{data_dir} and no longer match the new data (block ids and examples change); "
            "prepare changed input in a new --workdir, or delete them before training here",
            file=sys.stderr,
        )
    prepare(
        config,
        data_dir,
        overwrite=args.overwrite,
        beam_runner=getattr(args, "beam_runner", ""),
        beam_options=getattr(args, "beam_options", ""),
    )
    return 0
