"""Separate embedder and reader architectures, each imported from its own HF folder."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import sharding
from realm_jax.index import embedding
from realm_jax.interop import hf_import as weights
from realm_jax.model import inputs
from realm_jax.pretrain import step as pretrain_step
from realm_jax.train import warm_start
from tests.conftest import shared_path
from tests.support.realm_fixtures import synthetic_batch, synthetic_index, tiny_config


def _arch(part, hidden, layers, heads, inter, act, pos=512):
    return [
        f"model.{part}.hidden_size={hidden}",
        f"model.{part}.num_layers={layers}",
        f"model.{part}.num_heads={heads}",
        f"model.{part}.intermediate_size={inter}",
        f"model.{part}.hidden_act={act}",
        f"model.{part}.max_position_embeddings={pos}",
    ]


@pytest.fixture(scope="module")
def imported():
    embedder = shared_path("reference", "tiny_realm", "embedder")  # RealmEmbedder 2 x 64
    reader = shared_path("models", "bert-tiny-mlm")  # BertForMaskedLM 2 x 128
    config = tiny_config(
        "model.vocab_size=30522",
        *_arch("embedder", 64, 2, 2, 128, "gelu_new"),
        *_arch("reader", 128, 2, 2, 512, "gelu"),
        f"model.init_embedder_from={embedder}",
        f"model.init_reader_from={reader}",
    )
    mesh = sharding.make_mesh(config.mesh)
    model, optimizer, state, shardings = pretrain_step.create_state(
        config, mesh, jax.random.key(0), warm_start.params_hook(config)
    )
    return config, mesh, model, optimizer, state, shardings, embedder, reader


def test_each_network_imports_its_own_folder(imported):
    config, _, model, _, state, _, embedder, reader = imported
    assert model.ecfg.hidden_size == 64 and model.cfg.hidden_size == 128
    _, emb_t = weights.read_hf_folder(embedder)
    _, rd_t = weights.read_hf_folder(reader)
    p = jax.device_get(state.params)
    for name in ("query_embedder", "doc_embedder"):
        got = p[name]["bert"]["embeddings"]["word_embeddings"]["embedding"]
        want = next(v for k, v in emb_t.items() if k.endswith("word_embeddings.weight"))
        np.testing.assert_array_equal(got, want)
    got = p["reader"]["bert"]["embeddings"]["word_embeddings"]["embedding"]
    want = next(v for k, v in rd_t.items() if k.endswith("word_embeddings.weight"))
    np.testing.assert_array_equal(got, want)


@pytest.mark.system  # a training run; CI: each network imports its own folder
def test_separate_architectures_train(imported):
    config, mesh, model, optimizer, state, shardings, _, _ = imported
    emb, tokens = synthetic_index(config)
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
    step = pretrain_step.compile_train_step(config, mesh, model, optimizer, shardings, len(emb))
    batch = sharding.global_batch(synthetic_batch(config), mesh)
    state, m1 = step(state, batch, *index, jnp.int32(0))
    _, m2 = step(state, batch, *index, jnp.int32(0))
    m1, m2 = jax.device_get((m1, m2))
    assert np.isfinite(m1["loss"]) and m2["loss"] < m1["loss"]
    for name in ("query_embedder", "doc_embedder", "reader"):
        assert m1[f"grad_norm/{name}"] > 0, name


def test_architecture_mismatch_names_the_field():
    reader = shared_path("models", "bert-tiny-mlm")
    config = tiny_config(
        "model.vocab_size=30522",
        *_arch("reader", 128, 2, 2, 512, "gelu_new"),  # the checkpoint says gelu
        f"model.init_reader_from={reader}",
    )
    mesh = sharding.make_mesh(config.mesh)
    with pytest.raises(weights.WeightImportError, match="config.model.reader: hidden_act"):
        pretrain_step.create_state(config, mesh, jax.random.key(0), warm_start.params_hook(config))


def test_vocab_must_match_between_networks():
    from realm_jax.model.bert import ModelConfig, ModelConfigError
    from realm_jax.model.realm import RealmModel

    model = RealmModel(ModelConfig(vocab_size=100), ModelConfig(vocab_size=200))
    init = functools.partial(model.init, jax.random.key(0), *inputs.init_inputs(4, 6, 9))
    with pytest.raises(ModelConfigError, match="vocab_size"):
        init()
