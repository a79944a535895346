"""REALM's networks: the embedder (BERT [CLS] -> 128-d projection), the knowledge-augmented
reader with its MLM and ORQA span heads, and the models that group them (RealmModel for
pre-training, RetrieverModel for ICT)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from realm_jax.model.bert import BertEncoder, ModelConfig, ModelConfigError
from realm_jax.model.layers import Dropout, _init, _zeros, activation, dense, layer_norm

Array = jax.Array


class Embedder(nn.Module):
    """A retriever's embedder; `cfg.embedder_pooling` says how (model/bert.py ModelConfig):

    - "realm": REALM's: pooled [CLS] -> dense(proj_size) -> LayerNorm (-> dropout in
      training, `proj_dropout`, as ORQA's ict_model.py: rate 0.1 after the projection's
      LayerNorm; the REALM release embeds with that ICT module).
    - "mean" / "cls": a sentence embedder's (sentence-transformers' Pooling module): the mean
      of the last hidden states over the unmasked positions, or the state at [CLS]; no pooler
      and no projection (D = hidden_size). These encode a text as one segment, as
      sentence-transformers does: the segment ids given (a block's title 0, body 1) are not
      used.

    Then with `cfg.embedder_normalize` the embedding is scaled to unit L2 norm. With a
    prefix (`cfg.query_prefix` for role "query", `cfg.doc_prefix` for "doc") its wordpieces
    are put after [CLS] (`insert_prefix`). Returns [B, D] float32."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        realm = c.embedder_pooling == "realm"
        self.bert = BertEncoder(c, add_pooler=realm)
        if realm:
            self.projection = dense(c.proj_size, ("embed", "proj"), c, "projection")
            self.projection_LayerNorm = layer_norm(c, "projection_LayerNorm", axis_name="proj")
            self.projection_dropout = Dropout(c.proj_dropout)

    def __call__(
        self, ids: Array, segment_ids: Array, mask: Array, train: bool = False, role: str = "query"
    ) -> Array:
        c = self.cfg
        prefix = c.prefix_ids(role)
        if prefix:
            ids, segment_ids, mask = insert_prefix(ids, segment_ids, mask, prefix)
        if c.embedder_pooling == "realm":
            _, pooled = self.bert(ids, segment_ids, mask, train)
            emb = self.projection_LayerNorm(self.projection(pooled)).astype(jnp.float32)
            emb = self.projection_dropout(emb, deterministic=not train)
        else:
            h, _ = self.bert(ids, jnp.zeros_like(segment_ids), mask, train)
            emb = sentence_pooling(h.astype(jnp.float32), mask, c.embedder_pooling)
        if c.embedder_normalize:
            emb = l2_normalize(emb)
        return emb


def insert_prefix(ids: Array, segment_ids: Array, mask: Array, prefix: tuple[int, ...]):
    """[B, L] inputs -> [B, L + p]: the p prefix wordpieces put after each row's [CLS], as a
    tokenizer would encode the prefix's text before the row's own. The window grows by p
    instead of losing the row's last p tokens, so no text is cut and a row's [SEP]s stay
    where its format puts them (the null document embedded at its own length stays equal to
    it padded). The prefix takes segment 0 and is masked like the row's [CLS] (an all-padding
    row stays all padding)."""
    B, p = ids.shape[0], len(prefix)
    pre = jnp.broadcast_to(jnp.asarray(prefix, ids.dtype), (B, p))
    ids = jnp.concatenate([ids[:, :1], pre, ids[:, 1:]], axis=1)
    segs = jnp.concatenate(
        [segment_ids[:, :1], jnp.zeros((B, p), segment_ids.dtype), segment_ids[:, 1:]], axis=1
    )
    mask = jnp.concatenate(
        [mask[:, :1], jnp.broadcast_to(mask[:, :1], (B, p)), mask[:, 1:]], axis=1
    )
    return ids, segs, mask


def sentence_pooling(h: Array, mask: Array, mode: str) -> Array:
    """h [B, L, H], mask [B, L] -> [B, H]: "mean" over the unmasked positions (their count
    floored at 1e-9, as sentence-transformers' Pooling), "cls" the state at position 0."""
    if mode == "cls":
        return h[:, 0]
    m = mask[..., None].astype(h.dtype)
    return (h * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)


def l2_normalize(x: Array) -> Array:
    """x / max(||x||, 1e-12) over the last axis (torch's F.normalize, which
    sentence-transformers' Normalize module applies)."""
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    return x / jnp.maximum(norm, 1e-12)


class MLMHead(nn.Module):
    """BERT MLM head: dense + act + LayerNorm (`features`) and the decoder's bias; the decoder
    itself is the word embeddings (`tied_decoder_logits`)."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        self.transform = dense(c.hidden_size, ("embed", "embed_out"), c, "transform")
        self.transform_LayerNorm = layer_norm(c, "transform_LayerNorm")
        self.bias = self.param("bias", _zeros(("vocab",)), (c.vocab_size,))

    def features(self, h: Array) -> Array:
        """The decoder's input: [..., H] hidden states -> [..., H] in the compute dtype."""
        h = self.transform(h)
        h = self.transform_LayerNorm(activation(self.cfg.hidden_act)(h))
        return h.astype(self.cfg.compute_dtype)


def tied_decoder_logits(features: Array, table: Array, bias: Array) -> Array:
    """MLM logits [..., V] in float32 from `Reader.mlm_features`' (features [..., H], word
    embeddings [V, H], bias [V]): the decoder tied to the word embeddings."""
    logits = jnp.einsum("...h,vh->...v", features, table.astype(features.dtype))
    return logits.astype(jnp.float32) + bias


def span_candidates(length: int, max_width: int) -> tuple[np.ndarray, np.ndarray]:
    """All spans of width 1..max_width in a length-L sequence, ordered by width then start."""
    starts = np.concatenate([np.arange(0, length - w + 1) for w in range(1, max_width + 1)])
    ends = np.concatenate([np.arange(w - 1, length) for w in range(1, max_width + 1)])
    return starts.astype(np.int32), ends.astype(np.int32)


def _columns_over_model(w: Array) -> Array:
    """A weight [..., S] split by its last axis over 'model' in the ambient mesh
    (sharding.traced_in_mesh); unchanged outside one or where 'model' does not divide S."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "model" not in mesh.axis_names or w.shape[-1] % mesh.shape["model"]:
        return w
    spec = jax.sharding.PartitionSpec(*([None] * (w.ndim - 1)), "model")
    return jax.lax.with_sharding_constraint(w, spec)


class StartEnd(nn.Module):
    """ORQA's start and end projections, one [H, 2S] kernel (the release's dense layer, start
    columns then end columns; its parameter tree is nn.Dense's), applied as two [H, S] halves:
    h @ kernel then a split would put the halves on different model shards, which met only
    through all-to-alls (issue 58's QA audit). Each half is split over 'model' as a weight
    (a slice of the replicated kernel, "span_pair" never split), so each shard computes its
    S/model columns of both and only the small kernel's gradient is gathered."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h: Array) -> tuple[Array, Array]:
        c, S = self.cfg, self.cfg.span_hidden_size
        kernel = self.param("kernel", _init(("embed", "span_pair")), (h.shape[-1], 2 * S))
        bias = self.param("bias", _zeros(("span_pair",)), (2 * S,))
        h = h.astype(c.compute_dtype)
        out = []
        for half in (slice(0, S), slice(S, 2 * S)):
            w = _columns_over_model(kernel[:, half].astype(c.compute_dtype))
            b = _columns_over_model(bias[half].astype(c.compute_dtype))
            out.append(jnp.einsum("nlh,hs->nls", h, w) + b)
        return out[0], out[1]


class SpanHead(nn.Module):
    """ORQA span scorer: start/end projections summed per span, ReLU, LayerNorm, scalar."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h: Array, block_mask: Array) -> tuple[Array, np.ndarray, np.ndarray]:
        """h [N, L, H], block_mask [N, L] -> (logits [N, S], starts [S], ends [S])."""
        c = self.cfg
        start_p, end_p = StartEnd(c, name="dense_intermediate")(h)  # [N, L, S] each
        starts, ends = span_candidates(h.shape[1], c.max_span_width)
        x = jax.nn.relu(start_p[:, starts] + end_p[:, ends])
        x = layer_norm(c, "layer_normalization", eps=c.reader_layer_norm_eps, axis_name="mlp")(x)
        logits = dense(1, ("mlp", "unit"), c, "dense_output")(x)[..., 0].astype(jnp.float32)
        span_ok = (block_mask[:, starts] > 0) & (block_mask[:, ends] > 0)
        logits = logits + jnp.where(span_ok, 0.0, jnp.finfo(jnp.float32).min)
        return logits, starts, ends


class Reader(nn.Module):
    """Knowledge-augmented encoder: BERT over [CLS] x [SEP] z [SEP] with MLM and span heads.

    MLM logits are computed only at the given positions, never over the whole sequence.
    """

    cfg: ModelConfig

    def setup(self):
        self.bert = BertEncoder(self.cfg, add_pooler=False)
        self.mlm = MLMHead(self.cfg)
        self.span = SpanHead(self.cfg)

    def mlm_logits(self, ids, segment_ids, mask, positions, train: bool = False):
        """[N, L] inputs, positions [N, P] -> logits [N, P, vocab] (float32)."""
        return tied_decoder_logits(*self.mlm_features(ids, segment_ids, mask, positions, train))

    def mlm_features(self, ids, segment_ids, mask, positions, train: bool = False):
        """What the tied decoder reads, for a loss that never materialises [N, P, vocab]
        logits (losses.fused_marginal_loss): (features [N, P, H], word embeddings [V, H],
        decoder bias [V]); logits = features @ embeddings.T + bias."""
        h, _ = self.bert(ids, segment_ids, mask, train)
        h = jnp.take_along_axis(h, positions[..., None].astype(jnp.int32), axis=1)
        table = jnp.asarray(self.bert.embeddings.word_embeddings.embedding)
        return self.mlm.features(h), table, jnp.asarray(self.mlm.bias)

    def span_logits(self, ids, segment_ids, mask, block_mask, train: bool = False):
        """[N, L] inputs -> (span logits [N, S], starts [S], ends [S])."""
        h, _ = self.bert(ids, segment_ids, mask, train)
        return self.span(h, block_mask)

    def __call__(self, ids, segment_ids, mask, positions, block_mask):
        """Both heads (used to initialise every reader parameter)."""
        return (
            self.mlm_logits(ids, segment_ids, mask, positions),
            self.span_logits(ids, segment_ids, mask, block_mask)[0],
        )


def scale_query(q: Array, cfg: ModelConfig) -> Array:
    """The query embedding times `cfg.retrieval_scale`: every retrieval score (the search's,
    the losses', the softmax over retrieved blocks) is then retrieval_scale x <query, block>,
    and the search's ranking is unchanged. A sentence embedder trained with cosine scores and
    a temperature gets its training scale this way (config.model.retrieval_scale)."""
    return q if cfg.retrieval_scale == 1.0 else q * jnp.float32(cfg.retrieval_scale)


class RealmModel(nn.Module):
    """The three REALM networks: query embedder, document embedder and reader. The embedders
    share one architecture (`embedder_cfg`), the reader has its own (`cfg`); they share the
    vocabulary. With `share_embedders` the query and document embedders are one network.
    `embedder_cfg=None` gives the embedders the reader's architecture."""

    cfg: ModelConfig
    embedder_cfg: ModelConfig | None = None

    @property
    def ecfg(self) -> ModelConfig:
        return self.cfg if self.embedder_cfg is None else self.embedder_cfg

    @property
    def uses_dropout(self) -> bool:
        """Whether training applies any dropout (and so needs a 'dropout' rng)."""
        return max(self.cfg.dropout, self.ecfg.dropout, self.ecfg.proj_dropout) > 0

    def setup(self):
        if self.ecfg.vocab_size != self.cfg.vocab_size:
            raise ModelConfigError(
                f"embedder vocab_size {self.ecfg.vocab_size} != reader vocab_size "
                f"{self.cfg.vocab_size}: queries are read by both, so they must share one"
            )
        self.query_embedder = Embedder(self.ecfg)
        if not self.ecfg.share_embedders:
            self.doc_embedder = Embedder(self.ecfg)
        self.reader = Reader(self.cfg)

    def _doc(self):
        return self.query_embedder if self.ecfg.share_embedders else self.doc_embedder

    def embed_query(self, ids, segment_ids, mask, train: bool = False):
        q = self.query_embedder(ids, segment_ids, mask, train, role="query")
        return scale_query(q, self.ecfg)

    def embed_doc(self, ids, segment_ids, mask, train: bool = False):
        return self._doc()(ids, segment_ids, mask, train, role="doc")

    def mlm_logits(self, ids, segment_ids, mask, positions, train: bool = False):
        return self.reader.mlm_logits(ids, segment_ids, mask, positions, train)

    def mlm_features(self, ids, segment_ids, mask, positions, train: bool = False):
        return self.reader.mlm_features(ids, segment_ids, mask, positions, train)

    def span_logits(self, ids, segment_ids, mask, block_mask, train: bool = False):
        return self.reader.span_logits(ids, segment_ids, mask, block_mask, train)

    def __call__(self, query, block, joint, positions, block_mask):
        """Touch every network once (for init). Each arg is an (ids, segs, mask) tuple."""
        q = self.embed_query(*query)
        d = self.embed_doc(*block)
        return q, d, self.reader(*joint, positions, block_mask)


class RetrieverModel(nn.Module):
    """The two embedders alone (ICT): the same modules under the same names as RealmModel's,
    so an ICT checkpoint's params["query_embedder"] / ["doc_embedder"] warm-start REALM."""

    cfg: ModelConfig  # the embedders' architecture

    @property
    def uses_dropout(self) -> bool:
        return max(self.cfg.dropout, self.cfg.proj_dropout) > 0

    def setup(self):
        self.query_embedder = Embedder(self.cfg)
        if not self.cfg.share_embedders:
            self.doc_embedder = Embedder(self.cfg)

    def embed_query(self, ids, segment_ids, mask, train: bool = False):
        q = self.query_embedder(ids, segment_ids, mask, train, role="query")
        return scale_query(q, self.cfg)

    def embed_doc(self, ids, segment_ids, mask, train: bool = False):
        doc = self.query_embedder if self.cfg.share_embedders else self.doc_embedder
        return doc(ids, segment_ids, mask, train, role="doc")

    def __call__(self, query, block):
        """Touch both embedders once (for init). Each arg is an (ids, segs, mask) tuple."""
        return self.embed_query(*query), self.embed_doc(*block)


def realm_model(model_config) -> RealmModel:
    """The RealmModel that `config.model` describes."""
    return RealmModel(
        ModelConfig.from_config(model_config, "reader"),
        ModelConfig.from_config(model_config, "embedder"),
    )


def doc_embedder_name(cfg: ModelConfig) -> str:
    """The params subtree that embeds documents (what the refresh job restores)."""
    return "query_embedder" if cfg.share_embedders else "doc_embedder"
