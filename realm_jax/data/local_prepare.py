"""`prepare`'s in-process engine: the corpus in memory, cut into blocks, its (or a separate
text's) sentences masked into examples. data/prepare.py runs it for small corpora and for
REALM's annotated shards; the release's block records stream instead (release_prepare.py), and
large line files go to Apache Beam (beam_prepare.py). The records are data/records.py's.
"""

from __future__ import annotations

import collections
import contextlib

from tqdm import tqdm

from realm_jax import tokenization as tk
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import masking, release_blocks
from realm_jax.data.datasets import is_eval
from realm_jax.data.records import (
    CHUNK,
    chunks,
    example_record,
    make_masker,
    masked_sentences,
    masking_label,
    split_key,
)
from realm_jax.interop import block_records, realm_records


@contextlib.contextmanager
def _progress(**kwargs):
    """A tqdm bar that is erased when the body raises, so the error is printed on a line of
    its own (not after a half-drawn bar). Drawn on a terminal only: in a log file (stderr not a
    tty) a bar is carriage returns and escape codes (tqdm's disable=None)."""
    kwargs.setdefault("disable", None)
    bar = tqdm(**kwargs)
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()


def build_blocks(data, stats: collections.Counter) -> list[corpus_lib.Block]:
    """Read data.corpus and cut every document into blocks (ids 0..N-1 in corpus order); the
    release's block records (blocks.tfr, block_records.npy) are taken as they are."""
    if block_records.is_release_corpus(data.corpus):
        return release_blocks.release_blocks(data, stats)
    docs = corpus_lib.read_documents(data.corpus, skip_bad_input=data.skip_bad_input, stats=stats)
    by_line = corpus_lib.is_plain_text(data.corpus)  # one sentence a line
    # lines are not documents (SQuAD's JSON is one line)
    lines = not (by_line or corpus_lib.is_squad(data.corpus))
    total = corpus_lib.count_lines(data.corpus) if lines else None
    blocks: list[corpus_lib.Block] = []
    with _progress(total=total, desc="blocks: tokenise", unit="doc") as bar:
        for chunk in chunks(docs, CHUNK):
            for new in blocks_of(chunk, data.block_len, len(blocks), by_line):
                if not new:
                    stats["skipped_empty_text"] += 1
                blocks.extend(new)
            bar.update(len(chunk))
    stats["blocks"] = len(blocks)
    return blocks


def blocks_of(
    docs: list[tuple[str, str, str]], block_len: int, first_id: int, by_line: bool = False
) -> list[list[corpus_lib.Block]]:
    """Each (doc_id, title, text) cut into blocks (an empty list: no usable text), ids from
    first_id on in order: prepare's cut, and `update`'s for the documents it changes."""
    titles = tk.wordpieces([t for _, t, _ in docs])
    bodies = tk.wordpieces([b for _, _, b in docs])
    sents = masking.split_sentences((b for _, _, b in docs), by_line=by_line)
    out = []
    for (doc_id, title, body), t, b, s in zip(docs, titles, bodies, sents, strict=True):
        new = corpus_lib.split_blocks(doc_id, title, body, t.ids, b, s, block_len, first_id)
        first_id += len(new)
        out.append(new)
    return out


def pretraining_sentences(data, blocks, stats):
    """Pre-training sentences, their source block ids (-1 for separate text), doc ids,
    titles (their document's: a block's, or a separate text's document's), whether each is
    held out for evaluation, and each one's salient span candidates when the text brings them
    (REALM's annotated shards, interop/realm_records.py; else None: NER finds them)."""
    given = None
    if realm_records.is_release_text(data.sentences):
        sub = collections.Counter()
        docs = realm_records.read_documents(
            data.sentences, skip_bad_input=data.skip_bad_input, stats=sub
        )
        pairs, given = [], []
        for d, title, sents in docs:
            for text, cands in sents:
                pairs.append((text, -1, d, split_key(data, d, title), title))
                given.append(cands)
        stats.update({f"sentences_{k}": v for k, v in sub.items()})
    elif not data.sentences:
        pairs = [
            (b.text[cs:ce], b.block_id, b.doc_id, split_key(data, b.doc_id, b.title), b.title)
            for b in blocks
            for cs, ce in b.sentences
        ]
    else:
        sub = collections.Counter()
        docs = list(
            corpus_lib.read_documents(data.sentences, skip_bad_input=data.skip_bad_input, stats=sub)
        )
        stats.update({f"sentences_{k}": v for k, v in sub.items()})
        by_line = corpus_lib.is_plain_text(data.sentences)  # one sentence a line
        spans = masking.split_sentences((text for _, _, text in docs), by_line=by_line)
        pairs = [
            (t[a:b], -1, d, split_key(data, d, title), title)
            for (d, title, t), sp in zip(docs, spans, strict=True)
            for a, b in sp
        ]
    stats["sentences"] = len(pairs)
    held = [is_eval(p[3], data.eval_fraction, data.seed) for p in pairs]
    texts, block_ids, doc_ids, _, titles = (list(c) for c in zip(*pairs)) if pairs else ([],) * 5
    return texts, block_ids, doc_ids, titles, held, given


def build_examples(data, blocks, stats: collections.Counter) -> tuple[list[dict], list[dict], str]:
    """Masked pre-training examples; returns (train records, held-out records, effective
    masking mode)."""
    texts, block_ids, doc_ids, titles, held, given = pretraining_sentences(data, blocks, stats)
    masker = make_masker(data, stats, data.ner_processes, ner=given is None)
    records, eval_records = [], []
    desc = f"examples: {masking_label(masker, given)} masking"
    found = masked_sentences(data, masker, texts, given, stats)
    with _progress(iterable=found, total=len(texts), desc=desc, unit="sent") as bar:
        for i, enc, spans in bar:
            if not spans:
                continue
            out = eval_records if held[i] else records
            source = (block_ids[i], doc_ids[i], titles[i], texts[i])
            out.append(example_record(len(out), *source, enc.ids, spans, data.query_len))
    stats["examples"] = len(records)
    stats["eval_examples"] = len(eval_records)
    stats["salient_spans"] = sum(len(r["span_starts"]) for r in records + eval_records)
    return records, eval_records, masker.mode
