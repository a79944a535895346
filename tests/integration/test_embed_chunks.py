"""The refresh's corpus embedding (embedding.embed_blocks_fn) in chunks that do not divide a
device's rows: each device's last chunk is padded with zero rows (embedded, then dropped),
and every row equals the document embedder applied to the whole table at once (the
reference)."""

import jax
import numpy as np

from realm_jax import sharding
from realm_jax.index import embedding
from realm_jax.pretrain import step as pretrain_step
from tests.support.realm_fixtures import synthetic_index, tiny_config


def test_chunks_that_do_not_divide_the_rows_embed_every_row_once():
    config = tiny_config()
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
    model, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    _, tokens = synthetic_index(config)  # 61 blocks: 64 rows padded, 16 a device
    _, t = embedding.pad_index(None, tokens, mesh)
    params = sharding.to_host(state.params)
    want = np.asarray(embedding.embed_block_tokens(model, params, np.asarray(t, np.int32)))
    for chunk in (5, 16, 64):  # 16 rows a device: 4 chunks (the last padded), 1, 1
        got = embedding.embed_blocks_fn(model, mesh, chunk)(
            state.params, sharding.put_rows(t, mesh)
        )
        assert got.sharding.is_equivalent_to(sharding.rows_sharding(mesh), 2)
        np.testing.assert_allclose(np.asarray(jax.device_get(got)), want, atol=2e-5, err_msg=chunk)


def test_a_prime_row_count_still_embeds_full_chunks():
    """61 rows on one device in chunks of 16: 4 calls, not 61 of one row (a chunk that had to
    divide the rows fell to 1 here; at 13.35M blocks on 64 devices, to 4 of 512)."""
    from realm_jax import hlo_cost

    config = tiny_config()
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    model, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    _, tokens = synthetic_index(config)
    t = sharding.put_rows(np.asarray(tokens), mesh)
    fn = embedding.embed_blocks_fn(model, mesh, 16)
    text = fn.lower(state.params, t).compile().as_text()
    assert sorted(hlo_cost.loop_multipliers(text)[2].values())[-1:] == [4]
