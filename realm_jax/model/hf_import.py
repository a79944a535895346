"""Import HuggingFace-format weights (config.json + model.safetensors; never pickles).

Supported checkpoints: BertModel, BertForMaskedLM (LayerNorm as weight/bias or legacy
gamma/beta; decoder tied and stored as word embeddings, as `cls.predictions.decoder.weight`, or
both), and REALM's RealmEmbedder, RealmKnowledgeAugEncoder and RealmReader.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
from flax import linen as nn

from realm_jax import fs

log = logging.getLogger(__name__)


class WeightImportError(ValueError):
    """A checkpoint that cannot be imported: missing file, tensor or mismatched shape."""


def check_folder(path: str) -> None:
    """A WeightImportError unless `path` is a folder with config.json and model.safetensors
    (cheap: run before any model is built, so a wrong path fails at once). `path` may be a
    gs:// URL."""
    try:
        fs.check_buckets([path])
    except fs.StorageError as e:
        raise WeightImportError(str(e)) from None
    if not fs.isdir(path):
        where = "" if fs.is_remote(path) or os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise WeightImportError(f"{path}: no such folder{where}")
    if not fs.isfile(fs.join(path, "config.json")):
        raise WeightImportError(f"{path}: no config.json")
    if not fs.isfile(fs.join(path, "model.safetensors")):
        pickled = [f for f in ("pytorch_model.bin", "tf_model.h5") if fs.exists(fs.join(path, f))]
        hint = (
            f" (found {pickled[0]}: convert it to safetensors; pickles are never loaded)"
            if pickled
            else ""
        )
        raise WeightImportError(f"{path}: no model.safetensors{hint}")


# What a weights folder on an object store brings to the local cache (the vocabulary too,
# where the folder has one); pickles are never copied.
CACHED_FILES = ("config.json", "model.safetensors", "vocab.txt")


def local_folder(path: str) -> str:
    """A local folder with `path`'s weights: `path` itself when local; for a gs:// folder a
    verified copy under fs.cache_root()/hf/, downloaded once per host (keyed by the URL and
    each file's size and modification time, so a rewritten folder is copied afresh)."""
    check_folder(path)
    if not fs.is_remote(path):
        return path
    files, key = {}, [fs.abspath(path)]
    for name in CACHED_FILES:
        url = fs.join(path, name)
        if name == "vocab.txt" and not fs.isfile(url):
            continue
        files[name] = fs.size(url)
        key.append(f"{name}:{fs.signature(url)}")
    tag = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    local = os.path.join(fs.cache_root(), "hf", tag)
    try:
        return fs.cached_copy(path, files, local)
    except fs.StorageError as e:
        raise WeightImportError(str(e)) from None


def read_hf_folder(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, {name: array}) from a HuggingFace model folder (local, or gs://
    through a local cached copy)."""
    local = local_folder(path)
    st_path = fs.join(path, "model.safetensors")  # errors name the folder the user gave
    from safetensors.numpy import load_file

    try:
        tensors = load_file(os.path.join(local, "model.safetensors"))
    except Exception as e:  # truncated or corrupt file
        raise WeightImportError(f"{st_path}: cannot read safetensors ({e})") from e
    with open(os.path.join(local, "config.json")) as f:
        return json.load(f), tensors


def hf_model_fields(hf: dict) -> dict:
    """ModelConfig fields implied by a HF BERT/REALM config.json."""
    out = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "intermediate_size": hf["intermediate_size"],
        "hidden_act": hf.get("hidden_act", "gelu"),
        "max_position_embeddings": hf.get("max_position_embeddings", 512),
        "type_vocab_size": hf.get("type_vocab_size", 2),
        "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
    }
    for src, dst in (
        ("retriever_proj_size", "proj_size"),
        ("span_hidden_size", "span_hidden_size"),
        ("max_span_width", "max_span_width"),
        ("reader_layer_norm_eps", "reader_layer_norm_eps"),
    ):
        if src in hf:
            out[dst] = hf[src]
    return out


class _Tensors:
    """Name lookup that remembers what was used and explains what is missing."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str):
        self.t, self.source, self.used = tensors, source, set()

    def has(self, name: str) -> bool:
        return name in self.t

    def get(self, name: str) -> np.ndarray:
        if name not in self.t:
            raise WeightImportError(f"{self.source}: missing tensor {name!r}")
        self.used.add(name)
        return np.asarray(self.t[name], np.float32)

    def layer_norm(self, prefix: str) -> dict:
        scale = f"{prefix}.weight" if self.has(f"{prefix}.weight") else f"{prefix}.gamma"
        bias = f"{prefix}.bias" if self.has(f"{prefix}.bias") else f"{prefix}.beta"
        return {"scale": self.get(scale), "bias": self.get(bias)}

    def linear(self, prefix: str) -> dict:
        return {"kernel": self.get(f"{prefix}.weight").T, "bias": self.get(f"{prefix}.bias")}

    def unused(self) -> list[str]:
        return sorted(set(self.t) - self.used)


def _bert_prefix(t: _Tensors) -> str:
    for p in ("bert.", "realm.", ""):
        if t.has(f"{p}embeddings.position_embeddings.weight"):
            return p
    raise WeightImportError(
        f"{t.source}: no BERT embeddings found (looked for bert., realm. and "
        "unprefixed embeddings.position_embeddings.weight)"
    )


def _bert(t: _Tensors, fields: dict, pooler: bool) -> dict:
    p = _bert_prefix(t)
    heads, hidden = fields["num_heads"], fields["hidden_size"]
    hd = hidden // heads
    word = f"{p}embeddings.word_embeddings.weight"
    if not t.has(word):  # tied: only the decoder copy was stored
        word = "cls.predictions.decoder.weight"
    out = {
        "embeddings": {
            "word_embeddings": {"embedding": t.get(word)},
            "position_embeddings": t.get(f"{p}embeddings.position_embeddings.weight"),
            "token_type_embeddings": t.get(f"{p}embeddings.token_type_embeddings.weight"),
            "LayerNorm": t.layer_norm(f"{p}embeddings.LayerNorm"),
        }
    }
    for i in range(fields["num_layers"]):
        lp = f"{p}encoder.layer.{i}."
        att = {}
        for name in ("query", "key", "value"):
            lin = t.linear(f"{lp}attention.self.{name}")
            att[name] = {
                "kernel": lin["kernel"].reshape(hidden, heads, hd),
                "bias": lin["bias"].reshape(heads, hd),
            }
        o = t.linear(f"{lp}attention.output.dense")
        att["output_dense"] = {"kernel": o["kernel"].reshape(heads, hd, hidden), "bias": o["bias"]}
        out[f"layer_{i}"] = {
            "attention": att,
            "attention_LayerNorm": t.layer_norm(f"{lp}attention.output.LayerNorm"),
            "intermediate": t.linear(f"{lp}intermediate.dense"),
            "output": t.linear(f"{lp}output.dense"),
            "output_LayerNorm": t.layer_norm(f"{lp}output.LayerNorm"),
        }
    if pooler and t.has(f"{p}pooler.dense.weight"):
        out["pooler"] = t.linear(f"{p}pooler.dense")
    elif pooler:  # e.g. BertForMaskedLM stores no pooler: it keeps its fresh initialisation
        log.info("%s: no pooler weights; the embedder's pooler stays freshly initialised", t.source)
    return out


def embedder_params(path: str) -> tuple[dict, dict]:
    """Params for `models.Embedder` from a RealmEmbedder or BertModel folder.

    A BertModel checkpoint (no retrieval projection) fills the BERT and pooler only; the
    returned dict then lacks 'projection', which keeps its fresh initialisation.
    Returns (params, ModelConfig fields of the checkpoint).
    """
    hf, tensors = read_hf_folder(path)
    fields = hf_model_fields(hf)
    t = _Tensors(tensors, path)
    params = {"bert": _bert(t, fields, pooler=True)}
    if t.has("cls.dense.weight"):
        params["projection"] = t.linear("cls.dense")
        params["projection_LayerNorm"] = t.layer_norm("cls.LayerNorm")
    ignored = [n for n in t.unused() if not n.startswith("cls.predictions.")]
    if ignored:
        log.warning("%s: tensors not used by the embedder: %s", path, ", ".join(ignored[:8]))
    return params, fields


def reader_params(path: str, with_span_head: bool | None = None) -> tuple[dict, dict]:
    """Params for `models.Reader` from a RealmKnowledgeAugEncoder, RealmReader or
    BertForMaskedLM folder. The span head is imported when present (RealmReader)."""
    hf, tensors = read_hf_folder(path)
    fields = hf_model_fields(hf)
    t = _Tensors(tensors, path)
    params = {"bert": _bert(t, fields, pooler=False)}
    params["mlm"] = {
        "transform": t.linear("cls.predictions.transform.dense"),
        "transform_LayerNorm": t.layer_norm("cls.predictions.transform.LayerNorm"),
        "bias": t.get("cls.predictions.bias")
        if t.has("cls.predictions.bias")
        else t.get("cls.predictions.decoder.bias"),
    }
    if t.has("cls.predictions.decoder.weight"):
        dec = t.get("cls.predictions.decoder.weight")
        word = params["bert"]["embeddings"]["word_embeddings"]["embedding"]
        if not np.allclose(dec, word, atol=1e-6):
            # RealmReader checkpoints store an untied, unused MLM decoder: the BERT keeps its
            # word embeddings and MLM logits use them (realm-jax always ties the decoder).
            log.warning(
                "%s: MLM decoder weight differs from the word embeddings; using the "
                "word embeddings (tied decoder)",
                path,
            )
    if with_span_head or (with_span_head is None and t.has("qa_outputs.dense_intermediate.weight")):
        params["span"] = {
            "dense_intermediate": t.linear("qa_outputs.dense_intermediate"),
            "layer_normalization": t.layer_norm("qa_outputs.layer_normalization"),
            "dense_output": t.linear("qa_outputs.dense_output"),
        }
    ignored = [
        n
        for n in t.unused()
        if not n.startswith("realm.pooler") and not n.startswith("bert.pooler")
    ]
    if ignored:
        log.warning("%s: tensors not used by the reader: %s", path, ", ".join(ignored[:8]))
    return params, fields


def merge_params(target, loaded: dict, where: str = "params"):
    """Replace leaves of `target` (a params tree, possibly with LogicallyPartitioned boxes)
    by those in `loaded`; every loaded leaf must exist in target with the same shape."""
    if not isinstance(loaded, dict):
        raise TypeError(where)
    out = dict(target)
    for key, value in loaded.items():
        path = f"{where}/{key}"
        if key not in target:
            raise WeightImportError(f"{path}: the model has no such parameter")
        if isinstance(value, dict):
            out[key] = merge_params(target[key], value, path)
            continue
        old = target[key]
        raw = old.unbox() if isinstance(old, nn.LogicallyPartitioned) else old
        if tuple(raw.shape) != tuple(value.shape):
            raise WeightImportError(
                f"{path}: checkpoint shape {tuple(value.shape)} != model shape {tuple(raw.shape)}"
            )
        new = np.asarray(value, raw.dtype)
        out[key] = old.replace_boxed(new) if isinstance(old, nn.LogicallyPartitioned) else new
    return out


CHECKED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "hidden_act",
    "layer_norm_eps",
    "max_position_embeddings",
    "type_vocab_size",
)


def check_fields(model_cfg, fields: dict, path: str, where: str = "config.model") -> None:
    """Fail when the run's architecture disagrees with the checkpoint's config.json (the
    activation and LayerNorm epsilon too: a silent mismatch would change every output)."""
    bad = []
    for k, v in fields.items():
        if k not in CHECKED_FIELDS:
            continue
        mine = getattr(model_cfg, k)
        same = abs(mine - v) <= 1e-6 * abs(v) if k == "layer_norm_eps" else mine == v
        if k == "hidden_act":
            same = _act(mine) == _act(v)
        if not same:
            bad.append(f"{k}: config {mine!r} vs checkpoint {v!r}")
    if bad:
        raise WeightImportError(f"{path} does not match {where}: " + "; ".join(bad))


def _act(name: str) -> str:
    """Activation names that compute the same function."""
    return {"gelu_pytorch_tanh": "gelu_new"}.get(name, name)
