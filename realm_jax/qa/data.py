"""Open-domain QA data: question files split by held-out article, encoded to fixed arrays, and
the shuffled, resumable training batches.

Arrays: question_ids [N, query_len] (`[CLS] question [SEP]`, zero-padded); answer_ids
[N, qa.max_answers, qa.answer_len] (each answer's wordpieces, zero-padded; answers longer
than qa.answer_len, or past max_answers, are left out of the token table: they can still be
scored by exact match on the host, never found on device); training also carries
gold_block [N] (gold_blocks: the answer-holding block of the question's gold passage, -1 when
none; read by qa.gold_in_beam).
"""

from __future__ import annotations

import dataclasses
import logging

import grain
import numpy as np

from realm_jax import tokenization as tk
from realm_jax.data import datasets, pipeline
from realm_jax.qa.answers import QAExample, read_questions

log = logging.getLogger("realm_jax.qa")

HOLDOUTS = ("none", "train", "heldout")


def held_out_titles(data_dir: str):
    """A predicate: whether a title is one of the prepared data's held-out articles (the same
    hash split `prepare` used, read from its summary)."""
    built = datasets.load_summary(data_dir)["config"]
    fraction, seed = float(built["eval_fraction"]), int(built["seed"])
    return lambda title: datasets.is_eval(title, fraction, seed)


def load_questions(path: str, fmt: str, holdout: str, data_dir: str) -> list[QAExample]:
    """A question file, optionally split by article: holdout "train" keeps the questions
    about articles that `prepare` did not hold out, "heldout" those about held-out articles
    (so fine-tuning never sees a dev article), "none" keeps all."""
    if holdout not in HOLDOUTS:
        raise ValueError(f"qa holdout must be one of {HOLDOUTS}, got {holdout!r}")
    if not path:
        field = "qa.train_file" if holdout == "train" else "qa.dev_file"
        field = field if holdout != "none" else "qa.train_file / qa.dev_file"
        raise ValueError(
            f"{field} is empty: name your question file, e.g. --config.qa.train_file="
            "my_questions.jsonl --config.qa.dev_file=my_questions.jsonl (configs/orqa.py:own and "
            ":base have no default questions)"
        )
    examples = read_questions(path, fmt)
    if holdout == "none":
        return examples
    key = "qa.train_holdout" if holdout == "train" else "qa.dev_holdout"
    untitled = [e.source for e in examples if not e.title]
    if untitled and len(untitled) == len(examples):  # NQ-open and the like: no article
        log.warning(
            "%s: its %d questions name no article (no 'title': NQ-open style), so %s=%s "
            "cannot split them by held-out article: every question is used%s",
            path,
            len(examples),
            key,
            holdout,
            " (the dev figures are on training questions where qa.train_file is this file "
            "too; give a separate qa.dev_file to measure held-out questions)"
            if holdout == "heldout"
            else "",
        )
        return examples
    if untitled:
        raise ValueError(
            f"{untitled[0]}: no title, so the question cannot be split by article ({key}="
            f"{holdout}) while others of {path} have one: give every question a 'title', or "
            "use them all with --config.qa.train_holdout=none --config.qa.dev_holdout=none"
        )
    is_held = held_out_titles(data_dir)
    want = holdout == "heldout"
    kept = [e for e in examples if is_held(e.title) == want]
    if not kept:
        built = datasets.load_summary(data_dir)["config"]
        which = "a held-out" if want else "a training (not held-out)"
        raise ValueError(
            f"{path}: none of its {len(examples)} questions is about {which} article of "
            f"{data_dir} (prepared with data.eval_fraction={built['eval_fraction']}), so "
            f"{key}={holdout} leaves none: use them all with --config.{key}=none, or "
            "re-prepare with a data.eval_fraction that holds out their articles"
        )
    return kept


def holds_answer(row: np.ndarray, answers: np.ndarray) -> bool:
    """Host twin of step.contains_answer for one block: row [Lb] (token ids, zero-padded),
    answers [A, La] (one question's answer table from `encode`) -> whether some answer's
    wordpieces occur consecutively in the row."""
    row = np.asarray(row)
    for a in np.asarray(answers):
        n = int((a != 0).sum())
        if 0 < n <= len(row):
            windows = np.lib.stride_tricks.sliding_window_view(row, n)
            if (windows == a[:n]).all(axis=1).any():
                return True
    return False


def blocks_by_doc(doc_ids, wanted) -> dict[str, list[int]]:
    """{doc_id: its block ids, in order} for the doc_ids in `wanted` (one pass over doc_ids)."""
    wanted = set(wanted) - {""}
    by_doc: dict[str, list[int]] = {}
    if wanted:
        for i, d in enumerate(doc_ids):
            if d in wanted:
                by_doc.setdefault(d, []).append(i)
    return by_doc


def gold_blocks(
    examples: list[QAExample], doc_ids, tokens, answer_ids: np.ndarray, by_doc=None
) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The prepared blocks of each question's gold passage (SQuAD-style files: the corpus id
    in `gold_passage`, kept by `prepare` as each block's doc_id; a passage may be cut into
    several blocks).

    doc_ids [N] (datasets.load_blocks), tokens [N, Lb] host token table (any object whose
    [i] is block i's row), answer_ids [len(examples), A, La] (`encode`'s). Returns
    (per question: its gold passage's block ids, those holding an answer's wordpieces first,
    each group in block order; () when the question has no gold_passage or the corpus lacks
    it), gold [len(examples)] int32: the first of them that holds an answer (the token test
    of training and evaluation: holds_answer), -1 when none does. by_doc: blocks_by_doc's map
    when the caller has it (batches of one question list: one pass over doc_ids, not one a
    batch)."""
    if by_doc is None:
        by_doc = blocks_by_doc(doc_ids, (e.gold_passage for e in examples))
    lists, gold = [], np.full((len(examples),), -1, np.int32)
    for n, ex in enumerate(examples):
        blocks = by_doc.get(ex.gold_passage, []) if ex.gold_passage else []
        has = [holds_answer(tokens[b], answer_ids[n]) for b in blocks]
        first = [b for b, h in zip(blocks, has, strict=True) if h]
        lists.append(tuple(first + [b for b, h in zip(blocks, has, strict=True) if not h]))
        if first:
            gold[n] = first[0]
    return lists, gold


def encode(examples: list[QAExample], query_len: int, answer_len: int, max_answers: int):
    """(arrays dict, number of examples with at least one answer in the token table)."""
    n = len(examples)
    questions = tk.wordpieces([e.question for e in examples])
    q = np.zeros((n, query_len), np.int32)
    a = np.zeros((n, max_answers, answer_len), np.int32)
    flat = [(i, s) for i, e in enumerate(examples) if not e.is_regex for s in e.answers]
    pieces = tk.wordpieces([s for _, s in flat]) if flat else []
    used = np.zeros((n,), np.int32)
    seen: set[tuple] = set()  # (example, wordpieces): the same answer pieces once
    for (i, _), enc in zip(flat, pieces, strict=True):
        key = (i, tuple(enc.ids))
        if 0 < len(enc.ids) <= answer_len and used[i] < max_answers and key not in seen:
            seen.add(key)
            a[i, used[i], : len(enc.ids)] = enc.ids
            used[i] += 1
    for i, enc in enumerate(questions):
        q[i] = tk.pad_to(tk.query_ids(enc.ids, query_len), query_len)
    return {"question_ids": q, "answer_ids": a}, int((used > 0).sum())


@dataclasses.dataclass
class ArraySource:
    """A grain data source over in-memory arrays of equal first dimension."""

    arrays: dict

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.arrays.items()}


class _Identity(grain.transforms.Map):
    def map(self, x):
        return x


def train_loader(config, arrays: dict) -> grain.DataLoader:
    """Shuffled batches of this process's share of the training questions, epoch after epoch
    (resumable: the iterator state is saved with every checkpoint); every array of
    `training_questions` (question_ids, answer_ids, gold_block) travels in the batch."""
    keep = (arrays["answer_ids"] != 0).any(axis=(1, 2))  # a question no block can answer
    arrays = {k: v[keep] for k, v in arrays.items()}  # adds nothing to either loss
    return pipeline.shuffled_batches(
        ArraySource(arrays),
        _Identity(),
        what="training questions with an answer of at most qa.answer_len wordpieces",
        global_batch_size=config.train.batch_size,
        seed=config.data.seed,
        worker_count=0,
    )


def training_questions(config, data_dir: str, blocks=None) -> tuple[list[QAExample], dict]:
    """The fine-tuning questions and their arrays (encode's, plus gold_block [N] int32:
    gold_blocks' answer-holding block of the question's gold passage, -1 when none); logs how
    many can be learnt from. blocks: (token table [N, Lb], doc_ids) of the prepared data when
    the caller has them (else read from data_dir, and only when a question has a
    gold_passage)."""
    q = config.qa
    examples = load_questions(q.train_file, q.format, q.train_holdout, data_dir)
    arrays, usable = encode(examples, config.data.query_len, q.answer_len, q.max_answers)
    gold = np.full((len(examples),), -1, np.int32)
    if any(e.gold_passage for e in examples):
        if blocks is None:
            tokens, doc_ids, _ = datasets.load_blocks(data_dir)
        else:
            tokens, doc_ids = blocks
        _, gold = gold_blocks(examples, doc_ids, tokens, arrays["answer_ids"])
    arrays["gold_block"] = gold
    log.info(
        "%d training questions from %s (%d with an answer of <= %d wordpieces, %d with an "
        "answer-holding block of their gold passage)",
        len(examples),
        q.train_file,
        usable,
        q.answer_len,
        int((gold >= 0).sum()),
    )
    if q.get("gold_in_beam", False) and not (gold >= 0).any():
        log.warning(
            "qa.gold_in_beam is on but no training question has a gold block (the file has "
            "no gold_passage field, or no gold passage's block holds an answer): it does nothing"
        )
    return examples, arrays


def dev_questions(config, data_dir: str) -> list[QAExample]:
    """The dev questions of the periodic evaluation: train.eval_examples of them (0 = all),
    evenly spaced through the file. A file lists an article's questions together, so its
    first 500 held-out SQuAD questions came from 3 of the 27 held-out articles; spread out,
    they come from every article and a checkpoint is chosen on all of them."""
    q = config.qa
    examples = load_questions(q.dev_file, q.format, q.dev_holdout, data_dir)
    n = int(config.train.eval_examples)
    return [examples[i] for i in spread(n, len(examples))]


def spread(n: int, total: int) -> list[int]:
    """n positions evenly spaced through range(total), in order (n <= 0 or >= total: all):
    the dev questions' positions (dev_questions)."""
    if n <= 0 or n >= total:
        return list(range(total))
    return [int(i * total // n) for i in range(n)]
