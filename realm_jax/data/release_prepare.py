"""`prepare` of the release's block records (ORQA's blocks.tfr + titles.tfr, HuggingFace's
block_records.npy), streamed: memory follows a chunk of blocks, not the corpus.

The release's 13,353,718 blocks held in memory (release_blocks.release_blocks, the in-process
path of any other corpus) would need ~700 GB; here the records are read in chunks of
data.release_chunk_blocks, each chunk tokenised (release_blocks.release_chunk), written to the
blocks dataset's shards (data/shards.py, data.beam_shard_records per file) and, unless a
separate pre-training text is configured, its sentences masked into the examples and
eval_examples shards, before the next chunk is read. Ids and records are exactly the in-memory
path's (tests/unit/test_block_records.py compares the two): block id i = record i, example ids
dense per split in sentence order, random masks seeded by the sentence's corpus-wide index.

What still grows with the corpus: nothing of the blocks. HuggingFace's block_records.npy is a
pickle, which cannot be read record by record: its texts are loaded whole first (the whole
corpus's text); ORQA's blocks.tfr streams. A separate pre-training text (data.sentences) is prepared
as for any corpus (in memory).
"""

from __future__ import annotations

import collections
import os
import time

from realm_jax import fs
from realm_jax.data import local_prepare, records, release_blocks, shards
from realm_jax.data.datasets import DATASETS, is_eval
from realm_jax.interop import block_records

DEFAULT_CHUNK = 4096  # blocks read, tokenised and written per step


class _Bar:
    """Progress on stderr: blocks, MB of blocks.tfr read, rate and ETA (by bytes), at most
    every 10 s, so a 12-hour prepare says where it is."""

    def __init__(self, path: str, every_s: float = 10.0):
        self.total = fs.size(path) if path.endswith((".tfr", ".tfrecord", ".tfrecords")) else 0
        self.start = self.last = time.time()
        self.every_s = every_s

    def update(self, blocks: int, done_bytes: int, final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        rate = blocks / max(now - self.start, 1e-9)
        line = f"prepare: release blocks: {blocks:,} ({rate:,.0f}/s)"
        if self.total:
            frac = min(done_bytes / self.total, 1.0)
            eta = (now - self.start) * (1 - frac) / max(frac, 1e-9)
            line += f", {frac:.1%} of the file" + ("" if final else f", ETA {eta / 60:.0f} min")
        print(line + (" (done)" if final else ""), flush=True)


def build(data, tmp: str, stats: collections.Counter) -> str:
    """The datasets of the release corpus data.corpus into the build folder tmp (local);
    returns the masking mode."""
    from realm_jax.data import beam_prepare  # finalize: TFDS shard names + dataset_info

    per = data.beam_shard_records
    chunk_blocks = data.get("release_chunk_blocks", DEFAULT_CHUNK)  # configs/realm.py

    def writer(name, cls):
        return shards.ShardWriter(cls, beam_prepare.dataset_folder(tmp, name, cls), per)

    blocks_out = writer("blocks", records.RealmBlocks)
    from_blocks = not data.sentences  # else the text's examples, as for any corpus (below)
    masker = records.make_masker(data, stats, data.ner_processes) if from_blocks else None
    examples = {}
    if from_blocks:
        examples[False] = writer("examples", records.RealmExamples)
        examples[True] = writer("eval_examples", records.RealmExamples)
    spans = sentences = 0
    last_title, done_bytes = None, 0
    bar = _Bar(data.corpus)
    pairs = block_records.read_release_blocks(data.corpus)
    while chunk := [p for _, p in zip(range(chunk_blocks), pairs)]:
        blocks = release_blocks.release_chunk(chunk, blocks_out.total, data.block_len, stats)
        n, last_title = release_blocks.count_documents(blocks, last_title)
        stats["documents"] += n
        for b in blocks:
            blocks_out.write(records.block_record(b))
            done_bytes += len(b.text.encode("utf-8")) + 16  # ~ its record in blocks.tfr
        if from_blocks:
            spans += _examples(data, masker, blocks, sentences, examples, stats)
            sentences += sum(len(b.sentences) for b in blocks)
        bar.update(blocks_out.total, done_bytes)
    stats["blocks"] = blocks_out.close()
    bar.update(stats["blocks"], bar.total, final=True)
    if from_blocks:
        stats["sentences"] = sentences
        stats["examples"] = examples[False].close()
        stats["eval_examples"] = examples[True].close()
        stats["salient_spans"] = spans
        mode = masker.mode
    else:
        train, held_out, mode = local_prepare.build_examples(data, [], stats)  # the text's
        if train:
            records.write_dataset(records.RealmExamples, train, os.path.join(tmp, "examples"))
        if held_out:
            records.write_dataset(
                records.RealmExamples, held_out, os.path.join(tmp, "eval_examples")
            )
    for name, cls in (("blocks", records.RealmBlocks), ("examples", records.RealmExamples)):
        if from_blocks or name == "blocks":
            beam_prepare.finalize(tmp, name, cls)
    if from_blocks:
        beam_prepare.finalize(tmp, "eval_examples", records.RealmExamples)
    for name in DATASETS:  # an empty dataset is left out (TFDS cannot describe one)
        folder = os.path.join(tmp, name)
        if os.path.isdir(folder) and not any(files for _, _, files in os.walk(folder)):
            fs.rmtree(folder)
    return mode


def _examples(data, masker, blocks, base: int, out: dict, stats) -> int:
    """The chunk's sentences masked and written (train or held out by their article's split
    key); returns the salient spans written. base: the corpus-wide index of the chunk's first
    sentence."""
    texts, block_ids, doc_ids, titles, held = [], [], [], [], []
    for b in blocks:
        key = records.split_key(data, b.doc_id, b.title)
        for cs, ce in b.sentences:
            texts.append(b.text[cs:ce])
            block_ids.append(b.block_id)
            doc_ids.append(b.doc_id)
            titles.append(b.title)
            held.append(is_eval(key, data.eval_fraction, data.seed))
    spans_written = 0
    for i, enc, spans in records.masked_sentences(data, masker, texts, None, stats, base):
        if not spans:
            continue
        w = out[held[i]]
        source = (block_ids[i], doc_ids[i], titles[i], texts[i])
        w.write(records.example_record(w.total, *source, enc.ids, spans, data.query_len))
        spans_written += len(spans)
    return spans_written
