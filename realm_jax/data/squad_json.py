"""SQuAD's own JSON format (train-v1.1.json, dev-v1.1.json, v2.0 too), read as a corpus and as
a question file, so that the SQuAD chain needs nothing but the official file (or its URL):

  {"version": ..., "data": [{"title": "University_of_Notre_Dame",
                             "paragraphs": [{"context": str,
                                             "qas": [{"id": str, "question": str,
                                                      "answers": [{"text": str, ...}],
                                                      "is_impossible": bool (v2.0)}]}]}]}

As a corpus: one passage per paragraph, title = the article's title with '_' as spaces, id =
"<article title>/<paragraph index>" (each article's paragraphs counted from 0). As questions:
each answerable question with its distinct answer texts, its article's title (so questions split
by held-out article as the corpus does) and gold_passage = its paragraph's corpus id. v2.0's
unanswerable questions are skipped (open-domain QA needs an answer) and counted in the log.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

from realm_jax import fs

log = logging.getLogger(__name__)

_HEAD = re.compile(rb'^\s*\{\s*"(version|data)"\s*:')


class SquadFormatError(ValueError):
    """A file that starts as SQuAD JSON but is not: the message names the file and the entry."""


def looks_like(path: str) -> bool:
    """Whether a .json file is SQuAD JSON (its object starts with "data" or "version"), from its
    first bytes: a JSON-lines corpus named .json starts with a document's fields instead."""
    if not str(path).endswith(".json"):
        return False
    try:
        with fs.open(path, "rb") as f:
            head = f.read(256).removeprefix(b"\xef\xbb\xbf")
    except OSError:
        return False
    return bool(_HEAD.match(head))


def load(path: str, data: bytes | None = None) -> list[dict]:
    """The file's articles ("data"), checked for SQuAD's shape."""
    raw = fs.read_bytes(path) if data is None else data
    try:
        obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SquadFormatError(f"{path}: not SQuAD JSON ({e})") from None
    articles = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(articles, list):
        raise SquadFormatError(f'{path}: not SQuAD JSON: expected {{"data": [articles]}}')
    for i, a in enumerate(articles):
        if not (
            isinstance(a, dict)
            and isinstance(a.get("title"), str)
            and isinstance(a.get("paragraphs"), list)
        ):
            raise SquadFormatError(f"{path}: data[{i}]: expected {{title, paragraphs}}")
    return articles


def title_of(article: dict) -> str:
    return article["title"].replace("_", " ")


def passages(path: str, data: bytes | None = None) -> Iterator[tuple[str, str, str, str]]:
    """(id, title, text, where) of every paragraph, in file order."""
    for i, article in enumerate(load(path, data)):
        for k, p in enumerate(article["paragraphs"]):
            where = f"{path}: data[{i}].paragraphs[{k}]"
            text = p.get("context") if isinstance(p, dict) else None
            yield f"{article['title']}/{k}", title_of(article), text, where


def questions(path: str, data: bytes | None = None) -> list[dict]:
    """{question, answers, title, id, gold_passage, where} of every answerable question."""
    out, skipped = [], 0
    for i, article in enumerate(load(path, data)):
        for k, p in enumerate(article["paragraphs"]):
            qas = p.get("qas", []) if isinstance(p, dict) else None
            if not isinstance(qas, list):
                raise SquadFormatError(f"{path}: data[{i}].paragraphs[{k}]: expected a qas list")
            for j, qa in enumerate(qas):
                where = f"{path}: data[{i}].paragraphs[{k}].qas[{j}]"
                if not isinstance(qa, dict) or not isinstance(qa.get("question"), str):
                    raise SquadFormatError(f"{where}: expected {{question, answers}}")
                answers = [a.get("text") for a in qa.get("answers") or [] if isinstance(a, dict)]
                answers = list(dict.fromkeys(a for a in answers if isinstance(a, str) and a))
                if qa.get("is_impossible") or not answers:
                    skipped += 1
                    continue
                out.append(
                    {
                        "question": qa["question"],
                        "answers": answers,
                        "title": title_of(article),
                        "id": str(qa.get("id", "")),
                        "gold_passage": f"{article['title']}/{k}",
                        "where": where,
                    }
                )
    if skipped:
        log.info("%s: %d questions without an answer skipped (SQuAD 2.0's)", path, skipped)
    return out
