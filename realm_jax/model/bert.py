"""BERT: the architecture config (`ModelConfig`), embeddings, post-LN layers, the encoder.

Parameter names follow HuggingFace's BERT layout so weight import is a readable table."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from realm_jax.model.layers import Dropout, _init, _zeros, activation, dense, layer_norm

Array = jax.Array


# config.model fields that are not part of one network's architecture.
_NOT_ARCHITECTURE = (
    "embedder",
    "reader",
    "init_embedder_from",
    "init_reader_from",
    "init_embedders_from_ict",
    "init_from_realm",
    "init_retriever_from",
    "init_span_head_from_realm",
)


EMBEDDER_POOLINGS = ("realm", "mean", "cls")


@functools.lru_cache(maxsize=16)
def _wordpiece_ids(text: str) -> tuple[int, ...]:
    if not text:
        return ()
    from realm_jax.tokenization import wordpieces

    return tuple(wordpieces([text])[0].ids)


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
    remat_policy: str = "nothing"
    dropout: float = 0.0
    proj_dropout: float = 0.0
    # The embedders' output (model/realm.py Embedder): "realm" = the pooler's tanh over [CLS],
    # dense(proj_size), LayerNorm (REALM's); "mean" = the masked mean of the last hidden states;
    # "cls" = the last hidden state at [CLS] (no pooler, no projection: D = hidden_size).
    embedder_pooling: str = "realm"
    embedder_normalize: bool = False  # L2-normalise the embedding (a cosine retriever)
    query_prefix: str = ""  # text put before every query (as its wordpieces, after [CLS])
    doc_prefix: str = ""  # text put before every block
    retrieval_scale: float = 1.0  # the retrieval score is retrieval_scale x <query, block>

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
        if cfg.embedder_pooling not in EMBEDDER_POOLINGS:
            raise ModelConfigError(
                f"config.model.embedder_pooling={cfg.embedder_pooling!r}: must be one of "
                f"{', '.join(EMBEDDER_POOLINGS)}"
            )
        if part == "embedder" and cfg.embedder_pooling != "realm":
            if cfg.proj_size != cfg.hidden_size:
                raise ModelConfigError(
                    f"config.model.embedder_pooling={cfg.embedder_pooling!r} embeds with the "
                    f"hidden states (no projection): config.model.proj_size ({cfg.proj_size}) "
                    f"must equal config.model.embedder.hidden_size ({cfg.hidden_size})"
                )
        if cfg.hidden_size % cfg.num_heads:
            raise ModelConfigError(
                f"config.model.{part}: hidden_size {cfg.hidden_size} is not divisible by "
                f"num_heads {cfg.num_heads}"
            )
        return cfg

    def prefix_ids(self, role: str) -> tuple[int, ...]:
        """The wordpiece ids of query_prefix (role "query") or doc_prefix ("doc")."""
        text = self.query_prefix if role == "query" else self.doc_prefix
        return _wordpiece_ids(text)

    @property
    def compute_dtype(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        return jnp.dtype(self.dtype)


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


# What a rematerialised layer keeps for its backward pass (config model.remat_policy):
# "nothing" its input only; "dots" also the outputs of its weight matmuls (projections and
# feed-forward), recomputing attention, activations and LayerNorms.
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def constrain_batch(x: Array) -> Array:
    """Keep activations [B, ...] split by batch over the ambient mesh's 'data' axis (set by
    `sharding.traced_in_mesh`; none outside it). With FSDP the weights' hidden dimension is
    split over 'data' too, and without this XLA's propagation split activations that way
    and replicated the batch: the base step's temporaries grew 6x (`plan`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "data" not in mesh.axis_names or x.shape[0] % mesh.shape["data"]:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec("data"))


class BertEncoder(nn.Module):
    """BERT: embeddings + post-LN layers (+ optional tanh pooler over [CLS])."""

    cfg: ModelConfig
    add_pooler: bool = False

    def setup(self):
        c = self.cfg
        self.embeddings = Embeddings(c)
        self.layers = [TransformerLayer(c, name=f"layer_{i}") for i in range(c.num_layers)]
        if self.add_pooler:
            self.pooler = dense(c.hidden_size, ("embed", "embed_out"), c, "pooler")

    def __call__(self, ids: Array, segment_ids: Array, mask: Array, train: bool = False):
        """ids, segment_ids, mask: [B, L] -> (hidden [B, L, H], pooled [B, H] or None).

        train=True applies dropout (config.model.dropout; needs a 'dropout' rng)."""
        x = constrain_batch(self.embeddings(ids, segment_ids, train))
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        if self.cfg.remat and not self.is_initializing():
            x = self._remat_layers(x, bias, train)
        else:
            for layer in self.layers:
                x = constrain_batch(layer(x, bias, train))
        pooled = jnp.tanh(self.pooler(x[:, 0])) if self.add_pooler else None
        return x, pooled

    def _remat_layers(self, x: Array, bias: Array, train: bool) -> Array:
        """The layers as one lax.scan over their stacked parameters, each step under
        jax.checkpoint: the backward pass recomputes one layer at a time inside the scan, so
        only the layers' inputs are kept. A loop of nn.remat layers did not do that on
        XLA:CPU, which drops remat's optimization barriers early and merges recomputation
        with the forward pass: the compiled temporaries of the 4 x 256 REALM step fell only
        3.35 -> 3.25 GB (memory_analysis), while XLA:TPU took the same loop from 1.52 to
        0.49 GB. The parameters keep their per-layer layout (checkpoints and weight import
        unchanged); stacking them costs one copy of the layer weights per call. With dropout,
        each layer's key is split from this module's 'dropout' stream: the masks differ from
        the plain path's draws (same rate, independent)."""
        layer = TransformerLayer(self.cfg, parent=None)
        use_dropout = train and self.cfg.dropout > 0
        n = self.cfg.num_layers

        policy = REMAT_POLICIES[self.cfg.remat_policy]

        @functools.partial(jax.checkpoint, prevent_cse=False, policy=policy)
        def one(h, params, key):
            rngs = {"dropout": key} if use_dropout else {}
            return constrain_batch(layer.apply({"params": params}, h, bias, train, rngs=rngs))

        params = self.variables["params"]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layer_{i}"] for i in range(n)])
        keys = jax.random.split(self.make_rng("dropout"), n) if use_dropout else None
        x, _ = jax.lax.scan(lambda h, xs: (one(h, *xs), None), x, (stacked, keys))
        return x
