"""The corpus on device: block token ids row-sharded over every device (padded so each holds
the same number; uint16 when the vocabulary fits, token_dtype), and the jitted function that
embeds them all with live parameters."""

from __future__ import annotations

import time

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


# A long pass over the corpus (the frozen index, an in-process refresh) runs as this many jitted
# calls at most, waited for one by one: its progress and ETA are known after each.
PROGRESS_PARTS = 20


def _parts_plan(n: int, n_dev: int, batch_size: int, parts: int):
    """(chunk, rows a part, parts) of a pass over n rows on n_dev devices in `parts` calls of
    whole chunks (embed_blocks_fn's: batch_size rows a device), None for one call (a device
    holds one chunk). A part's rows never exceed a device's: the last part may be moved back
    to overlap the one before (its rows embedded twice, with the same params)."""
    per_dev = n // n_dev
    chunk = min(batch_size, per_dev)
    steps = -(-per_dev // chunk) if chunk else 0
    if parts < 2 or steps < 2:
        return None
    size = -(-steps // parts) * chunk  # <= (steps - 1) * chunk <= per_dev
    return chunk, size, -(-per_dev // size)


def embed_blocks_in_parts_fn(model, mesh: Mesh, batch_size: int, dtype=None, parts=PROGRESS_PARTS):
    """embed_blocks_fn's pass (the same chunks of batch_size rows a device, so the same
    embeddings) as up to `parts` jitted calls: (params, tokens [N, Lb], on_part=None) ->
    embeddings [N, D] row-sharded (in `dtype` when given). Call j embeds the next rows of every
    device's own rows into the result (donated from call to call); with on_part, each call is
    waited for and on_part(fraction done) called after it (the only host syncs), without, the
    calls are only dispatched. A table of one chunk a device: embed_blocks_fn's one call."""
    whole = embed_blocks_fn(model, mesh, batch_size, dtype)
    rows = sharding.rows_sharding(mesh)
    n_dev = mesh.devices.size

    def part(params, tokens, emb, j):
        n = tokens.shape[0]
        per_dev = n // n_dev
        chunk, size, _ = _parts_plan(n, n_dev, batch_size, parts)
        start = jnp.minimum(j * size, per_dev - size)
        piece = jax.lax.dynamic_slice_in_dim(tokens.reshape(n_dev, per_dev, -1), start, size, 1)
        return _embed_rows_into(model, params, piece, emb, start, chunk, rows)

    part_fn = sharding.traced_in_mesh(jax.jit(part, out_shardings=rows, donate_argnums=2), mesh)

    def embed(params, tokens, on_part=None):
        plan = _parts_plan(tokens.shape[0], n_dev, batch_size, parts)
        if plan is None:
            out = whole(params, tokens)
            if on_part is not None:
                out.block_until_ready()
                on_part(1.0)
            return out
        row = jax.ShapeDtypeStruct((1, tokens.shape[1]), tokens.dtype)
        spec = jax.eval_shape(lambda p, t: embed_block_tokens(model, p, t), params, row)
        shape, dt = (tokens.shape[0], spec.shape[1]), dtype or spec.dtype
        emb = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=rows)()
        count = plan[2]
        for j in range(count):
            emb = part_fn(params, tokens, emb, jnp.int32(j))
            if on_part is not None:
                emb.block_until_ready()
                on_part((j + 1) / count)
        return emb

    return embed


def duration(seconds: float) -> str:
    """A duration for a progress line: 45 s, 3 min 05 s, 1 h 02 min."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """on_part for embed_blocks_in_parts_fn: a log line with the fraction done and the ETA at
    each further 10% or every 30 s, whichever comes first; none in a pass's first 10 s (a
    short pass logs only its caller's total). The ETA is from the rate after the first part
    (which includes the compilation)."""

    def __init__(self, logger, what: str, num_blocks: int, every_s=30.0, quiet_s=10.0):
        self.log, self.what, self.num_blocks = logger, what, num_blocks
        self.every_s, self.quiet_s = every_s, quiet_s
        self.t0 = self.last_t = time.perf_counter()
        self.last_f, self.first = 0.0, None  # (time, fraction) after the first part

    def __call__(self, fraction: float) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, fraction)
        if fraction >= 1.0 or now - self.t0 < self.quiet_s:
            return
        if fraction - self.last_f < 0.1 - 1e-9 and now - self.last_t < self.every_s:
            return
        t1, f1 = self.first
        rate = (fraction - f1) / (now - t1) if fraction > f1 and now > t1 else 0.0
        rate = rate or fraction / (now - self.t0)
        self.log.info(
            "%s: %d%% of %d blocks embedded in %s, ETA %s",
            self.what,
            int(100 * fraction),
            self.num_blocks,
            duration(now - self.t0),
            duration((1.0 - fraction) / rate),
        )
        self.last_t, self.last_f = now, fraction


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
        return _embed_rows_into(model, params, piece, emb, start, chunk, rows)

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


def _embed_rows_into(model, params, piece, emb, start, chunk, rows):
    """Embed `piece` [n_dev, size, Lb] (each device's `size` rows from its row `start`) in a
    scan of [n_dev * chunk] calls and write the embeddings into `emb` [n, D] at those rows (the
    step embed_blocks_fn's slices and embed_blocks_in_parts_fn's parts share)."""
    n_dev, size = piece.shape[0], piece.shape[1]
    n = emb.shape[0]
    per_dev = n // n_dev
    t = piece.reshape(n_dev, size // chunk, chunk, -1).transpose(1, 0, 2, 3)

    def one(_, tc):  # tc [n_dev, chunk, Lb]
        flat = jax.lax.with_sharding_constraint(tc.reshape(n_dev * chunk, -1), rows)
        e = embed_block_tokens(model, params, flat).astype(emb.dtype)
        return None, e.reshape(n_dev, chunk, -1)

    _, new = jax.lax.scan(one, None, t)  # [size // chunk, n_dev, chunk, D]
    new = new.transpose(1, 0, 2, 3).reshape(n_dev, size, -1)
    out = jax.lax.dynamic_update_slice_in_dim(emb.reshape(n_dev, per_dev, -1), new, start, 1)
    return out.reshape(n, -1)
