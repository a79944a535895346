"""ICT's held-out evaluation: recall@k of a sentence's own block over the whole corpus."""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np

from realm_jax import sharding
from realm_jax.data import datasets
from realm_jax.data import ict as ict_data
from realm_jax.index.bm25 import BM25Retriever, recall_at_k
from realm_jax.index.embedding import embed_blocks_fn, embed_query_tokens, pad_index

log = logging.getLogger("realm_jax.ict")


class IctEvaluator:
    """Recall@k of each held-out sentence's own block over the whole corpus (exact search),
    with every held-out sentence cut out of its own block (ict.data.cut_out), next to BM25's
    recall on the same sentences and the same cut corpus (computed once)."""

    def __init__(self, config, mesh, model, data_dir: str, tokens: np.ndarray):
        tc = config.train
        self.ks = tuple(int(k) for k in config.ict.recall_ks)
        self.q, self.own, sentences = ict_data.eval_queries(
            data_dir, config.data.query_len, tc.eval_examples
        )
        keep = self.own >= 0
        self.q, self.own = self.q[keep], self.own[keep]
        sentences = [t for t, k in zip(sentences, keep, strict=True) if k]
        src = datasets.blocks_source(data_dir)
        texts = [
            f"{r['title'].decode()}\n{r['text'].decode()}"
            for r in src.__getitems__(range(len(src)))
        ]
        tokens, texts, cut = ict_data.cut_out(tokens, texts, self.own, self.q, sentences)
        log.info(
            "ICT eval: %d held-out sentences, %d cut out of their own blocks", len(self.q), cut
        )
        self.num_blocks = tokens.shape[0]
        _, tok = pad_index(None, tokens, mesh)
        self.tokens = sharding.put_rows(tok, mesh)
        self.embed = embed_blocks_fn(model, mesh, config.refresh.embed_batch_size)
        self.embed_q = jax.jit(functools.partial(embed_query_tokens, model))
        self.baseline = self._bm25(texts, sentences) if config.ict.bm25_baseline else {}

    def _bm25(self, texts: list[str], sentences: list[str]) -> dict[str, float]:
        ids, _ = BM25Retriever(texts).search(sentences, max(self.ks))
        out = recall_at_k(ids, self.own, self.ks)
        log.info("ICT eval: BM25 on the same %d held-out sentences: %s", len(sentences), out)
        return {f"bm25_{k}": v for k, v in out.items()}

    def __call__(self, state, step: int) -> dict[str, float]:
        # every process embeds its rows and its share of the queries, then gathers them all
        # (sharding.to_host): each process scores the same and returns the same recall
        emb = sharding.to_host(self.embed(state.params, self.tokens)).astype(np.float32)
        emb = emb[: self.num_blocks]
        q = np.concatenate(
            [
                sharding.to_host(self.embed_q(state.params, self.q[i : i + 256]))
                for i in range(0, len(self.q), 256)
            ]
        )
        scores = q @ emb.T  # [Q, N]
        k = max(self.ks)
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(scores, top, 1).argsort(1)[:, ::-1]
        top = np.take_along_axis(top, order, 1)
        out = recall_at_k(top, self.own, self.ks)
        out.update(self.baseline)
        out["examples"] = float(len(self.q))
        return out
