"""Export realm-jax params as HuggingFace REALM folders (config.json + model.safetensors) under
the names transformers' `models.deprecated.realm` (4.57) loads:

  embedder/      RealmEmbedder: the query embedder
  doc_embedder/  RealmEmbedder: the document embedder (only when model.share_embedders=False)
  scorer/        RealmScorer: `query_embedder.*` + `embedder.*` (the document embedder)
  encoder/       RealmKnowledgeAugEncoder: the reader's BERT + MLM head
  reader/        RealmReader: the same + the `qa_outputs` span head
  openqa/        RealmForOpenQA: the query embedder, the reader and `block_emb` (the newest
                 published index, embedded by the document embedder)

What HuggingFace cannot represent, and the choices made for it:
- HF's RealmConfig holds ONE architecture. With different embedder and reader architectures
  (model.embedder.* vs model.reader.*), scorer/ and every single-network folder are exported
  each with its own config, and openqa/ (both in one model) is not written (said in the log).
- HF's RealmEmbedder is one network. With separate query and document embedders, embedder/ is
  the query embedder and doc_embedder/ the document one; scorer/ holds both, but
  `RealmScorer.from_pretrained(dir)` ties its query_embedder to its embedder: pass
  `query_embedder=RealmEmbedder(config)` to keep them apart.
- realm-jax ties the MLM decoder to the word embeddings: `cls.predictions.decoder.weight` is
  written as a copy of them. RealmEmbedder's unused MLM head (`cls.predictions.*`, never read
  by its forward) is written as that same tied head with a zero transform, and the reader's
  unused pooler as zeros, so HF reports no missing weights.
- `model.proj_dropout` (dropout after the projection, training only) has no HF field.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from realm_jax.interop.hf_import import CHECKED_FIELDS

# A network's architecture: config.model's model.bert.ModelConfig, read by attribute only (sizes,
# activation, dropout, span head), so this room, below model/, needs no import of it.
ModelConfig = Any


class ExportError(ValueError):
    """Params that HuggingFace's REALM classes cannot hold."""


def _linear(p: dict) -> dict[str, np.ndarray]:
    return {"weight": np.asarray(p["kernel"], np.float32).T, "bias": np.asarray(p["bias"])}


def _layer_norm(p: dict) -> dict[str, np.ndarray]:
    return {"weight": np.asarray(p["scale"]), "bias": np.asarray(p["bias"])}


def _put(out: dict, prefix: str, tensors: dict[str, np.ndarray]) -> None:
    for k, v in tensors.items():
        out[f"{prefix}.{k}"] = np.ascontiguousarray(np.asarray(v, np.float32))


def bert_tensors(bert: dict, cfg: ModelConfig, prefix: str = "realm.") -> dict[str, np.ndarray]:
    """A realm-jax BertEncoder's params -> HF RealmBertModel tensors (pooler zero if absent)."""
    out: dict[str, np.ndarray] = {}
    e = bert["embeddings"]
    _put(
        out,
        f"{prefix}embeddings",
        {
            "word_embeddings.weight": e["word_embeddings"]["embedding"],
            "position_embeddings.weight": e["position_embeddings"],
            "token_type_embeddings.weight": e["token_type_embeddings"],
        },
    )
    _put(out, f"{prefix}embeddings.LayerNorm", _layer_norm(e["LayerNorm"]))
    h = cfg.hidden_size
    for i in range(cfg.num_layers):
        layer, lp = bert[f"layer_{i}"], f"{prefix}encoder.layer.{i}"
        att = layer["attention"]
        for name in ("query", "key", "value"):
            kernel = np.asarray(att[name]["kernel"]).reshape(h, h)
            bias = np.asarray(att[name]["bias"]).reshape(h)
            _put(out, f"{lp}.attention.self.{name}", {"weight": kernel.T, "bias": bias})
        o = att["output_dense"]
        kernel = np.asarray(o["kernel"]).reshape(h, h)
        _put(out, f"{lp}.attention.output.dense", {"weight": kernel.T, "bias": o["bias"]})
        _put(out, f"{lp}.attention.output.LayerNorm", _layer_norm(layer["attention_LayerNorm"]))
        _put(out, f"{lp}.intermediate.dense", _linear(layer["intermediate"]))
        _put(out, f"{lp}.output.dense", _linear(layer["output"]))
        _put(out, f"{lp}.output.LayerNorm", _layer_norm(layer["output_LayerNorm"]))
    pooler = bert.get("pooler") or {"kernel": np.zeros((h, h)), "bias": np.zeros(h)}
    _put(out, f"{prefix}pooler.dense", _linear(pooler))
    return out


def _mlm_tensors(word: np.ndarray, mlm: dict | None, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """cls.predictions.*: the tied head (decoder = word embeddings); a zero transform when the
    network has none (RealmEmbedder's unused head)."""
    h = cfg.hidden_size
    if mlm is None:
        mlm = {
            "transform": {"kernel": np.zeros((h, h)), "bias": np.zeros(h)},
            "transform_LayerNorm": {"scale": np.ones(h), "bias": np.zeros(h)},
            "bias": np.zeros(cfg.vocab_size),
        }
    out: dict[str, np.ndarray] = {}
    _put(out, "cls.predictions.transform.dense", _linear(mlm["transform"]))
    _put(out, "cls.predictions.transform.LayerNorm", _layer_norm(mlm["transform_LayerNorm"]))
    _put(
        out,
        "cls.predictions",
        {"bias": mlm["bias"], "decoder.weight": word, "decoder.bias": mlm["bias"]},
    )
    return out


def embedder_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """An Embedder's params -> RealmEmbedder tensors."""
    if cfg.embedder_pooling != "realm":
        raise ExportError(
            f"the embedders pool with {cfg.embedder_pooling!r} (model.embedder_pooling, a "
            "sentence embedder's start: model.init_retriever_from), which HuggingFace's "
            "RealmEmbedder cannot express (it embeds with a pooler and a projection): such "
            "embedders are not exported"
        )
    if "projection" not in params:
        raise ExportError("the embedder has no retrieval projection")
    out = bert_tensors(params["bert"], cfg)
    _put(out, "cls.dense", _linear(params["projection"]))
    _put(out, "cls.LayerNorm", _layer_norm(params["projection_LayerNorm"]))
    word = params["bert"]["embeddings"]["word_embeddings"]["embedding"]
    out.update(_mlm_tensors(word, None, cfg))
    return out


def reader_tensors(params: dict, cfg: ModelConfig, span: bool) -> dict[str, np.ndarray]:
    """A Reader's params -> RealmKnowledgeAugEncoder tensors (+ RealmReader's qa_outputs)."""
    out = bert_tensors(params["bert"], cfg)
    word = params["bert"]["embeddings"]["word_embeddings"]["embedding"]
    out.update(_mlm_tensors(word, params["mlm"], cfg))
    if span:
        s = params["span"]
        _put(out, "qa_outputs.dense_intermediate", _linear(s["dense_intermediate"]))
        _put(out, "qa_outputs.layer_normalization", _layer_norm(s["layer_normalization"]))
        _put(out, "qa_outputs.dense_output", _linear(s["dense_output"]))
    return out


def _prefixed(prefix: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {prefix + k: v for k, v in tensors.items()}


def hf_config(cfg: ModelConfig, architecture: str, **extra) -> dict:
    """config.json of a RealmConfig for `architecture` with `cfg`'s architecture."""
    out = {
        "architectures": [architecture],
        "model_type": "realm",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.layer_norm_eps,
        "retriever_proj_size": cfg.proj_size,
        "span_hidden_size": cfg.span_hidden_size,
        "max_span_width": cfg.max_span_width,
        "reader_layer_norm_eps": cfg.reader_layer_norm_eps,
        "torch_dtype": "float32",
    }
    out.update(extra)
    return out


# The fields HF's RealmConfig shares between the embedder and the reader of one model: the
# ones an import checks against the configured architecture.
SHARED_FIELDS = CHECKED_FIELDS


def architecture_differences(ecfg: ModelConfig, rcfg: ModelConfig) -> list[str]:
    """The fields where the embedders' and the reader's architectures differ."""
    return [
        f"{k}: embedder {getattr(ecfg, k)!r} vs reader {getattr(rcfg, k)!r}"
        for k in SHARED_FIELDS
        if getattr(ecfg, k) != getattr(rcfg, k)
    ]


def export_folders(
    params: dict,
    ecfg: ModelConfig,
    rcfg: ModelConfig,
    block_emb: np.ndarray | None = None,
    extra_config: dict | None = None,
) -> tuple[dict[str, tuple[dict, dict[str, np.ndarray]]], list[str]]:
    """({folder: (config.json dict, tensors)}, notes) for the networks in `params`
    (query_embedder, doc_embedder, reader: any subset). Notes say what was not written."""
    extra = dict(extra_config or {})
    out: dict[str, tuple[dict, dict[str, np.ndarray]]] = {}
    notes: list[str] = []
    query = params.get("query_embedder")
    doc = params.get("doc_embedder") or query
    reader = params.get("reader")
    if query is not None:
        q = embedder_tensors(query, ecfg)
        d = embedder_tensors(doc, ecfg)
        out["embedder"] = (hf_config(ecfg, "RealmEmbedder", **extra), q)
        if doc is not query:
            out["doc_embedder"] = (hf_config(ecfg, "RealmEmbedder", **extra), d)
        scorer = {**_prefixed("query_embedder.", q), **_prefixed("embedder.", d)}
        out["scorer"] = (hf_config(ecfg, "RealmScorer", **extra), scorer)
    if reader is not None:
        out["encoder"] = (
            hf_config(rcfg, "RealmKnowledgeAugEncoder", **extra),
            reader_tensors(reader, rcfg, span=False),
        )
        out["reader"] = (
            hf_config(rcfg, "RealmReader", **extra),
            reader_tensors(reader, rcfg, True),
        )
    diff = architecture_differences(ecfg, rcfg)
    if query is None or reader is None:
        notes.append("openqa/ not written: it needs both the query embedder and the reader")
    elif diff:
        notes.append(
            "openqa/ not written: HF's RealmForOpenQA has one architecture for its embedder "
            "and reader, and this run's differ (" + "; ".join(diff) + ")"
        )
    else:
        emb = np.zeros((0, ecfg.proj_size), np.float32) if block_emb is None else block_emb
        tensors = {
            **_prefixed("embedder.", out["embedder"][1]),
            **_prefixed("reader.", out["reader"][1]),
            "block_emb": np.ascontiguousarray(emb, np.float32),
        }
        cfg = hf_config(rcfg, "RealmForOpenQA", num_block_records=int(emb.shape[0]), **extra)
        out["openqa"] = (cfg, tensors)
        if block_emb is None:
            notes.append("openqa/ has an empty block_emb: the workdir has no published index")
    return out, notes


def write_folder(
    folder: str, config: dict, tensors: dict[str, np.ndarray], vocab: str = ""
) -> None:
    """config.json + model.safetensors (+ vocab.txt copied from `vocab`) into a local folder."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    if vocab:
        with open(vocab, "rb") as src, open(os.path.join(folder, "vocab.txt"), "wb") as dst:
            dst.write(src.read())
