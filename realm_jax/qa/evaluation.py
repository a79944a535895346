"""Open-domain QA predictions and their scores, for the periodic dev evaluation of
`finetune`, for `evaluate` and for `ask`.

A question retrieves blocks (dense: exact MIPS over the frozen index on device; bm25: bm25s
over the same blocks on the host), the reader reads the top qa.reader_beam_size of them, and
the best span of all is the prediction (ORQA's get_predictions). Its text is cut from the
block's original text by the wordpieces' character offsets (ORQA maps back to original tokens
the same way), so "69,197" comes back as written. Scores: exact match after ORQA's answer
normalisation (regex match for CuratedTREC), and recall@k: some of the top k blocks holds an
answer (string answers: their wordpieces, tested on device as in training; regex answers:
a regex search of the block's text). Each question's record carries its own flags (hits:
{"k": bool} per recall@k; has_answer per block read), so confidence intervals can be
bootstrapped from the predictions file.

The gold retriever (SQuAD-style questions with a gold_passage) is no retrieval at all: the
reader reads the blocks of the question's gold passage (qa/data.py gold_blocks: answer-holding
ones first; the first R of them, repeated in turn to fill the R slots when fewer), so its exact
match is the reader's alone, "EM given the gold passage". A question whose gold passage is
missing (no gold_passage field, or not in the corpus) is counted (gold_missing) and scored as
wrong. It reports no recall@k (trivially the gold passage's coverage): gold_answer_coverage is
the share of questions whose gold blocks hold an answer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import numpy as np

from realm_jax import sharding
from realm_jax import tokenization as tk
from realm_jax.data import datasets
from realm_jax.index.embedding import embed_blocks_in_parts_fn, pad_index
from realm_jax.qa import answers as qa_answers
from realm_jax.qa import data as qa_data
from realm_jax.qa import step as qa_step

log = logging.getLogger("realm_jax.qa")

RETRIEVERS = ("dense", "bm25", "hybrid", "gold")


def eval_reader_beam(q) -> int:
    """The blocks evaluation and answering read per question (config.qa): its
    eval_reader_beam_size, or reader_beam_size when that is 0 or absent."""
    return int(q.get("eval_reader_beam_size", 0) or q.reader_beam_size)


@dataclasses.dataclass
class FrozenIndex:
    """The frozen block embeddings and token table, row-sharded on device (the embeddings in
    float32 or mesh.index_dtype's bfloat16; the tokens uint16 when the vocabulary fits)."""

    emb: jax.Array  # [N padded, D]
    tokens: jax.Array  # [N padded, Lb]
    num_blocks: int

    @classmethod
    def put(cls, mesh, emb: np.ndarray, tokens: np.ndarray, dtype=np.float32) -> FrozenIndex:
        e, t = pad_index(emb, tokens, mesh, dtype)
        return cls(sharding.put_rows(e, mesh), sharding.put_rows(t, mesh), len(tokens))

    @classmethod
    def embed(
        cls,
        mesh,
        model,
        params,
        tokens: np.ndarray,
        batch_size: int,
        dtype=np.float32,
        on_part=None,
    ):
        """Embed every block with the document embedder in `params` -> (index, the float32
        embeddings [Npad, D] row-sharded on the mesh: what is published, by row ranges). The
        index holds them in `dtype`. Never gathered whole on a device or a host (issue 58).
        on_part: embed_blocks_in_parts_fn's progress hook (e.g. embedding.Progress); the pass
        is waited for when one is given."""
        _, t = pad_index(None, tokens, mesh)
        t = sharding.put_rows(t, mesh)
        emb = embed_blocks_in_parts_fn(model, mesh, batch_size)(params, t, on_part)
        return cls(emb.astype(dtype), t, len(tokens)), emb


def span_text(title: str, text: str, tokens, start: int, end: int) -> str:
    """The original text of block-token positions start..end (a block is `[CLS] title [SEP]
    body [SEP]`): cut from the title or body by wordpiece offsets, else (a span across the
    two, or wordpieces that do not re-tokenise the same) the wordpieces joined."""
    tokens = [int(t) for t in tokens]
    if not 0 < start <= end < len(tokens):
        return ""
    sep = tokens.index(tk.SEP_ID) if tk.SEP_ID in tokens else len(tokens)
    for src, first in ((title, 1), (text, sep + 1)):
        enc = tk.wordpieces([src])[0]
        a, b = start - first, end - first
        if 0 <= a <= b < len(enc.ids) and enc.ids[a : b + 1] == tokens[start : end + 1]:
            return src[enc.offsets[a][0] : enc.offsets[b][1]]
    return tk.decode(tokens[start : end + 1])


class Predictor:
    """Predictions for batches of questions with one retriever over a frozen index."""

    def __init__(
        self,
        config,
        mesh,
        model,
        index: FrozenIndex,
        data_dir: str,
        retriever: str,
        blocks=None,
        view=None,
    ):
        """blocks: (host token table [N, Lb], doc_ids) of the prepared data, which the gold
        retriever needs (read from data_dir when not given). view: the corpus version read
        (versions.View, whose live blocks the index holds in order); searches run over its
        positions and records name stable block ids (view.row)."""
        if retriever not in RETRIEVERS:
            raise ValueError(f"retriever must be one of {RETRIEVERS}, got {retriever!r}")
        q = config.qa
        self.config, self.mesh, self.index, self.retriever = config, mesh, index, retriever
        self.ks = tuple(sorted({int(k) for k in q.recall_ks}))
        # blocks read per question: qa.eval_reader_beam_size when set (own_read trains on one
        # block a question and answers from 5), else the training's qa.reader_beam_size
        self.reader_beam = eval_reader_beam(q)
        # reading BM25's blocks: its scores x qa.bm25_weight are the retrieval scores added to
        # the span scores (the dense relevance of another retriever's blocks is not one)
        self.bm25_weight = float(q.get("bm25_weight", 0.0))
        self.depth = min(max(self.ks + (self.reader_beam,)), index.num_blocks)
        # hybrid (DPR's): the union of the dense and BM25 top qa.hybrid_pool, every block of it
        # rescored dense + qa.hybrid_bm25_weight x BM25, both computed exactly for each
        self.pool = min(max(int(q.get("hybrid_pool", 100)), self.depth), index.num_blocks)
        self.hybrid_weight = float(q.get("hybrid_bm25_weight", 1.0))
        self.blocks = view if view is not None else datasets.blocks_source(data_dir)
        self._row = view.row if view is not None else int
        self.gold_table = None
        if retriever == "gold":
            if blocks is None:
                tokens, doc_ids, _ = (
                    view.blocks() if view is not None else datasets.load_blocks(data_dir)
                )
                blocks = (tokens, doc_ids)
            self.gold_table = blocks
        kw = dict(model=model, mesh=mesh)

        def jit(fn, **more):  # traced in the mesh, as the train step: its sharding rules apply
            return sharding.traced_in_mesh(jax.jit(functools.partial(fn, **kw, **more)), mesh)

        self._predict = jit(qa_step.predict, length=qa_step.reader_len(config))
        self._search = jit(qa_step.search, k=self.depth, num_valid=index.num_blocks)
        self._has = sharding.traced_in_mesh(
            jax.jit(functools.partial(qa_step.block_has_answer, mesh=mesh)), mesh
        )
        if retriever == "hybrid":
            self._pool_search = jit(qa_step.search, k=self.pool, num_valid=index.num_blocks)
            self._dense_scores = jit(qa_step.dense_scores)
        self._bm25 = None
        self._texts: dict[int, str] = {}

    def _block(self, i: int) -> dict:
        return self.blocks[int(i)]

    def bm25(self):
        """The BM25 retriever over every block's "title\\ntext" (built once, on first use)."""
        if self._bm25 is None:
            from realm_jax.index.bm25 import BM25Retriever

            t0 = time.perf_counter()
            recs = self.blocks.__getitems__(range(self.index.num_blocks))
            self._bm25 = BM25Retriever(
                [f"{r['title'].decode()}\n{r['text'].decode()}" for r in recs]
            )
            log.info("BM25 index over %d blocks: %.1f s", len(recs), time.perf_counter() - t0)
        return self._bm25

    def _retrieve(self, params, questions: list[str], q_ids):
        """(block ids [B, depth] int32, scores [B, depth]) from the configured retriever."""
        if self.retriever == "dense":
            ids, scores = self._search(params, q_ids, self.index.emb, self.index.tokens)
            return sharding.to_host((ids, scores))
        if self.retriever == "hybrid":
            return self._hybrid(params, questions, q_ids)
        real = [i for i, t in enumerate(questions) if t]  # the batch's padding rows stay 0
        ids = np.zeros((len(questions), self.depth), np.int32)
        scores = np.zeros((len(questions), self.depth), np.float32)
        if real:
            found, s = self.bm25().search([questions[i] for i in real], self.depth)
            ids[real], scores[real] = found, s
        return ids, scores

    def _hybrid(self, params, questions: list[str], q_ids):
        """DPR's hybrid: the union of the dense and BM25 top `pool` blocks, each rescored
        dense relevance + hybrid_bm25_weight x BM25 score (both exact for every block of the
        union, not only for the list it came from) -> (ids [B, depth], scores [B, depth])."""
        dense, _ = sharding.to_host(
            self._pool_search(params, q_ids, self.index.emb, self.index.tokens)
        )
        B, n = dense.shape
        union = np.full((B, 2 * n), -1, np.int64)
        real = [i for i, t in enumerate(questions) if t]
        lexical = np.zeros((B, n), np.int64)
        if real:
            lexical[real] = self.bm25().search([questions[i] for i in real], n)[0]
        for b in range(B):
            both = list(dict.fromkeys([*dense[b].tolist(), *lexical[b].tolist()]))
            union[b, : len(both)] = both
        safe = np.maximum(union, 0)
        rel = np.asarray(
            sharding.to_host(
                self._dense_scores(params, q_ids, safe.astype(np.int32), self.index.emb)
            ),
            np.float64,
        )
        lex = np.zeros(union.shape, np.float64)
        if real:
            lex[real] = self.bm25().scores([questions[i] for i in real], safe[real])
        score = np.where(union >= 0, rel + self.hybrid_weight * lex, -np.inf)
        order = np.argsort(-score, axis=1, kind="stable")[:, : self.depth]
        ids = np.take_along_axis(safe, order, 1).astype(np.int32)
        return ids, np.take_along_axis(score, order, 1).astype(np.float32)

    def _gold(self, chunk, answer_ids, batch_size: int, by_doc):
        """The gold retriever: (block ids [B, R] int32, missing [len(chunk)] bool): each
        question's gold passage blocks (answer-holding first), the first R of them, repeated
        in turn to fill the R slots; block 0 for a question without one (missing)."""
        tokens, doc_ids = self.gold_table
        lists, _ = qa_data.gold_blocks(chunk, doc_ids, tokens, answer_ids[: len(chunk)], by_doc)
        R = self.reader_beam
        ids = np.zeros((batch_size, R), np.int32)
        missing = np.zeros((len(chunk),), bool)
        for b, found in enumerate(lists):
            if found:
                ids[b] = [found[j % len(found)] for j in range(R)]
            else:
                missing[b] = True
        return ids, missing

    def run(
        self,
        params,
        examples: list[qa_answers.QAExample],
        batch_size: int,
        read=True,
        on_batch=None,
    ):
        """(one record per question, metrics) for the examples, in order. read=False:
        retrieval alone (recall@k; no reader, and for BM25 no model at all; not for gold).
        on_batch(questions done): called after each batch (`evaluate`'s watchdog beat)."""
        d, q = self.config.data, self.config.qa
        gold = self.retriever == "gold"
        if gold and not read:
            raise ValueError("the gold retriever reads the gold passage: no retrieval to score")
        records, hits, gold_missing = [], [], 0
        if gold:  # the gold passages' blocks: one pass over the corpus's doc_ids
            by_doc = qa_data.blocks_by_doc(self.gold_table[1], (e.gold_passage for e in examples))
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            padded = chunk + [qa_answers.QAExample("", ("",))] * (batch_size - len(chunk))
            arrays, _ = qa_data.encode(padded, d.query_len, q.answer_len, q.max_answers)
            q_ids = arrays["question_ids"]
            missing = np.zeros((len(chunk),), bool)
            if gold:
                ids, missing = self._gold(chunk, arrays["answer_ids"], batch_size, by_doc)
                scores = None
                gold_missing += int(missing.sum())
            else:
                ids, scores = self._retrieve(params, [e.question for e in padded], q_ids)
            pred = None
            if read:
                R = self.reader_beam
                added = None  # dense (and gold): the dense relevance, as in training
                if self.retriever == "bm25":
                    added = (self.bm25_weight * scores[:, :R]).astype(np.float32)
                elif self.retriever == "hybrid":  # its own score: dense + weight x BM25
                    added = scores[:, :R].astype(np.float32)
                pred = sharding.to_host(
                    self._predict(
                        params, q_ids, ids[:, :R], self.index.emb, self.index.tokens, added
                    )
                )
            has = np.array(
                sharding.to_host(self._has(ids, arrays["answer_ids"], self.index.tokens))
            )
            for b, ex in enumerate(chunk):
                if missing[b]:  # gold: no gold passage to read; scored as wrong
                    has[b] = False
                    records.append(self._gold_missing(ex))
                    hits.append(has[b])
                    continue
                if ex.is_regex:  # regex answers: search the blocks' text on the host
                    has[b] = [self._regex_in_block(ex.answers, j) for j in ids[b]]
                if read:
                    rec = self._record(ex, ids[b], pred, b, has[b], scores)
                else:
                    rec = self._retrieved(ex, ids[b], scores[b], has[b])
                if gold:
                    rec["gold_passage"] = ex.gold_passage
                else:  # per-question recall@k flags (bootstrap from the records)
                    rec["hits"] = {str(k): bool(has[b][:k].any()) for k in self.ks}
                records.append(rec)
                hits.append(has[b])
            if on_batch is not None:
                on_batch(i + len(chunk))
        hits = np.asarray(hits, bool).reshape(len(records), -1)
        metrics = {"questions": float(len(records))}
        if read:
            metrics["exact_match"] = float(np.mean([r["correct"] for r in records] or [0.0]))
        if gold:  # recall@k would only restate the gold passage's coverage
            metrics["gold_missing"] = float(gold_missing)
            metrics["gold_answer_coverage"] = float(hits.any(axis=1).mean()) if records else 0.0
            return records, metrics
        for k in self.ks:
            metrics[f"recall@{k}"] = float(hits[:, :k].any(axis=1).mean()) if records else 0.0
        return records, metrics

    def _regex_in_block(self, patterns, block_id: int) -> bool:
        if block_id not in self._texts:
            rec = self._block(block_id)
            self._texts[block_id] = f"{rec['title'].decode()}\n{rec['text'].decode()}"
        return any(qa_answers.regex_in_text(p, self._texts[block_id]) for p in patterns)

    def _retrieved(self, ex, ids, scores, has) -> dict:
        top = [
            {
                "id": self._row(i),
                "title": self._block(i)["title"].decode(),
                "score": float(s),
                "has_answer": bool(h),
            }
            for i, s, h in zip(ids[: self.reader_beam], scores, has, strict=False)
        ]
        return {"question": ex.question, "gold": list(ex.answers), "top_blocks": top}

    def _gold_missing(self, ex) -> dict:
        return {
            "question": ex.question,
            "prediction": "",
            "gold": list(ex.answers),
            "correct": False,
            "gold_missing": True,
            "gold_passage": ex.gold_passage,
            "block": None,
            "score": None,
            "top_blocks": [],
        }

    def _record(self, ex, ids, pred, b: int, has, scores=None) -> dict:
        """One question's record. top_blocks: each block read, with its retrieval score
        (score: the dense relevance; bm25: BM25's own score, for the BM25 retriever) and its
        own best span (span, span_score: the reader's span logit alone), so another way of
        combining the two can be scored from the file."""
        r = int(pred["best_block"][b])
        rec = self._block(ids[r])
        title = rec["title"].decode()
        answer = span_text(
            title,
            rec["text"].decode(),
            rec["token_ids"],
            int(pred["start"][b]),
            int(pred["end"][b]),
        )
        top, seen = [], set()
        for j in range(self.reader_beam):
            if self.retriever == "gold" and int(ids[j]) in seen:  # a short passage, repeated
                continue
            seen.add(int(ids[j]))
            blk = self._block(ids[j])
            t = blk["title"].decode()
            entry = {
                "id": self._row(ids[j]),
                "title": t,
                "score": float(pred["relevance"][b, j]),
                "has_answer": bool(has[j]),
                "span": span_text(
                    t,
                    blk["text"].decode(),
                    blk["token_ids"],
                    int(pred["block_start"][b, j]),
                    int(pred["block_end"][b, j]),
                ),
                "span_score": float(pred["block_span_score"][b, j]),
            }
            if self.retriever in ("bm25", "hybrid"):  # that retriever's own score
                entry[self.retriever] = float(scores[b, j])
            top.append(entry)
        return {
            "question": ex.question,
            "prediction": answer,
            "gold": list(ex.answers),
            "correct": bool(ex.answers and qa_answers.is_correct(ex.answers, answer, ex.is_regex)),
            "block": {"id": self._row(ids[r]), "title": title, "text": rec["text"].decode()},
            "score": float(pred["score"][b]),
            "top_blocks": top,
        }


class DevEvaluator:
    """The periodic dev evaluation of `finetune` (dense retrieval, current params)."""

    def __init__(self, config, predictor: Predictor, examples):
        self.predictor, self.examples = predictor, examples
        self.batch_size = int(config.train.eval_batch_size)

    def __call__(self, state, step: int) -> dict[str, float]:
        _, metrics = self.predictor.run(state.params, self.examples, self.batch_size)
        return metrics
