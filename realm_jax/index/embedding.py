"""The corpus on device: block token ids row-sharded over every device (padded so each holds
the same number; uint16 when the vocabulary fits, token_dtype), and the jitted function that
embeds them all with live parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh

from realm_jax import checkpoint, sharding
from realm_jax.model.inputs import block_segments, dropout_kwargs, init_inputs, joint_len
from realm_jax.model.realm import realm_model


def embed_block_tokens(model, params, tokens, rng=None):
    """Document-embedder output for block token ids [N, Lb] -> [N, D] (segments and mask
    derived from the tokens); dropout when an rng is given. Ids of any integer dtype (a uint16
    table's rows): cast to int32 here, for the rows embedded only."""
    tokens = tokens.astype(jnp.int32)
    return model.apply(
        {"params": params},
        tokens,
        block_segments(tokens),
        (tokens != 0).astype(jnp.int32),
        method="embed_doc",  # RealmModel's or RetrieverModel's
        **dropout_kwargs(rng, 1),
    )


def embed_query_tokens(model, params, ids, rng=None):
    """Query-embedder output for query token ids [B, Lq] ([CLS] x [SEP], zero-padded) ->
    [B, D] (one segment, mask from the ids); dropout when an rng is given."""
    return model.apply(
        {"params": params},
        ids,
        jnp.zeros_like(ids),
        (ids != 0).astype(jnp.int32),
        method="embed_query",  # RealmModel's or RetrieverModel's
        **dropout_kwargs(rng, 0),
    )


def embed_blocks_fn(model, mesh: Mesh, batch_size: int, dtype=None):
    """A jitted function embedding every block of a row-sharded token table with live params.

    (params, tokens [N, Lb]) -> embeddings [N, D] sharded like tokens (in `dtype` when given:
    index_dtype's bfloat16 halves the index). Used by the in-process refresh and the refresh
    job. Blocks are embedded in chunks of batch_size rows per device.
    """
    rows = sharding.rows_sharding(mesh)

    def embed(params, tokens):
        # Each device walks its own rows `chunk` at a time, its last chunk padded with zero
        # rows (embedded, then dropped): a chunk that had to divide the rows a device holds
        # fell to 4 blocks a call at 13.35M blocks on 64 devices (52,163 is prime; plan's
        # roofline, issue 58). The scan's xs keep each chunk's lookups vocabulary-parallel.
        n_dev = mesh.devices.size
        n = tokens.shape[0]
        per_dev = n // n_dev
        chunk = min(batch_size, per_dev)
        steps = -(-per_dev // chunk)
        t = tokens.reshape(n_dev, per_dev, -1)
        t = jnp.pad(t, ((0, 0), (0, steps * chunk - per_dev), (0, 0)))  # local to each device
        t = t.reshape(n_dev, steps, chunk, -1).transpose(1, 0, 2, 3)  # [steps, n_dev, chunk, Lb]

        def one(_, tc):  # tc [n_dev, chunk, Lb]
            flat = tc.reshape(n_dev * chunk, -1)
            flat = jax.lax.with_sharding_constraint(flat, rows)
            e = embed_block_tokens(model, params, flat)
            e = e if dtype is None else e.astype(dtype)
            return None, e.reshape(n_dev, chunk, -1)

        _, out = jax.lax.scan(one, None, t)  # [steps, n_dev, chunk, D]
        out = out.transpose(1, 0, 2, 3).reshape(n_dev, steps * chunk, -1)[:, :per_dev]
        return out.reshape(n, -1)

    return sharding.traced_in_mesh(jax.jit(embed, out_shardings=rows), mesh)


def slice_rows(per_device: int, every: int, j: int) -> tuple[int, int]:
    """(first row, row count) of slice j of `every` in each device's `per_device` rows of the
    index: ceil(per_device / every) rows a slice, the last slices moved back to end at the
    last row (so they may overlap the one before: a row embedded twice keeps the newer).
    slice_embed_fn's rule, for a reader of its output (tests, docs)."""
    size = max(1, -(-per_device // every))
    size = min(size, per_device)
    return min(j * size, per_device - size), size


def slice_embed_fn(model, mesh: Mesh, every: int, batch_size: int = 0):
    """A jitted function re-embedding one slice of the index on every device (the amortised
    refresh, refresh.mode=amortized): (params, tokens [N, Lb], emb [N, D], j) -> emb with
    rows slice_rows(N / devices, every, j) of each device's own rows re-embedded with
    `params`. Each device embeds only rows it holds, so there is no cross-device traffic; after
    `every` calls (j = 0 .. every-1) every row is new. A slice is embedded batch_size rows
    per device at a time (0: all at once), as embed_blocks_fn does."""
    rows = sharding.rows_sharding(mesh)

    def embed(params, tokens, emb, j):
        n_dev = mesh.devices.size
        n = tokens.shape[0]
        per_dev = n // n_dev
        size = slice_rows(per_dev, every, 0)[1]
        start = jnp.minimum(j * size, per_dev - size)
        piece = jax.lax.dynamic_slice_in_dim(tokens.reshape(n_dev, per_dev, -1), start, size, 1)
        chunk = min(batch_size or size, size)
        while size % chunk:
            chunk -= 1
        t = piece.reshape(n_dev, size // chunk, chunk, -1).transpose(1, 0, 2, 3)

        def one(_, tc):  # tc [n_dev, chunk, Lb]
            flat = jax.lax.with_sharding_constraint(tc.reshape(n_dev * chunk, -1), rows)
            e = embed_block_tokens(model, params, flat).astype(emb.dtype)
            return None, e.reshape(n_dev, chunk, -1)

        _, new = jax.lax.scan(one, None, t)  # [size // chunk, n_dev, chunk, D]
        new = new.transpose(1, 0, 2, 3).reshape(n_dev, size, -1)
        out = jax.lax.dynamic_update_slice_in_dim(emb.reshape(n_dev, per_dev, -1), new, start, 1)
        return out.reshape(n, -1)

    return sharding.traced_in_mesh(jax.jit(embed, out_shardings=rows), mesh)


# The largest vocabulary whose ids fit the 16-bit token table (ids 0 .. 65535).
UINT16_VOCAB = 65536
# mesh.index_dtype's choices: how the block embeddings are held on device.
INDEX_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def token_dtype(vocab_size: int):
    """The token table's dtype for ids below vocab_size: uint16 (2 bytes an id: 7.7 GB for
    13.35M x 288 blocks) when they fit, else int32. Fetched rows come back int32."""
    return np.uint16 if int(vocab_size) <= UINT16_VOCAB else np.int32


def index_dtype(config):
    """The block embeddings' dtype on device (mesh.index_dtype: float32 or bfloat16; scores
    are summed in float32 either way, ops/mips.py)."""
    name = str(config.mesh.get("index_dtype", "float32"))
    if name not in INDEX_DTYPES:
        raise ValueError(f"mesh.index_dtype must be one of {sorted(INDEX_DTYPES)}, got {name!r}")
    return INDEX_DTYPES[name]


def pad_index(emb: np.ndarray | None, tokens: np.ndarray, mesh: Mesh, emb_dtype=np.float32):
    """(embeddings [N, D] in emb_dtype or None, tokens [N, Lb] in token_dtype of their largest
    id) padded with zero rows so every device holds the same number; padded rows are never
    retrieved (num_valid). Every process holds the whole table, so all choose one dtype."""
    tokens = np.asarray(tokens)
    top = int(tokens.max()) + 1 if tokens.size else 1
    tok = sharding.pad_rows(tokens.astype(token_dtype(top)), mesh)
    return (None if emb is None else sharding.pad_rows(np.asarray(emb, emb_dtype), mesh)), tok


def abstract_params(config, mesh: Mesh, name: str):
    """(model, ShapeDtypeStructs of params[name] carrying their mesh shardings): the target of
    a partial restore of one network (the refresher's document embedder, `ask`'s query
    embedder), computed without initialising anything."""
    model = realm_model(config.model)
    d = config.data
    inputs = init_inputs(d.query_len, d.block_len, joint_len(config))
    boxed = jax.eval_shape(lambda r: model.init(r, *inputs)["params"], jax.random.key(0))
    shard = sharding.logical_shardings(mesh, boxed, config.mesh.get("fsdp", False))
    return model, checkpoint.abstract_like(nn.meta.unbox(boxed)[name], shard[name])
