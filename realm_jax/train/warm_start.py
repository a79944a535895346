"""Initial weights for a fresh run (a resume restores its own): HuggingFace folders for the
embedders and the reader, and an ICT run's checkpoint for both embedders. Written once for
every task (resume > warm start > scratch)."""

from __future__ import annotations

import logging

import jax
import ml_collections
from flax import linen as nn

from realm_jax import checkpoint, fs, sharding
from realm_jax import config as config_lib
from realm_jax import workdir as paths
from realm_jax.index.embedding import abstract_params
from realm_jax.interop import hf_import as weights
from realm_jax.interop import sentence_embedder
from realm_jax.model.bert import ModelConfig
from realm_jax.model.inputs import dummy_input
from realm_jax.model.realm import RetrieverModel, doc_embedder_name

log = logging.getLogger("realm_jax.train")


def params_hook(config, reader: bool = True, span_head: bool = False):
    """Weight import named in config.model: HF folders for the embedders and the reader, then
    an ICT checkpoint for both embedders (None when nothing to import). Resuming a run
    restores its own weights instead (the loop calls this only for a fresh run)."""
    m = config.model
    retriever = m.get("init_retriever_from", "")
    if not (
        m.init_embedder_from
        or retriever
        or (reader and m.init_reader_from)
        or m.init_embedders_from_ict
        or (reader and m.init_from_realm)
    ):
        log.warning(
            "no weights to start from (model.init_embedder_from, init_reader_from, "
            "init_embedders_from_ict, init_from_realm all empty): every network starts from "
            "random weights (train.seed=%s). Fine for the machinery (smoke, benchmarks); a "
            "model from random weights did not learn to retrieve here (docs/tutorial.md): start "
            "from BERT, e.g. --config.model.init_embedder_from=%s "
            "--config.model.init_reader_from=%s",
            config.train.seed, config_lib.BERT_TINY, config_lib.BERT_TINY,
        )  # fmt: skip
        return None
    ecfg = ModelConfig.from_config(m, "embedder")
    rcfg = ModelConfig.from_config(m, "reader")
    # A wrong path fails now, before the model is built and compiled.
    for path in (m.init_embedder_from, m.init_reader_from if reader else ""):
        if path:
            weights.check_folder(path)
    # a later run's checkpoint replaces the sentence embedder's weights (same architecture)
    later = m.init_embedders_from_ict or (reader and m.init_from_realm)
    if retriever and not later:
        weights.check_folder(retriever)
    elif retriever:
        log.info(
            "model.init_retriever_from=%s: its architecture and retrieval fields; the weights "
            "come from %s",
            retriever,
            "model.init_embedders_from_ict" if m.init_embedders_from_ict else "init_from_realm",
        )
    if m.init_embedders_from_ict:
        mgr = _read_only_manager(
            m.init_embedders_from_ict, "model.init_embedders_from_ict", "`realm-jax ict`"
        )
        check_retriever_matches(mgr, config, "model.init_embedders_from_ict")
    if reader and m.init_from_realm:
        mgr = _read_only_manager(
            m.init_from_realm, "model.init_from_realm", "`realm-jax train` (REALM)"
        )
        check_retriever_matches(mgr, config, "model.init_from_realm")
        for field, path in (
            ("init_reader_from", m.init_reader_from),
            ("init_embedder_from", m.init_embedder_from),
        ):
            if path:  # e.g. the squad recipe's bert-tiny folders, inherited by an override
                log.warning(
                    "model.%s=%s replaces networks loaded from model.init_from_realm=%s "
                    "(set model.%s= to keep them)",
                    field,
                    path,
                    m.init_from_realm,
                    field,
                )

    def hook(params):
        params = dict(params)
        if reader and m.init_from_realm:  # first: the folders below may replace a network
            for name, loaded in realm_params(m.init_from_realm, config).items():
                params[name] = weights.merge_params(params[name], loaded, name)
        if retriever and not later:
            loaded = sentence_embedder.bert_params(retriever, ecfg)
            for name in {"query_embedder", doc_embedder_name(ecfg)}:
                params[name] = weights.merge_params(params[name], loaded, name)
            log.info("imported both embedders from the sentence embedder %s", retriever)
        if m.init_embedder_from:
            loaded, fields = weights.embedder_params(m.init_embedder_from)
            weights.check_fields(ecfg, fields, m.init_embedder_from, "config.model.embedder")
            for name in {"query_embedder", doc_embedder_name(ecfg)}:
                params[name] = weights.merge_params(params[name], loaded, name)
            log.info("imported both embedders from %s", m.init_embedder_from)
        if reader and m.init_reader_from:
            # the span head comes too where the folder has one (a RealmReader) and the task
            # uses it (fine-tuning); pre-training's is never trained
            loaded, fields = weights.reader_params(
                m.init_reader_from, with_span_head=None if span_head else False
            )
            weights.check_fields(rcfg, fields, m.init_reader_from, "config.model.reader")
            params["reader"] = weights.merge_params(params["reader"], loaded, "reader")
            log.info("imported the reader from %s", m.init_reader_from)
        if m.init_embedders_from_ict:
            ict = ict_embedder_params(m.init_embedders_from_ict, ecfg)
            for name in {"query_embedder", doc_embedder_name(ecfg)}:
                src = ict.get(name, ict["query_embedder"])
                params[name] = weights.merge_params(params[name], src, name)
        return params

    return hook


# config.model fields the embedders' weights must have been trained with (the checkpoint's
# fingerprint, train/loop.py), with their values where an older fingerprint lacks them
_RETRIEVER_DEFAULTS = {
    "model.embedder_pooling": "realm",
    "model.embedder_normalize": False,
    "model.query_prefix": "",
    "model.doc_prefix": "",
    "model.retrieval_scale": 1.0,
}
_EMBEDDER_SHAPE = ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                   "max_position_embeddings", "type_vocab_size")  # fmt: skip


def check_retriever_matches(mgr, config, field: str) -> None:
    """A ConfigError naming each difference when the newest checkpoint of `mgr` (a warm start's
    ICT or REALM run) trained its embedders with another architecture, pooling, normalisation,
    prefixes or score scale than this run's config (e.g. an ICT run started from a sentence
    embedder, model.init_retriever_from, and a REALM run not told so): its weights would be
    read wrongly or not at all. A checkpoint without a fingerprint is not checked."""
    saved = checkpoint.read_fingerprint(mgr, mgr.latest_step())
    if not saved:
        return
    m = config.model
    now = {f"model.embedder.{k}": m.embedder.get(k) for k in _EMBEDDER_SHAPE}
    now["model.proj_size"] = m.proj_size
    now.update({k: m.get(k.split(".", 1)[1], v) for k, v in _RETRIEVER_DEFAULTS.items()})
    bad = []
    for key, value in now.items():
        theirs = saved.get(key, _RETRIEVER_DEFAULTS.get(key, value))
        if theirs != value:
            bad.append(f"{key}: that run {theirs!r}, this run {value!r}")
    if bad:
        hint = (
            "give this run the model.init_retriever_from that run started from"
            if saved.get("model.embedder_pooling", "realm") != "realm"
            or m.get("embedder_pooling", "realm") != "realm"
            else "give this run that run's model.embedder.* fields"
        )
        raise config_lib.ConfigError(
            f"{field}={getattr(mgr, 'directory', '')}: its embedders do not match this run's "
            f"config ({'; '.join(bad)}): {hint}"
        )


def realm_params(path: str, config) -> dict:
    """{network name: host params} of all three networks in a REALM pre-training workdir's
    newest checkpoint (fine-tuning's warm start). Shapes come from this run's config, so the
    architectures must match."""
    mgr = _read_only_manager(path, "model.init_from_realm", "`realm-jax train` (REALM)")
    step = mgr.latest_step()
    one = ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (1, 1)})
    mesh = sharding.make_mesh(one, devices=jax.local_devices()[:1])
    ecfg = ModelConfig.from_config(config.model, "embedder")
    out = {}
    for name in dict.fromkeys(("query_embedder", doc_embedder_name(ecfg), "reader")):
        _, target = abstract_params(config, mesh, name)
        # pre-training never trains the span head: it starts afresh, any size (ORQA too),
        # unless the source is a fine-tuning run whose trained head is asked for
        if name == "reader" and not config.model.get("init_span_head_from_realm", False):
            target = {k: v for k, v in target.items() if k != "span"}
        out[name] = sharding.to_host(checkpoint.restore_params_subtree(mgr, step, name, target))
    span = " (with its span head)" if config.model.get("init_span_head_from_realm", False) else ""
    log.info("warm start: all three networks%s from checkpoint %d in %s", span, step, path)
    return out


def _read_only_manager(path: str, field: str, what: str):
    """A read-only manager over a run's checkpoints (a local or gs:// workdir: orbax reads
    either); a clear error when the bucket, the folder or a checkpoint is missing."""
    fs.check_buckets([path])
    if not fs.isdir(paths.checkpoint_dir(path)):
        raise FileNotFoundError(
            f"{field}={path!r}: no checkpoints folder there (give the workdir of a {what} run)"
        )
    mgr = checkpoint.manager(path, with_data=False, read_only=True)
    if not mgr.all_steps():
        raise FileNotFoundError(f"{field}={path!r}: no checkpoint yet")
    return mgr


def ict_embedder_params(path: str, ecfg) -> dict:
    """{network name: host params} of both embedders from an ICT workdir's newest checkpoint
    (ICT trains the same Embedder modules under the same names; an ICT run with shared
    embedders gives its one embedder to both)."""
    mgr = _read_only_manager(path, "model.init_embedders_from_ict", "`realm-jax ict`")
    step = mgr.latest_step()
    names = restore_embedders(mgr, step, ecfg)
    log.info("warm start: both embedders from ICT checkpoint %d in %s", step, path)
    return names


def restore_embedders(mgr, step: int, ecfg: ModelConfig) -> dict:
    """{name: host params} of the embedders in checkpoint `step` (a REALM warm start)."""

    one = ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (1, 1)})
    mesh = sharding.make_mesh(one, devices=jax.local_devices()[:1])
    model = RetrieverModel(ecfg)

    t = dummy_input(8)  # parameter shapes do not depend on the input length
    boxed = jax.eval_shape(lambda r: model.init(r, t, t)["params"], jax.random.key(0))
    shard = sharding.logical_shardings(mesh, boxed)
    out = {}
    for name in nn.meta.unbox(boxed):
        target = checkpoint.abstract_like(nn.meta.unbox(boxed)[name], shard[name])
        # shapes from this run's embedder config: it must match the ICT run's architecture
        out[name] = sharding.to_host(checkpoint.restore_params_subtree(mgr, step, name, target))
    return out
