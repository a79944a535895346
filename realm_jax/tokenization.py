"""WordPiece tokenisation (HF `tokenizers`) and REALM's input formats.

Formats (token ids, with segment ids in brackets):
  query  [CLS] x [SEP]                          (all segment 0)
  block  [CLS] title [SEP] body [SEP]           (title segment 0, body segment 1)
  joint  [CLS] x [SEP] title [SEP] body [SEP]   (query segment 0, the block segment 1)
"""

from __future__ import annotations

import functools
import os

import numpy as np
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer

VOCAB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "vocab.txt")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 100, 101, 102, 103


@functools.lru_cache(maxsize=4)
def load_tokenizer(vocab_path: str = VOCAB_PATH) -> Tokenizer:
    """A lower-casing BERT WordPiece tokenizer (bert-base-uncased compatible)."""
    if not os.path.isfile(vocab_path):
        raise FileNotFoundError(f"WordPiece vocab not found: {vocab_path}")
    tok = BertWordPieceTokenizer(vocab_path, lowercase=True, strip_accents=None)
    for name, want in (
        ("[PAD]", PAD_ID),
        ("[CLS]", CLS_ID),
        ("[SEP]", SEP_ID),
        ("[MASK]", MASK_ID),
    ):
        got = tok.token_to_id(name)
        if got != want:
            raise ValueError(
                f"{vocab_path}: {name} has id {got}, expected {want} (bert-base vocab)"
            )
    return tok._tokenizer  # the plain Tokenizer: picklable, fast batch encode


@functools.lru_cache(maxsize=4)
def vocab_size(vocab_path: str = VOCAB_PATH) -> int:
    """How many wordpieces the vocabulary holds (its lines): every token id it gives is below."""
    with open(vocab_path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def wordpieces(texts: list[str], tok: Tokenizer | None = None):
    """Encode texts without special tokens; returns tokenizers Encodings (ids + char offsets)."""
    tok = tok or load_tokenizer()
    return tok.encode_batch(list(texts), add_special_tokens=False)


def query_ids(x: list[int], max_len: int) -> list[int]:
    """[CLS] x [SEP], x truncated so the whole fits max_len."""
    return [CLS_ID] + list(x[: max_len - 2]) + [SEP_ID]


def block_ids(title: list[int], body: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """[CLS] title [SEP] body [SEP] truncated to max_len; returns (ids, segment_ids)."""
    title = list(title[: max(0, max_len - 4)])
    head = [CLS_ID] + title + [SEP_ID]
    body = list(body[: max_len - len(head) - 1])
    ids = head + body + [SEP_ID]
    return ids, [0] * len(head) + [1] * (len(body) + 1)


def joint_ids(x: list[int], title: list[int], body: list[int], max_len: int):
    """[CLS] x [SEP] title [SEP] body [SEP] truncated to max_len; returns (ids, segment_ids)."""
    q = [CLS_ID] + list(x) + [SEP_ID]
    rest = list(title) + [SEP_ID] + list(body)
    rest = rest[: max(0, max_len - len(q) - 1)] + [SEP_ID]
    ids = (q + rest)[:max_len]
    return ids, ([0] * len(q) + [1] * len(rest))[:max_len]


def pad_to(ids, length: int, value: int = 0) -> np.ndarray:
    """Right-pad (or truncate) a list of ints to `length` as int32."""
    out = np.full((length,), value, np.int32)
    n = min(len(ids), length)
    out[:n] = np.asarray(ids[:n], np.int32)
    return out


def encode_query(text: str, max_len: int, tok: Tokenizer | None = None) -> np.ndarray:
    """Text -> padded [max_len] ids of [CLS] x [SEP]."""
    (enc,) = wordpieces([text], tok)
    return pad_to(query_ids(enc.ids, max_len), max_len)


def encode_block(title: str, body: str, max_len: int, tok: Tokenizer | None = None):
    """Title, body -> padded ([max_len] ids, [max_len] segment ids) of a block."""
    t, b = wordpieces([title, body], tok)
    ids, seg = block_ids(t.ids, b.ids, max_len)
    return pad_to(ids, max_len), pad_to(seg, max_len)


def decode(ids, tok: Tokenizer | None = None) -> str:
    """Ids -> text, dropping padding and special tokens."""
    tok = tok or load_tokenizer()
    return tok.decode([int(i) for i in ids if int(i) != PAD_ID])
