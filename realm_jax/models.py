"""Flax linen models: BERT encoder, REALM embedder, knowledge-augmented reader, ORQA span head.

Every parameter carries logical axis names (see `sharding.py` for the rules that map them to
the mesh): 'vocab', 'embed', 'mlp', 'heads', 'kv', 'proj', 'pos', 'type'.
Parameter names follow HuggingFace's BERT/REALM layout so weight import is a readable table.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

Array = jax.Array


# config.model fields that are not part of one network's architecture.
_NOT_ARCHITECTURE = ("embedder", "reader", "init_embedder_from", "init_reader_from")
_NOT_ARCHITECTURE += ("init_embedders_from_ict",)


class ModelConfigError(ValueError):
    """A config.model that does not describe a valid set of networks."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One network's architecture (an embedder or the reader) plus the shared fields; built
    from `config.model` by `ModelConfig.from_config(config.model, "embedder" | "reader")`."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu_new"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    proj_size: int = 128
    span_hidden_size: int = 256
    max_span_width: int = 10
    reader_layer_norm_eps: float = 1e-3
    share_embedders: bool = False
    dtype: str = "float32"
    remat: bool = False
    dropout: float = 0.0
    proj_dropout: float = 0.0

    @classmethod
    def from_config(cls, model_config, part: str) -> ModelConfig:
        """config.model's shared fields + config.model.<part> (embedder or reader). An unknown
        key is an error, never dropped."""
        if part not in ("embedder", "reader"):
            raise ValueError(f"part must be embedder or reader, got {part!r}")
        values = {k: v for k, v in dict(model_config).items() if k not in _NOT_ARCHITECTURE}
        values.update(dict(model_config[part]))
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ModelConfigError(f"config.model: unknown field(s) {unknown}")
        cfg = cls(**values)
        if cfg.hidden_size % cfg.num_heads:
            raise ModelConfigError(
                f"config.model.{part}: hidden_size {cfg.hidden_size} is not divisible by "
                f"num_heads {cfg.num_heads}"
            )
        return cfg

    @property
    def compute_dtype(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        return jnp.dtype(self.dtype)


def activation(name: str):
    """BERT activations: 'gelu' is the exact erf form, 'gelu_new' the tanh approximation."""
    table = {
        "gelu": functools.partial(jax.nn.gelu, approximate=False),
        "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
        "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
        "relu": jax.nn.relu,
    }
    if name not in table:
        raise ValueError(f"unknown hidden_act {name!r}; choose one of {sorted(table)}")
    return table[name]


def _init(axes, std=0.02):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def _zeros(axes):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    centred = x - mean
    rstd = jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + eps)
    xhat = centred * rstd
    return xhat * scale + bias, (xhat, rstd, scale)


def _layer_norm_bwd(eps, residuals, dy):
    """The closed-form LayerNorm gradient: one pass for the two row means, one for dx."""
    xhat, rstd, scale = residuals
    dy = dy.astype(jnp.float32)
    dxhat = dy * scale
    dx = rstd * (
        dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    )
    lead = tuple(range(dy.ndim - 1))
    return dx, (dy * xhat).sum(lead), dy.sum(lead)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis in float32 (flax's parameter names: scale, bias) with a
    closed-form backward pass: XLA:CPU spent more on differentiating flax's LayerNorm
    statistics than on the forward (profiled); this is tested against nn.LayerNorm."""

    epsilon: float
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        n = x.shape[-1]
        scale = self.param("scale", _ones((self.axis_name,)), (n,))
        bias = self.param("bias", _zeros((self.axis_name,)), (n,))
        return _layer_norm(x, jnp.asarray(scale), jnp.asarray(bias), self.epsilon)


def layer_norm(cfg: ModelConfig, name: str, eps: float | None = None, axis_name="embed"):
    eps = cfg.layer_norm_eps if eps is None else eps
    return LayerNorm(epsilon=eps, axis_name=axis_name, name=name)


def dense(features, axes, cfg: ModelConfig, name: str):
    return nn.Dense(
        features,
        dtype=cfg.compute_dtype,
        kernel_init=_init(axes),
        bias_init=_zeros(axes[-1:]),
        name=name,
    )


def _mix32(x: Array) -> Array:
    """A 32-bit integer finaliser (lowbias32: xor-shift / multiply, full avalanche)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(key: Array, shape: tuple[int, ...], rate: float) -> Array:
    """Bernoulli(1 - rate) keep mask: a counter-based hash of each element's index.

    Two threefry words per call seed a hash of (row, column) indices, so the mask is a pure
    function of the key and the element's global position: the same on any mesh, and it fuses
    into the consumer. Drawing a threefry word per element instead (flax's nn.Dropout) was over
    15x slower on XLA:CPU (bench/train_throughput.py) and the largest cost of a dropout-on
    train step at the 4x256 size (profiled). Rows are the flattened leading axes (under 2^32
    at any configured size).
    """
    k = jax.random.bits(key, (2,), jnp.uint32)
    row = jnp.zeros(shape, jnp.uint32)
    for axis in range(len(shape) - 1):
        row = row * jnp.uint32(shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    col = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    h = _mix32(_mix32(row ^ k[0]) ^ (col * jnp.uint32(0x9E3779B9) + k[1]))
    return h >= jnp.uint32(min(int(round(rate * 2**32)), 2**32 - 1))


class Dropout(nn.Module):
    """Inverted dropout with `dropout_keep` masks; keys from the 'dropout' rng collection."""

    rate: float

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        if deterministic or self.rate <= 0.0:
            return x
        if self.rate >= 1.0:
            return jnp.zeros_like(x)
        keep = dropout_keep(self.make_rng("dropout"), x.shape, self.rate)
        return jnp.where(keep, x * (1.0 / (1.0 - self.rate)), 0).astype(x.dtype)


class Embeddings(nn.Module):
    """Word + position + segment embeddings, then LayerNorm."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        self.word_embeddings = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            embedding_init=_init(("vocab", "embed")),
            name="word_embeddings",
        )
        self.position_embeddings = self.param(
            "position_embeddings",
            _init(("pos", "embed")),
            (c.max_position_embeddings, c.hidden_size),
        )
        self.token_type_embeddings = self.param(
            "token_type_embeddings", _init(("type", "embed")), (c.type_vocab_size, c.hidden_size)
        )
        self.LayerNorm = layer_norm(c, "LayerNorm")
        self.dropout = Dropout(c.dropout)

    def __call__(self, ids: Array, segment_ids: Array, train: bool = False) -> Array:
        length = ids.shape[-1]
        if length > self.cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} > max_position_embeddings "
                f"{self.cfg.max_position_embeddings}"
            )
        x = self.word_embeddings(ids)
        x = (
            x
            + jnp.asarray(self.position_embeddings)[:length]
            + jnp.asarray(self.token_type_embeddings)[segment_ids]
        )
        x = self.LayerNorm(x).astype(self.cfg.compute_dtype)
        return self.dropout(x, deterministic=not train)


class SelfAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array, bias: Array, train: bool = False) -> Array:
        c = self.cfg
        head_dim = c.hidden_size // c.num_heads

        def proj(name):
            return nn.DenseGeneral(
                (c.num_heads, head_dim),
                dtype=c.compute_dtype,
                name=name,
                kernel_init=_init(("embed", "heads", "kv")),
                bias_init=_zeros(("heads", "kv")),
            )(x)

        # [B, heads, L, head_dim]: heads-major batched matmuls run ~1.6x faster on XLA:CPU
        # than contracting the [B, L, heads, head_dim] layout directly (measured).
        q, k, v = (proj(n).transpose(0, 2, 1, 3) for n in ("query", "key", "value"))
        q = q * jnp.asarray(1.0 / np.sqrt(head_dim), q.dtype)  # scale [B,h,L,d], not [B,h,L,L]
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(c.compute_dtype)
        probs = Dropout(c.dropout)(probs, deterministic=not train)
        ctx = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3)  # [B, L, heads, hd]
        return nn.DenseGeneral(
            c.hidden_size,
            axis=(-2, -1),
            dtype=c.compute_dtype,
            name="output_dense",
            kernel_init=_init(("heads", "kv", "embed")),
            bias_init=_zeros(("embed",)),
        )(ctx)


class TransformerLayer(nn.Module):
    """Post-LayerNorm BERT layer."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array, bias: Array, train: bool = False) -> Array:
        c = self.cfg
        drop = Dropout(c.dropout)
        a = drop(SelfAttention(c, name="attention")(x, bias, train), deterministic=not train)
        x = layer_norm(c, "attention_LayerNorm")(x + a).astype(c.compute_dtype)
        h = dense(c.intermediate_size, ("embed", "mlp"), c, "intermediate")(x)
        h = activation(c.hidden_act)(h)
        h = drop(dense(c.hidden_size, ("mlp", "embed"), c, "output")(h), deterministic=not train)
        return layer_norm(c, "output_LayerNorm")(x + h).astype(c.compute_dtype)


class BertEncoder(nn.Module):
    """BERT: embeddings + post-LN layers (+ optional tanh pooler over [CLS])."""

    cfg: ModelConfig
    add_pooler: bool = False

    def setup(self):
        c = self.cfg
        self.embeddings = Embeddings(c)
        layer_cls = nn.remat(TransformerLayer, static_argnums=(3,)) if c.remat else TransformerLayer
        self.layers = [layer_cls(c, name=f"layer_{i}") for i in range(c.num_layers)]
        if self.add_pooler:
            self.pooler = dense(c.hidden_size, ("embed", "embed_out"), c, "pooler")

    def __call__(self, ids: Array, segment_ids: Array, mask: Array, train: bool = False):
        """ids, segment_ids, mask: [B, L] -> (hidden [B, L, H], pooled [B, H] or None).

        train=True applies dropout (config.model.dropout; needs a 'dropout' rng)."""
        x = self.embeddings(ids, segment_ids, train)
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        for layer in self.layers:
            x = layer(x, bias, train)
        pooled = jnp.tanh(self.pooler(x[:, 0])) if self.add_pooler else None
        return x, pooled


class Embedder(nn.Module):
    """REALM embedder: pooled [CLS] -> dense(proj_size) -> LayerNorm (-> dropout in training,
    `proj_dropout`, as ORQA's ict_model.py: rate 0.1 after the projection's LayerNorm; the
    REALM release embeds with that ICT module). Returns [B, proj]."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        self.bert = BertEncoder(c, add_pooler=True)
        self.projection = dense(c.proj_size, ("embed", "proj"), c, "projection")
        self.projection_LayerNorm = layer_norm(c, "projection_LayerNorm", axis_name="proj")
        self.projection_dropout = Dropout(c.proj_dropout)

    def __call__(self, ids: Array, segment_ids: Array, mask: Array, train: bool = False) -> Array:
        _, pooled = self.bert(ids, segment_ids, mask, train)
        emb = self.projection_LayerNorm(self.projection(pooled)).astype(jnp.float32)
        return self.projection_dropout(emb, deterministic=not train)


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


class SpanHead(nn.Module):
    """ORQA span scorer: start/end projections summed per span, ReLU, LayerNorm, scalar."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h: Array, block_mask: Array) -> tuple[Array, np.ndarray, np.ndarray]:
        """h [N, L, H], block_mask [N, L] -> (logits [N, S], starts [S], ends [S])."""
        c = self.cfg
        proj = dense(2 * c.span_hidden_size, ("embed", "mlp"), c, "dense_intermediate")(h)
        start_p, end_p = jnp.split(proj, 2, axis=-1)
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
        return self.query_embedder(ids, segment_ids, mask, train)

    def embed_doc(self, ids, segment_ids, mask, train: bool = False):
        return self._doc()(ids, segment_ids, mask, train)

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
        return self.query_embedder(ids, segment_ids, mask, train)

    def embed_doc(self, ids, segment_ids, mask, train: bool = False):
        doc = self.query_embedder if self.cfg.share_embedders else self.doc_embedder
        return doc(ids, segment_ids, mask, train)

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
