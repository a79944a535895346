"""Make data/sample/ from the SQuAD-derived corpus: every passage of a few articles + their QA.

    python -m realm_jax.data.make_sample SRC_DIR OUT_DIR [--articles 7] [--max-passages 450]

SRC_DIR holds corpus_train.jsonl ({"id", "title", "text"} per passage) and qa_train.jsonl
({"question", "answers", "gold_passage", "title"}). Articles are taken evenly spaced over the
corpus (deterministic), skipping any that would push the total past --max-passages.
"""

from __future__ import annotations

import argparse
import collections
import json
import os


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def choose_articles(passages: list[dict], n: int, max_passages: int) -> list[str]:
    """Titles of about n articles evenly spaced over the corpus, within max_passages in all."""
    sizes = collections.Counter(p["title"] for p in passages)
    titles = list(dict.fromkeys(p["title"] for p in passages))  # corpus order
    step = max(1, len(titles) // n)
    chosen, total = [], 0
    for i in range(0, len(titles), step):
        t = titles[i]
        if total + sizes[t] <= max_passages:
            chosen.append(t)
            total += sizes[t]
        if len(chosen) == n:
            break
    return chosen


def make_sample(src_dir: str, out_dir: str, articles: int = 7, max_passages: int = 450) -> dict:
    """Write corpus.jsonl and qa.jsonl of the chosen articles to out_dir; returns counts."""
    passages = _read_jsonl(os.path.join(src_dir, "corpus_train.jsonl"))
    titles = set(choose_articles(passages, articles, max_passages))
    keep = [p for p in passages if p["title"] in titles]
    ids = {p["id"] for p in keep}
    qa = [
        q for q in _read_jsonl(os.path.join(src_dir, "qa_train.jsonl")) if q["gold_passage"] in ids
    ]
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in (("corpus.jsonl", keep), ("qa.jsonl", qa)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    counts = {"articles": sorted(titles), "passages": len(keep), "questions": len(qa)}
    print(json.dumps(counts, indent=2))
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src_dir")
    p.add_argument("out_dir")
    p.add_argument("--articles", type=int, default=7)
    p.add_argument("--max-passages", type=int, default=450)
    a = p.parse_args(argv)
    make_sample(a.src_dir, a.out_dir, a.articles, a.max_passages)


if __name__ == "__main__":
    main()
