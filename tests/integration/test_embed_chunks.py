"""The refresh's corpus embedding (embedding.embed_blocks_fn) in chunks that do not divide a
device's rows: each device's last chunk is padded with zero rows (embedded, then dropped),
and every row equals the document embedder applied to the whole table at once (the
reference). The same pass in parts (embed_blocks_in_parts_fn), with its progress lines."""

import logging
import unittest.mock

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


def test_the_pass_in_parts_embeds_as_one_call_and_reports_its_progress(caplog):
    """embed_blocks_in_parts_fn (the frozen index, the in-process refresh): the same rows as
    embed_blocks_fn whatever the parts (the last moved back to overlap the one before), each
    part waited for and reported, and Progress's lines with their ETA."""
    config = tiny_config()
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
    model, _, state, _ = pretrain_step.create_state(config, mesh, jax.random.key(0))
    _, tokens = synthetic_index(config)  # 61 blocks: 16 rows a device
    _, t = embedding.pad_index(None, tokens, mesh)
    t = sharding.put_rows(t, mesh)
    want = np.asarray(jax.device_get(embedding.embed_blocks_fn(model, mesh, 3)(state.params, t)))
    for parts, calls in ((20, 6), (4, 3), (2, 2), (1, 1)):  # 6 chunks of 3 rows a device
        seen = []
        fn = embedding.embed_blocks_in_parts_fn(model, mesh, 3, parts=parts)
        got = fn(state.params, t, seen.append)
        assert seen == [(j + 1) / calls for j in range(calls)], (parts, seen)
        assert got.sharding.is_equivalent_to(sharding.rows_sharding(mesh), 2)
        np.testing.assert_allclose(np.asarray(jax.device_get(got)), want, atol=2e-5)
    assert embedding._parts_plan(64, 4, 64, 20) is None  # one chunk a device: one call

    clock = iter([0.0, 5.0, 12.0, 20.0, 31.0, 62.0, 70.0])  # t0, then after each part
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with unittest.mock.patch.object(embedding.time, "perf_counter", lambda: next(clock)):
            p = embedding.Progress(log, "the frozen index", 1000)
            for f in (0.05, 0.1, 0.15, 0.2, 0.25, 1.0):
                p(f)
    lines = [r.getMessage() for r in caplog.records if r.name == "test.progress"]
    # 5 s: quiet; 12 s: 10% done; 20 s: 15%, neither 10% more nor 30 s; 31 s: 20%, 10% more;
    # 62 s: 30 s since; 100%: the caller's total line. ETA: the rate after the first part
    # (5%, 5 s), e.g. at 31 s 0.8 / (0.15 / 26 s) = 139 s
    assert lines == [
        "the frozen index: 10% of 1000 blocks embedded in 12 s, ETA 2 min 06 s",
        "the frozen index: 20% of 1000 blocks embedded in 31 s, ETA 2 min 19 s",
        "the frozen index: 25% of 1000 blocks embedded in 1 min 02 s, ETA 3 min 34 s",
    ], lines
