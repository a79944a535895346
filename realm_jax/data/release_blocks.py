"""The release's block records (interop/block_records.py) as blocks of our corpus: block i =
record i, tokenised and cut as ORQA's encoder saw it, so the release's block_emb, row for row,
is an index of the prepared corpus (the interop module says how).

`release_chunk` (a chunk's blocks) and `count_documents` serve prepare's streaming path
(data/release_prepare.py); `release_blocks(data, stats)` holds all of them in memory (the
in-process path's reference, data/local_prepare.py, which the streamed path is tested against).
"""

from __future__ import annotations

import collections

from realm_jax import tokenization as tk
from realm_jax.data import corpus as corpus_lib
from realm_jax.data import masking
from realm_jax.interop import block_records

CHUNK = 512  # blocks tokenised per batch


def release_block(
    i: int, title: str, text: str, title_enc, text_enc, sents, block_len: int
) -> corpus_lib.Block:
    """Block i as ORQA's encoder saw it: [CLS] title [SEP] text [SEP], the title cut to
    block_len - 3 wordpieces and the text to what remains (bert_utils.pad_or_truncate_pair);
    `text` keeps the characters the kept wordpieces cover."""
    title_ids = list(title_enc.ids[: block_len - 3])
    n = min(len(text_enc.ids), block_len - 3 - len(title_ids))
    offsets = text_enc.offsets[:n]
    end = offsets[-1][1] if n < len(text_enc.ids) and n else (len(text) if n else 0)
    spans = [(a, min(b, end)) for a, b in sents if a < end]
    head = len(title_ids) + 2
    ranges = corpus_lib.sentence_token_ranges(offsets, spans) if n else []
    return corpus_lib.Block(
        block_id=i,
        doc_id=title or f"block-{i}",
        title=title,
        text=text[:end],
        token_ids=[tk.CLS_ID, *title_ids, tk.SEP_ID, *text_enc.ids[:n], tk.SEP_ID],
        body_start=head,
        sentences=spans,
        sentence_starts=[a + head for a, _ in ranges],
    )


def release_chunk(
    chunk: list[tuple[str, str]], first: int, block_len: int, stats: collections.Counter
) -> list[corpus_lib.Block]:
    """Blocks first, first + 1, ... from their (title, text) records, tokenised as one batch;
    counts truncated_blocks."""
    titles = tk.wordpieces([t for t, _ in chunk])
    texts = tk.wordpieces([x for _, x in chunk])
    sents = masking.split_sentences(x for _, x in chunk)
    out = []
    for (title, text), t, b, s in zip(chunk, titles, texts, sents, strict=True):
        block = release_block(first + len(out), title, text, t, b, s, block_len)
        kept = len(block.token_ids) - block.body_start - 1  # text wordpieces kept
        stats["truncated_blocks"] += kept < len(b.ids)
        out.append(block)
    return out


def count_documents(blocks: list[corpus_lib.Block], previous: str | None) -> tuple[int, str | None]:
    """Articles starting in `blocks` (a run of consecutive blocks with one title is one
    article: ORQA's blocks.tfr keeps an article's blocks together), and the last title."""
    n = 0
    for b in blocks:
        n += b.title != previous
        previous = b.title
    return n, previous


def release_blocks(data, stats: collections.Counter) -> list[corpus_lib.Block]:
    """Every block of the release corpus data.corpus in memory, block id i = record i (the
    reference for prepare's streaming path, data/release_prepare.py)."""
    blocks: list[corpus_lib.Block] = []
    pairs = block_records.read_release_blocks(data.corpus)
    last = None
    while chunk := [p for _, p in zip(range(CHUNK), pairs)]:
        new = release_chunk(chunk, len(blocks), data.block_len, stats)
        n, last = count_documents(new, last)
        stats["documents"] += n
        blocks.extend(new)
    stats["blocks"] = len(blocks)
    return blocks
