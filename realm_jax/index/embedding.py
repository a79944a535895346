"""The corpus on device: block token ids row-sharded over every device (padded so each holds
the same number), and the jitted function that embeds them all with live parameters."""

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
    derived from the tokens); dropout when an rng is given."""
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


def embed_blocks_fn(model, mesh: Mesh, batch_size: int):
    """A jitted function embedding every block of a row-sharded token table with live params.

    (params, tokens [N, Lb]) -> embeddings [N, D] sharded like tokens. Used by the in-process
    refresh and the refresh job. Blocks are embedded in chunks of batch_size rows per device.
    """
    rows = sharding.rows_sharding(mesh)

    def embed(params, tokens):
        n_dev = mesh.devices.size
        n = tokens.shape[0]
        per_dev = n // n_dev
        chunk = min(batch_size, per_dev)
        while per_dev % chunk:
            chunk -= 1
        t = tokens.reshape(n_dev, per_dev // chunk, chunk, -1).transpose(1, 0, 2, 3)

        def one(_, tc):  # tc [n_dev, chunk, Lb]
            flat = tc.reshape(n_dev * chunk, -1)
            flat = jax.lax.with_sharding_constraint(flat, rows)
            e = embed_block_tokens(model, params, flat)
            return None, e.reshape(n_dev, chunk, -1)

        _, out = jax.lax.scan(one, None, t)  # [steps, n_dev, chunk, D]
        return out.transpose(1, 0, 2, 3).reshape(n, -1)

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


def pad_index(emb: np.ndarray | None, tokens: np.ndarray, mesh: Mesh):
    """(embeddings [N, D] float32 or None, tokens [N, Lb] int32) padded with zero rows so
    every device holds the same number; padded rows are never retrieved (num_valid)."""
    tok = sharding.pad_rows(np.asarray(tokens, np.int32), mesh)
    return (None if emb is None else sharding.pad_rows(np.asarray(emb, np.float32), mesh)), tok


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
