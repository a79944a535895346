"""ICT's held-out evaluation: recall@k of a sentence's own block over the whole corpus."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax import sharding
from realm_jax.data import datasets
from realm_jax.data import ict as ict_data
from realm_jax.index.bm25 import BM25Retriever, recall_at_k
from realm_jax.index.embedding import embed_blocks_fn, embed_query_tokens, pad_index
from realm_jax.ops import mips

log = logging.getLogger("realm_jax.ict")


class IctEvaluator:
    """Recall@k of each held-out sentence's own block over the whole corpus (exact search),
    with every held-out sentence cut out of its own block (ict.data.cut_out), next to BM25's
    recall on the same sentences and the same cut corpus (computed once).

    A separate pre-training text's sentence (data.sentences: no own block) counts a hit for a
    retrieved block of its document's title (the corpus document the text restates; nothing
    is cut); one whose title no block has is left out."""

    def __init__(self, config, mesh, model, data_dir: str, tokens: np.ndarray):
        tc = config.train
        self.ks = tuple(int(k) for k in config.ict.recall_ks)
        self.q, own, sentences, titles = ict_data.eval_queries(
            data_dir, config.data.query_len, tc.eval_examples
        )
        src = datasets.blocks_source(data_dir)
        recs = src.__getitems__(range(len(src)))
        block_titles = [r["title"].decode() for r in recs]
        texts = [f"{t}\n{r['text'].decode()}" for t, r in zip(block_titles, recs, strict=True)]
        # every block's title as a number; a query's gold "key": its own block (cut from the
        # corpus) or, offset by the block count, its title's number (a separate text)
        number = {t: i for i, t in enumerate(dict.fromkeys(block_titles))}
        self.block_title = np.asarray([number[t] for t in block_titles], np.int64)
        by_title = np.asarray([number.get(t, -1) for t in titles], np.int64)
        keep = (own >= 0) | (by_title >= 0)
        self.q, own, by_title = self.q[keep], own[keep], by_title[keep]
        sentences = [t for t, k in zip(sentences, keep, strict=True) if k]
        self.separate = own < 0
        n_blocks = len(block_titles)
        self.gold = np.where(self.separate, n_blocks + by_title, own)
        cut_rows = ~self.separate
        tokens, texts, cut = ict_data.cut_out(
            tokens,
            texts,
            own[cut_rows],
            self.q[cut_rows],
            [t for t, c in zip(sentences, cut_rows, strict=True) if c],
        )
        log.info(
            "ICT eval: %d held-out sentences (%d of a separate text, scored by their title), "
            "%d cut out of their own blocks",
            len(self.q),
            int(self.separate.sum()),
            cut,
        )
        if len(self.q) == 0:
            log.warning(
                "ICT eval: no held-out sentence has an own block or a corpus title: recall is "
                "not measured (a separate text's documents need the titles of the corpus "
                "documents they restate)"
            )
        self.num_blocks = tokens.shape[0]
        _, tok = pad_index(None, tokens, mesh)
        self.tokens = sharding.put_rows(tok, mesh)
        self.embed = embed_blocks_fn(model, mesh, config.refresh.embed_batch_size)
        self.embed_q = sharding.traced_in_mesh(
            jax.jit(functools.partial(embed_query_tokens, model)), mesh
        )
        # the exact sharded search: the blocks' embeddings stay on their devices (issue 58:
        # gathering them whole put the index on every device and host at each evaluation)
        search = functools.partial(mips.search, mesh, k=max(self.ks), num_valid=self.num_blocks)
        self.search = sharding.traced_in_mesh(jax.jit(search), mesh)
        self.baseline = self._bm25(texts, sentences) if config.ict.bm25_baseline else {}

    def keys(self, top: np.ndarray) -> np.ndarray:
        """Retrieved block ids [Q, k] as the keys self.gold compares with."""
        n = len(self.block_title)
        return np.where(self.separate[:, None], n + self.block_title[top], top)

    def _bm25(self, texts: list[str], sentences: list[str]) -> dict[str, float]:
        if not sentences:
            return {}
        ids, _ = BM25Retriever(texts).search(sentences, max(self.ks))
        out = recall_at_k(self.keys(np.asarray(ids)), self.gold, self.ks)
        log.info("ICT eval: BM25 on the same %d held-out sentences: %s", len(sentences), out)
        return {f"bm25_{k}": v for k, v in out.items()}

    def __call__(self, state, step: int) -> dict[str, float]:
        # every device embeds its rows and searches them (ops/mips.py); only the top ids
        # [Q, k] come to the hosts, so every process returns the same recall
        if len(self.q) == 0:
            return {"examples": 0.0}
        emb = self.embed(state.params, self.tokens)  # [Npad, D], row-sharded
        tops = []
        for i in range(0, len(self.q), 256):
            q = self.embed_q(state.params, self.q[i : i + 256])  # [b, D]
            none = jnp.full((q.shape[0],), -1, jnp.int32)
            tops.append(sharding.to_host(self.search(q, emb, none)[1]))
        top = np.concatenate(tops)  # [Q, k], best first
        out = recall_at_k(self.keys(top), self.gold, self.ks)
        out.update(self.baseline)
        out["examples"] = float(len(self.q))
        return out
