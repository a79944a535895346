"""Read raw documents and cut them into retrieval blocks.

Accepted inputs (`read_documents(path)`):
  *.jsonl / *.json   one JSON object per line: {"title": str, "text": str, "id": str (optional)}
                     (a missing id becomes "<file stem>:<line>").
  SQuAD's *.json     train-v1.1.json and its kin (an object with "data"): one passage per
                     paragraph, titled by its article (data/squad_json.py).
  *.tsv              id<TAB>title<TAB>text, or title<TAB>text (two columns: id = "<stem>:<line>").
                     A first line "id<TAB>title<TAB>text" (or "title<TAB>text") is a header.
  *.txt              a .txt file whose first non-blank line holds a tab is read as .tsv lines;
                     any other .txt is plain text as BERT's pre-training data is written: one
                     sentence a line, a blank line between documents. A document's id and title
                     are "<stem>:<line of its first sentence>" (plain text has no titles), its
                     text its lines joined by newlines, and each line is one sentence
                     (`is_plain_text`; `split_sentences(..., by_line=True)`).
  a folder           every *.txt file in it (sorted, recursively): title = file stem,
                     text = contents, id = path relative to the folder.
  *.jsonl.gz, *.json.gz, *.tsv.gz, *.txt.gz
                     the same line files gzip-compressed (read as a stream, never unpacked
                     to disk; concatenated gzip members too). Their default ids use the stem
                     without ".gz" ("corpus.jsonl.gz" line 3: "corpus:3"), so a .gz file gives
                     the records of its uncompressed twin.
Every input may be a gs:// path (read through realm_jax.fs); `prepare` downloads an https://
input first (data/download.py).

Bad input (invalid UTF-8, malformed JSON, empty/missing fields, no usable text, duplicate ids,
unreadable files, a truncated or corrupt .gz: at the line where its data stops) raises
`CorpusError("<file>:<line>: ...")`; with skip_bad_input=True
(`--config.data.skip_bad_input=true`) the document is skipped and counted under
`stats["skipped_<kind>"]`.

Blocks are `[CLS] title [SEP] body [SEP]` of at most block_len wordpieces; bodies are packed
greedily sentence by sentence; a sentence longer than a block is split by wordpieces.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import gzip
import io
import itertools
import json
import os
import zlib
from collections.abc import Iterator

from realm_jax import fs
from realm_jax import tokenization as tk
from realm_jax.corpus_errors import SKIP_HINT, CorpusError

BAD_KINDS = ("bad_utf8", "bad_json", "missing_field", "empty_text", "duplicate_id", "unreadable")


class UnreadableData(OSError):
    """A file whose data stops part way: a truncated or corrupt .gz, a read error."""


LINE_FORMATS = (".jsonl", ".json", ".tsv", ".txt")  # line files (and their .gz)


def is_gzip(path: str) -> bool:
    return str(path).endswith(".gz")


def format_name(path: str) -> str:
    """The name a file's format is read from: without a trailing ".gz"."""
    return str(path)[:-3] if is_gzip(path) else str(path)


def stem(path: str) -> str:
    """The file stem of default document ids ("<stem>:<line>"): corpus.jsonl(.gz) -> corpus."""
    return os.path.splitext(fs.basename(format_name(path)))[0]


def is_plain_text(path: str) -> bool:
    """A .txt (or .txt.gz) file of plain text: its first non-blank line holds no tab (a line
    with a tab makes it title<TAB>text lines, as before plain text was read). A folder, another
    format or an unreadable file is not."""
    if not format_name(path).endswith(".txt") or fs.isdir(path):
        return False
    try:
        with fs.open(path, "rb") as f:
            for raw in raw_lines(f, path):
                if raw.strip():
                    return b"\t" not in raw
    except OSError:  # UnreadableData too: read_documents reports it where it stops
        return False
    return True  # an empty file: no documents either way


def raw_lines(f, path: str) -> Iterator[bytes]:
    """The raw lines (newline kept) of an open binary file, decompressed when `path` ends in
    .gz. Data that stops part way (a truncated or corrupt .gz, a read error) raises
    UnreadableData with a one-line reason after the last whole line; both engines read
    through this, so they stop at the same line."""
    src = gzip.GzipFile(fileobj=f, mode="rb") if is_gzip(path) else f
    it = iter(src)
    while True:
        try:
            raw = next(it)
        except StopIteration:
            return
        except (EOFError, OSError, zlib.error) as e:
            what = "truncated or corrupt gzip data" if is_gzip(path) else "read error"
            reason = " ".join(str(e).split()) or type(e).__name__
            raise UnreadableData(f"{what} ({reason})") from e
        yield raw


@dataclasses.dataclass
class Block:
    """One retrieval block; token_ids = [CLS] title [SEP] body [SEP] (unpadded)."""

    block_id: int
    doc_id: str
    title: str
    text: str  # the body text covered by the block
    token_ids: list[int]
    body_start: int  # index of the first body wordpiece in token_ids
    sentences: list[tuple[int, int]]  # char spans within `text` of the block's sentences
    sentence_starts: list[int] = dataclasses.field(default_factory=list)  # in token_ids


class DocumentChecker:
    """Shared bad-input handling: raise, or count and skip."""

    def __init__(self, skip_bad_input: bool, stats: collections.Counter):
        self.skip = skip_bad_input
        self.stats = stats
        self.seen: set[str] = set()

    def bad(self, kind: str, where: str, msg: str) -> None:
        if not self.skip:
            raise CorpusError(f"{where}: {msg} ({SKIP_HINT})")
        self.stats[f"skipped_{kind}"] += 1

    def check(self, where: str, doc_id: str, title, text) -> tuple[str, str, str] | None:
        """Validate one document; returns (id, title, text) or None when skipped."""
        if not isinstance(title, str) or not isinstance(text, str):
            return self.bad("missing_field", where, "missing or non-string 'title'/'text'")
        if not title.strip():
            return self.bad("missing_field", where, "empty title")
        if not text.strip() or not any(c.isalnum() for c in text):
            return self.bad("empty_text", where, "document has no usable text")
        if doc_id in self.seen:
            return self.bad("duplicate_id", where, f"duplicate document id {doc_id!r}")
        self.seen.add(doc_id)
        self.stats["documents"] += 1
        return doc_id, title.strip(), text.strip()


def _lines(path: str, r: DocumentChecker, keep_blank: bool = False) -> Iterator[tuple[int, str]]:
    """(line number, decoded line) of a file; bad UTF-8 lines are reported per line; blank
    lines are left out unless keep_blank (plain text: they split documents)."""
    try:
        f = fs.open(path, "rb")  # local or gs://
    except OSError as e:
        r.bad("unreadable", path, f"cannot read file: {e}")
        return
    n = 0
    with f:
        try:
            for n, raw in enumerate(raw_lines(f, path), 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    where = f"{path}:{n}"
                    r.bad("bad_utf8", where, f"invalid UTF-8 ({e.reason} at byte {e.start})")
                    continue
                if keep_blank or line.strip():
                    yield n, line.rstrip("\r\n")
        except UnreadableData as e:  # the data stops inside line n + 1: the rest is lost
            r.bad("unreadable", f"{path}:{n + 1}", str(e))


def _read_plain_text(path: str, r: DocumentChecker) -> Iterator[tuple[str, str, str]]:
    """Documents of a plain .txt: runs of non-blank lines, one sentence a line."""
    id_stem = stem(path)
    first, lines = 0, []
    end = [(0, "")]  # a blank line after the last one ends the last document
    for n, line in itertools.chain(_lines(path, r, keep_blank=True), end):
        if line.strip():
            first = first or n
            lines.append(line.strip())
        elif lines:
            doc_id, text = f"{id_stem}:{first}", "\n".join(lines)
            doc = r.check(f"{path}:{first}", doc_id, doc_id, text)
            if doc:
                yield doc
            first, lines = 0, []


def _read_jsonl(path: str, r: DocumentChecker) -> Iterator[tuple[str, str, str]]:
    id_stem = stem(path)
    for n, line in _lines(path, r):
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            r.bad("bad_json", where, f"malformed JSON ({e.msg})")
            continue
        if not isinstance(obj, dict):
            r.bad("bad_json", where, "a line must be a JSON object")
            continue
        doc_id = str(obj["id"]) if obj.get("id") not in (None, "") else f"{id_stem}:{n}"
        doc = r.check(where, doc_id, obj.get("title"), obj.get("text"))
        if doc:
            yield doc


def _read_tsv(path: str, r: DocumentChecker) -> Iterator[tuple[str, str, str]]:
    id_stem = stem(path)
    for n, line in _lines(path, r):
        where = f"{path}:{n}"
        (cols,) = list(csv.reader(io.StringIO(line), delimiter="\t", quoting=csv.QUOTE_NONE))
        if n == 1 and [c.lower() for c in cols] in (["id", "title", "text"], ["title", "text"]):
            continue
        if len(cols) == 3:
            doc_id, title, text = cols
        elif len(cols) == 2:
            (title, text), doc_id = cols, f"{id_stem}:{n}"
        else:
            r.bad("missing_field", where, f"expected 2 or 3 tab-separated columns, got {len(cols)}")
            continue
        doc = r.check(where, doc_id or f"{id_stem}:{n}", title, text)
        if doc:
            yield doc


def _read_squad(path: str, r: DocumentChecker) -> Iterator[tuple[str, str, str]]:
    from realm_jax.data import squad_json

    try:
        for doc_id, title, text, where in squad_json.passages(path):
            doc = r.check(where, doc_id, title, text)
            if doc:
                yield doc
    except squad_json.SquadFormatError as e:
        raise CorpusError(str(e)) from None


def _read_folder(path: str, r: DocumentChecker) -> Iterator[tuple[str, str, str]]:
    for rel in _txt_files(path):
        file = fs.join(path, *rel.split("/"))
        try:
            with fs.open(file, "rb") as f:
                raw = f.read()
        except OSError as e:
            r.bad("unreadable", file, f"cannot read file: {e}")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            r.bad("bad_utf8", f"{file}:{line}", f"invalid UTF-8 ({e.reason})")
            continue
        doc = r.check(f"{file}:1", rel, os.path.splitext(fs.basename(file))[0], text)
        if doc:
            yield doc


def read_documents(
    path: str, *, skip_bad_input: bool = False, stats: collections.Counter | None = None
) -> Iterator[tuple[str, str, str]]:
    """Yield (doc_id, title, text) from a .jsonl/.tsv/.txt file (or its .gz) or a folder of
    .txt files."""
    stats = stats if stats is not None else collections.Counter()
    r = DocumentChecker(skip_bad_input, stats)
    if fs.isdir(path):
        yield from _read_folder(path, r)
    elif not fs.exists(path):
        raise CorpusError(f"{path}: no such file or folder")
    elif is_squad(path):
        yield from _read_squad(path, r)
    elif format_name(path).endswith((".jsonl", ".json")):
        yield from _read_jsonl(path, r)
    elif is_plain_text(path):
        yield from _read_plain_text(path, r)
    elif format_name(path).endswith((".tsv", ".txt")):
        yield from _read_tsv(path, r)
    else:
        # (acceptance/bad_input.py checks this wording; .jsonl.gz/.tsv.gz are read too)
        raise CorpusError(f"{path}: unknown corpus format (use .jsonl, .tsv or a folder of .txt)")


def is_squad(path: str) -> bool:
    """SQuAD's own JSON (data/squad_json.py), not a JSON-lines corpus."""
    from realm_jax.data import squad_json

    return squad_json.looks_like(path)


def input_files(path: str) -> list[str]:
    """The files whose contents define the corpus (for fingerprints)."""
    if fs.isdir(path):
        return [fs.join(path, *rel.split("/")) for rel in _txt_files(path)]
    return [path]


def _txt_files(folder: str) -> list[str]:
    """The .txt files under a local or gs:// folder, relative ('/'-separated), sorted."""
    return [rel for rel in fs.walk_files(folder) if rel.endswith(".txt")]


# ------------------------------------------------------------------------------------- blocking
def _pieces(sent_tok: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """Greedy packing of sentence wordpiece ranges [a, b) into pieces of <= budget wordpieces."""
    out: list[tuple[int, int]] = []
    cur: tuple[int, int] | None = None
    for a, b in sent_tok:
        if b - a > budget:  # an over-long sentence: flush, then split by wordpieces
            if cur:
                out.append(cur)
                cur = None
            out.extend((s, min(s + budget, b)) for s in range(a, b, budget))
        elif cur and b - cur[0] <= budget:
            cur = (cur[0], b)
        else:
            if cur:
                out.append(cur)
            cur = (a, b)
    if cur:
        out.append(cur)
    return out


def sentence_token_ranges(offsets, sent_chars: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Wordpiece index ranges [a, b) of each sentence (by the wordpiece's start offset)."""
    ranges, i, n = [], 0, len(offsets)
    for k, (_, ce) in enumerate(sent_chars):
        a = i
        last = k == len(sent_chars) - 1
        while i < n and (last or offsets[i][0] < ce):
            i += 1
        if i > a:
            ranges.append((a, i))
    return ranges


def split_blocks(
    doc_id: str,
    title: str,
    body: str,
    title_ids,
    body_enc,
    sent_chars,
    block_len: int,
    first_id: int,
) -> list[Block]:
    """Cut one document into blocks; sent_chars are the body's sentence char spans."""
    title_ids = list(title_ids[: block_len // 2])  # a long title keeps half the block for body
    head = [tk.CLS_ID, *title_ids, tk.SEP_ID]
    budget = block_len - len(head) - 1
    ids, offs = body_enc.ids, body_enc.offsets
    ranges = sentence_token_ranges(offs, sent_chars)
    blocks = []
    for a, b in _pieces(ranges, budget):
        c0, c1 = offs[a][0], offs[b - 1][1]
        spans = [
            (max(offs[s][0], c0) - c0, min(offs[e - 1][1], c1) - c0)
            for s, e in ranges
            if s < b and e > a
        ]
        starts = [max(s, a) - a + len(head) for s, e in ranges if s < b and e > a]
        blocks.append(
            Block(
                first_id + len(blocks),
                doc_id,
                title,
                body[c0:c1],
                head + list(ids[a:b]) + [tk.SEP_ID],
                len(head),
                spans,
                starts,
            )
        )
    return blocks


def count_lines(path: str, limit: int | None = None) -> int | None:
    """Lines of a local line file (a .gz decompressed), files of a folder; None when it
    cannot be read. With `limit`, counting stops there (engine choice needs no more)."""
    if os.path.isdir(path):
        return len(input_files(path))
    n = 0
    try:
        with open(path, "rb") as f:
            for n, _ in enumerate(raw_lines(f, path), 1):
                if limit is not None and n >= limit:
                    break
    except UnreadableData:
        return n  # a truncated .gz: reading it says where (read_documents)
    except OSError:
        return None
    return n
