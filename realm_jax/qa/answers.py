"""Open-domain QA answers: ORQA's normalisation and scoring, and the question-file readers.

Scoring reproduces ORQA's released evaluation, google-research/language
language/orqa/utils/eval_utils.py:
  normalize_answer  NFD, lower case, drop every string.punctuation character, replace the
                    words a/an/the by a space, then collapse whitespace (in that order)
  exact_match       the normalised prediction equals the normalised gold answer
  regex_match       re.match (anchored at the start of the prediction only) with IGNORECASE,
                    UNICODE and MULTILINE; a pattern that does not compile never matches
  is_correct        the best of the metric over the gold answers (False when there are none,
                    where ORQA's max() over an empty list would raise)
Two host-side helpers for retrieval recall: regex_in_text (re.search, same flags) and
answer_in_text (the normalised answer as whole tokens of the normalised text).

Question files (`read_questions(path, fmt)`; local or gs://), all UTF-8; blank lines are skipped:
  nq            NQ-open JSONL, one object per line: {"question": str, "answer": [str, ...]}
  squad         SQuAD-style JSONL: {"question": str, "answers": [str, ...], "title": str,
                "id": str, "gold_passage": str, ...}; title, id and gold_passage (the corpus
                "id" of the passage the question was written from) optional, other keys
                ignored
  webquestions  one JSON list of {"qId": str, "qText": str, "answers": [str, ...]}
  curatedtrec   TSV lines: id <TAB> type <TAB> question <TAB> answer regex; the line is cut
                at its first three tabs, so a tab inside the regex stays in it (one line of
                large2180-train.tsv has one); scored with regex_match
  squad_json    SQuAD's own JSON (train-v1.1.json, dev-v1.1.json, v2.0): every answerable
                question with its answer texts, article title and gold passage
                (data/squad_json.py; the corpus read from the same file has those ids)
  auto          by extension: .tsv curatedtrec, .json squad_json when the object starts with
                "data" or "version", else webquestions, .jsonl nq if the first non-blank line
                has "answer", squad if it has "answers"
An https:// file is downloaded once into the cache (data/download.py).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import re
import string
import unicodedata
from collections.abc import Iterable, Iterator

from realm_jax import fs

log = logging.getLogger(__name__)

FORMATS = ("nq", "squad", "squad_json", "webquestions", "curatedtrec")
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_REGEX_FLAGS = re.IGNORECASE | re.UNICODE | re.MULTILINE
_ACCEPTED = (
    "accepted formats: nq (NQ-open .jsonl with 'question' and 'answer'), squad (.jsonl with "
    "'question' and 'answers'), webquestions (.json list of qId/qText/answers), curatedtrec "
    "(.tsv: id, type, question, regex), squad_json (SQuAD's own train-v1.1.json)"
)


class QAFormatError(ValueError):
    """A question file that cannot be read. The message starts with "<path>:<line>:" (or
    "<path>: entry <i>:" for an entry of a JSON list, i counted from 0; "<path>:" alone when
    only the file name is at fault), then says what is wrong and what was expected."""


@dataclasses.dataclass(frozen=True)
class QAExample:
    question: str
    answers: tuple[str, ...]
    is_regex: bool = False
    title: str = ""  # SQuAD-style files: the article title (else "")
    qid: str = ""  # the file's id if it has one, else "<file name>:<line>"
    source: str = ""  # "<path>:<line>" (webquestions: "<path>: entry <i>")
    # SQuAD-style files: the corpus "id" of the passage the question was written from (its
    # prepared blocks keep it as doc_id; qa/data.py gold_blocks), else ""
    gold_passage: str = ""


# ---------------------------------------------------------------------------------------------
# Scoring (ORQA eval_utils)


def normalize_answer(s: str) -> str:
    """ORQA's normalize_answer: NFD, lower, no punctuation, no articles, single spaces."""
    s = unicodedata.normalize("NFD", s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern, flags=_REGEX_FLAGS)
    except re.error:
        return None


def regex_match(prediction: str, pattern: str) -> bool:
    """ORQA's regex_match_score: the pattern matches at the start of the prediction."""
    compiled = _compile(pattern)
    return compiled is not None and compiled.match(prediction) is not None


def regex_in_text(pattern: str, text: str) -> bool:
    """Whether the pattern occurs anywhere in the text (re.search, ORQA's flags)."""
    compiled = _compile(pattern)
    return compiled is not None and compiled.search(text) is not None


def answer_in_text(answer: str, text: str) -> bool:
    """Whether the normalised answer occurs as whole tokens in the normalised text."""
    norm = normalize_answer(answer)
    return bool(norm) and f" {norm} " in f" {normalize_answer(text)} "


def is_correct(answers: Iterable[str], prediction: str, is_regex: bool) -> bool:
    """ORQA's is_correct: regex_match (is_regex) or exact_match, best over the answers."""
    metric = regex_match if is_regex else exact_match
    return any(metric(prediction, gold) for gold in answers)


# ---------------------------------------------------------------------------------------------
# Readers


def _kind(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number" if isinstance(value, int | float) else "a value")


def _lines(path: str, data: bytes) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line, without its line ending."""
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise QAFormatError(
                f"{path}:{n}: invalid UTF-8 at byte {e.start + 1} of the line; expected UTF-8 text"
            ) from None
        if n == 1:
            line = line.removeprefix("\ufeff")
        if line.strip():
            yield n, line.rstrip("\r")


def _json_object(line: str, where: str):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise QAFormatError(
            f"{where}: invalid JSON ({e.msg}, column {e.colno}); expected one JSON object per line"
        ) from None
    if not isinstance(obj, dict):
        raise QAFormatError(f"{where}: {_kind(obj)}; expected one JSON object per line")
    return obj


def _question(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise QAFormatError(f"{where}: no {key!r} field; expected the question as a string")
    value = obj[key]
    if not isinstance(value, str):
        raise QAFormatError(f"{where}: {key!r} is {_kind(value)}; expected a string")
    if not value.strip():
        raise QAFormatError(f"{where}: {key!r} is empty; expected the question text")
    return value


def _answers(obj: dict, key: str, where: str) -> tuple[str, ...]:
    if key not in obj:
        raise QAFormatError(f"{where}: no {key!r} field; expected a list of answer strings")
    value = obj[key]
    if not isinstance(value, list):
        raise QAFormatError(
            f"{where}: {key!r} is {_kind(value)}; expected a list of answer strings"
        )
    if not value:
        raise QAFormatError(f"{where}: {key!r} is an empty list; expected at least one answer")
    for i, answer in enumerate(value):
        if not isinstance(answer, str):
            raise QAFormatError(
                f"{where}: {key}[{i}] is {_kind(answer)}; expected a non-empty string"
            )
        if not answer.strip():
            raise QAFormatError(f"{where}: {key}[{i}] is empty; expected a non-empty string")
    return tuple(value)


def _optional(obj: dict, key: str, where: str, default: str, ints: bool = False) -> str:
    value = obj.get(key, default)
    if isinstance(value, str) or (ints and isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    raise QAFormatError(f"{where}: {key!r} is {_kind(value)}; expected a string")


def _read_jsonl(path: str, data: bytes, fmt: str) -> list[QAExample]:
    key = "answer" if fmt == "nq" else "answers"
    name = os.path.basename(path)
    examples = []
    for n, line in _lines(path, data):
        where = f"{path}:{n}"
        obj = _json_object(line, where)
        examples.append(
            QAExample(
                question=_question(obj, "question", where),
                answers=_answers(obj, key, where),
                title=_optional(obj, "title", where, ""),
                qid=_optional(obj, "id", where, f"{name}:{n}", ints=True),
                source=where,
                gold_passage=_optional(obj, "gold_passage", where, "", ints=True),
            )
        )
    return examples


def _read_squad_json(path: str, data: bytes) -> list[QAExample]:
    from realm_jax.data import squad_json

    try:
        rows = squad_json.questions(path, data)
    except squad_json.SquadFormatError as e:
        raise QAFormatError(str(e)) from None
    return [
        QAExample(
            question=r["question"],
            answers=tuple(r["answers"]),
            title=r["title"],
            qid=r["id"] or r["where"],
            source=r["where"],
            gold_passage=r["gold_passage"],
        )
        for r in rows
    ]


def _read_webquestions(path: str, data: bytes) -> list[QAExample]:
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise QAFormatError(f"{path}:{line}: invalid UTF-8; expected UTF-8 text") from None
    if not text.strip():
        return []
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise QAFormatError(
            f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); expected one JSON "
            "list of {qId, qText, answers} objects"
        ) from None
    if not isinstance(entries, list):
        line = text[: len(text) - len(text.lstrip())].count("\n") + 1
        raise QAFormatError(
            f"{path}:{line}: the file holds {_kind(entries)}; expected a JSON list of "
            "{qId, qText, answers} objects"
        )
    name = os.path.basename(path)
    examples = []
    for i, obj in enumerate(entries):
        where = f"{path}: entry {i}"
        if not isinstance(obj, dict):
            raise QAFormatError(f"{where}: {_kind(obj)}; expected a {{qId, qText, answers}} object")
        examples.append(
            QAExample(
                question=_question(obj, "qText", where),
                answers=_answers(obj, "answers", where),
                qid=_optional(obj, "qId", where, f"{name}: entry {i}", ints=True),
                source=where,
            )
        )
    return examples


def _read_curatedtrec(path: str, data: bytes) -> list[QAExample]:
    name = os.path.basename(path)
    examples, bad = [], []
    for n, line in _lines(path, data):
        where = f"{path}:{n}"
        columns = line.split("\t", 3)
        if len(columns) != 4:
            raise QAFormatError(
                f"{where}: {len(columns)} tab-separated column(s); expected 4: id, type, "
                "question, answer regex"
            )
        qid, _, question, pattern = columns
        if not question.strip():
            raise QAFormatError(f"{where}: the question (column 3) is empty")
        if not pattern.strip():
            raise QAFormatError(f"{where}: the answer regex (column 4) is empty")
        if _compile(pattern) is None:
            bad.append(n)
        examples.append(
            QAExample(question, (pattern,), True, qid=qid or f"{name}:{n}", source=where)
        )
    if bad:
        log.warning(
            "%s: %d answer regex(es) do not compile (lines %s); they never match, as in ORQA",
            path,
            len(bad),
            ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else ""),
        )
    return examples


def _detect(path: str, data: bytes) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".tsv":
        return "curatedtrec"
    if ext == ".json":
        from realm_jax.data import squad_json

        return "squad_json" if squad_json.looks_like(path) else "webquestions"
    if ext != ".jsonl":
        raise QAFormatError(
            f"{path}: cannot tell the question format from the extension {ext or '(none)'!r}; "
            f"auto reads .tsv, .json and .jsonl, else pass the format; {_ACCEPTED}"
        )
    for n, line in _lines(path, data):
        obj = _json_object(line, f"{path}:{n}")
        if "answer" in obj:
            return "nq"
        if "answers" in obj:
            return "squad"
        raise QAFormatError(
            f"{path}:{n}: neither an 'answer' nor an 'answers' field, so the format is "
            f"unknown; {_ACCEPTED}"
        )
    return "nq"  # no non-blank line: read_questions reports the empty file


_READERS = {
    "nq": lambda path, data: _read_jsonl(path, data, "nq"),
    "squad": lambda path, data: _read_jsonl(path, data, "squad"),
    "squad_json": _read_squad_json,
    "webquestions": _read_webquestions,
    "curatedtrec": _read_curatedtrec,
}


def read_questions(path: str, fmt: str = "auto") -> list[QAExample]:
    """Every question of the file, in file order (formats: the module docstring)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown question format {fmt!r}; expected auto or one of {FORMATS}")
    from realm_jax.data import download

    path = download.local(os.fspath(path))  # an https:// file: its cached copy
    try:
        data = fs.read_bytes(path)  # a local path or a gs:// URL
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "question file not found", path) from None
    if fmt == "auto":
        fmt = _detect(path, data)
    examples = _READERS[fmt](path, data)
    if not examples:
        raise QAFormatError(
            f"{path}:1: no questions in the file; expected at least one {fmt} question"
        )
    return examples


def score_predictions(references: list[QAExample], predictions: dict[str, str]) -> dict:
    """ORQA's evaluate_predictions_impl: each reference question scored against the
    prediction given for the same question text (a missing one counts as wrong and is
    counted); accuracy over every reference."""
    correct = missing = 0
    for ex in references:
        if ex.question not in predictions:
            missing += 1
            continue
        correct += int(is_correct(ex.answers, predictions[ex.question], ex.is_regex))
    total = len(references)
    return {
        "missing_predictions": missing,
        "num_correct": correct,
        "num_total": total,
        "accuracy": correct / total if total else 0.0,
    }


def read_predictions(path: str) -> dict[str, str]:
    """A predictions JSONL ({"question", "prediction"} per line: ORQA's format, and the
    `.predictions.jsonl` that `evaluate` writes) -> {question: prediction}."""
    if not fs.isfile(path):
        raise FileNotFoundError(f"predictions file not found: {path}")
    out = {}
    data = fs.read_bytes(path)
    for n, line in _lines(path, data):
        obj = _json_object(line, f"{path}:{n}")
        q, p = obj.get("question"), obj.get("prediction")
        if not isinstance(q, str) or not isinstance(p, str):
            raise QAFormatError(f"{path}:{n}: needs string fields 'question' and 'prediction'")
        out[q] = p
    return out
