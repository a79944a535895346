"""Import HuggingFace-format weights: config.json + model.safetensors, or pytorch_model.bin read
through safe_pickle (no torch, no code from the pickle run); safetensors when both are there,
and sharded checkpoints through their *.index.json.

Supported checkpoints: BertModel, BertForMaskedLM / BertForPreTraining (LayerNorm as
weight/bias or legacy gamma/beta; decoder tied and stored as word embeddings, as
`cls.predictions.decoder.weight`, or both), and every REALM class of transformers'
models.deprecated.realm: RealmEmbedder, RealmScorer (`query_embedder.` / `embedder.`),
RealmKnowledgeAugEncoder, RealmReader (with its `qa_outputs` span head) and RealmForOpenQA
(`embedder.` + `reader.`, and its `block_emb` index).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import numpy as np

from realm_jax import fs
from realm_jax.interop import hub, safe_pickle

log = logging.getLogger(__name__)


class WeightImportError(ValueError):
    """A checkpoint that cannot be imported: missing file, tensor or mismatched shape."""


SAFETENSORS, PICKLE = "model.safetensors", "pytorch_model.bin"
WEIGHT_FILES = (SAFETENSORS, PICKLE)  # in order of preference
# architectures (config.json) -> what they hold
EMBEDDER_CLASSES = ("RealmEmbedder", "RealmScorer", "RealmForOpenQA")
READER_CLASSES = ("RealmKnowledgeAugEncoder", "RealmReader", "RealmForOpenQA")
BERT_CLASSES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
SUPPORTED = BERT_CLASSES + tuple(dict.fromkeys(EMBEDDER_CLASSES + READER_CLASSES))
NO_READER = ("BertModel", "RealmEmbedder", "RealmScorer")  # no MLM head (or an unused one)


def _weights(path: str) -> tuple[str, list[str]]:
    """(the weights file or index used, [the files it needs]) of a folder: safetensors before a
    pickle, a single file before a sharded index."""
    for name in WEIGHT_FILES:
        if fs.isfile(fs.join(path, name)):
            return name, [name]
        index = fs.join(path, name + ".index.json")
        if fs.isfile(index):
            try:
                shards = sorted(set(json.loads(fs.read_text(index))["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise WeightImportError(f"{index}: not a weights index ({e})") from None
            if any("/" in s or "\\" in s or s.startswith(".") for s in shards):
                raise WeightImportError(f"{index}: shard names must be files of the folder")
            return name + ".index.json", [name + ".index.json", *shards]
    raise WeightImportError(
        f"{path}: no model.safetensors or pytorch_model.bin"
        + (
            " (found tf_model.h5: TensorFlow weights are not read)"
            if fs.exists(fs.join(path, "tf_model.h5"))
            else ""
        )
    )


def resolve(path: str) -> str:
    """The folder `path` names: itself, or a HuggingFace hub id's downloaded snapshot."""
    try:
        return hub.resolve(path)
    except hub.HubError as e:
        raise WeightImportError(str(e)) from None


def check_folder(path: str) -> None:
    """A WeightImportError unless `path` is a folder with config.json of a supported class and
    a readable weights file (cheap: run before any model is built, so a wrong path fails at
    once). `path` may be a gs:// URL or a HuggingFace hub id (fetched once, see hub.py)."""
    path = resolve(path)
    try:
        fs.check_buckets([path])
    except fs.StorageError as e:
        raise WeightImportError(str(e)) from None
    if not fs.isdir(path):
        where = "" if fs.is_remote(path) or os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise WeightImportError(f"{path}: no such folder{where}")
    if not fs.isfile(fs.join(path, "config.json")):
        raise WeightImportError(f"{path}: no config.json")
    _, files = _weights(path)
    for name in files:
        if name.endswith(".json"):
            continue
        url = fs.join(path, name)
        if not fs.isfile(url):
            raise WeightImportError(f"{url}: no such file (named by the folder's weights index)")
        if name.endswith(".bin"):  # a legacy (non-zip) pickle fails here, before any model
            with fs.open(url, "rb") as f:
                if not safe_pickle.looks_like_torch_zip(f.read(4)):
                    raise WeightImportError(safe_pickle.legacy_message(url))
    declared_class(_read_config(path, fs.join(path, "config.json")), path)


def _read_config(path: str, config_path: str) -> dict:
    try:
        hf = json.loads(fs.read_text(config_path))
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightImportError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise WeightImportError(f"{config_path}: not a model config")
    return hf


def declared_class(hf: dict, path: str) -> str | None:
    """The class config.json names (None when it names none); an error for a class that
    realm-jax cannot import."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type not in (None, "bert", "realm"):
        raise WeightImportError(
            f"{path}: model_type {model_type!r} ({', '.join(archs) or 'no class'}) is not a "
            f"BERT or REALM checkpoint; importable classes: {', '.join(SUPPORTED)}"
        )
    if not archs:
        return None
    if archs[0] not in SUPPORTED:
        raise WeightImportError(
            f"{path}: {archs[0]} cannot be imported; importable classes: {', '.join(SUPPORTED)}"
        )
    return archs[0]


# What a weights folder on an object store brings to the local cache: config.json, its weights
# (one format: safetensors when the folder has them, else the pickle, never read as code) and the
# vocabulary where the folder has one.
CACHED_FILES = ("config.json", "vocab.txt")


def local_folder(path: str) -> str:
    """A local folder with `path`'s weights: `path` itself when local; for a gs:// folder a
    verified copy under fs.cache_root()/hf/, downloaded once per host (keyed by the URL and
    each file's size and modification time, so a rewritten folder is copied afresh); for a hub
    id, its snapshot in the HuggingFace cache."""
    path = resolve(path)
    check_folder(path)
    if not fs.is_remote(path):
        return path
    files, key = {}, [fs.abspath(path)]
    for name in (*CACHED_FILES, *_weights(path)[1]):
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


def _load_file(local: str, name: str, shown: str) -> dict[str, np.ndarray]:
    if name.endswith(".bin"):
        try:
            return safe_pickle.load_state_dict(os.path.join(local, name))
        except safe_pickle.UnsafePickleError as e:
            raise WeightImportError(str(e).replace(os.path.join(local, name), shown)) from None
    from safetensors.numpy import load_file

    try:
        return load_file(os.path.join(local, name))
    except Exception as e:  # truncated or corrupt file
        raise WeightImportError(f"{shown}: cannot read safetensors ({e})") from e


def read_hf_folder(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, {name: array}) from a HuggingFace model folder (local, or gs://
    through a local cached copy)."""
    local = local_folder(path)
    name, files = _weights(local)
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        if not f.endswith(".json"):
            tensors.update(_load_file(local, f, fs.join(path, f)))  # errors name the user's path
    if name.endswith(".index.json"):
        wanted = json.loads(fs.read_text(os.path.join(local, name)))["weight_map"]
        if missing := sorted(set(wanted) - set(tensors)):
            raise WeightImportError(f"{fs.join(path, name)}: shards lack {missing[:4]}")
    return _read_config(path, os.path.join(local, "config.json")), tensors


def check_vocab(path: str, vocab_path: str) -> None:
    """A WeightImportError when the folder has a vocab.txt that differs from `vocab_path` (the
    WordPiece vocabulary realm-jax tokenises with): its ids would mean other words."""
    path = resolve(path)
    theirs = fs.join(path, "vocab.txt")
    if not fs.isfile(theirs):
        return
    a = fs.read_text(theirs).splitlines()
    with open(vocab_path, encoding="utf-8") as f:
        b = f.read().splitlines()
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise WeightImportError(
            f"{theirs} differs from realm-jax's vocabulary {vocab_path} ({len(a)} vs {len(b)} "
            f"words; first difference at id {first}): its token ids would mean other words"
        )


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
    """Name lookup under one network's prefix (`root`: "" or e.g. "reader." of a
    RealmForOpenQA) that remembers what was used and explains what is missing."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str, root: str = ""):
        self.t, self.source, self.root, self.used = tensors, source, root, set()

    def has(self, name: str) -> bool:
        return self.root + name in self.t

    def get(self, name: str) -> np.ndarray:
        full = self.root + name
        if full not in self.t:
            raise WeightImportError(f"{self.source}: missing tensor {full!r}")
        self.used.add(full)
        return np.asarray(self.t[full], np.float32)

    def layer_norm(self, prefix: str) -> dict:
        scale = f"{prefix}.weight" if self.has(f"{prefix}.weight") else f"{prefix}.gamma"
        bias = f"{prefix}.bias" if self.has(f"{prefix}.bias") else f"{prefix}.beta"
        return {"scale": self.get(scale), "bias": self.get(bias)}

    def linear(self, prefix: str) -> dict:
        return {"kernel": self.get(f"{prefix}.weight").T, "bias": self.get(f"{prefix}.bias")}

    def unused(self) -> list[str]:
        """Names under this root that were not read, without the root."""
        n = len(self.root)
        return sorted(k[n:] for k in set(self.t) - self.used if k.startswith(self.root))


def _bert_prefix(t: _Tensors) -> str:
    for p in ("bert.", "realm.", ""):
        if t.has(f"{p}embeddings.position_embeddings.weight"):
            return p
    raise WeightImportError(
        f"{t.source}: no BERT embeddings found (looked for {t.root}bert., {t.root}realm. and "
        f"{t.root}embeddings.position_embeddings.weight)"
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
    if f"{t.root}{p}encoder.layer.{fields['num_layers']}.output.dense.weight" in t.t:
        raise WeightImportError(
            f"{t.source}: holds more than num_hidden_layers={fields['num_layers']} layers"
        )
    if pooler and t.has(f"{p}pooler.dense.weight"):
        out["pooler"] = t.linear(f"{p}pooler.dense")
    elif pooler:  # e.g. BertForMaskedLM stores no pooler: it keeps its fresh initialisation
        log.info("%s: no pooler weights; the embedder's pooler stays freshly initialised", t.source)
    return out


def checkpoint_class(hf: dict, tensors: dict, path: str) -> str:
    """The checkpoint's class: config.json's `architectures`, else told by its tensor names."""
    declared = declared_class(hf, path)
    if declared:
        return declared
    names = set(tensors)
    if "block_emb" in names or any(n.startswith("reader.") for n in names):
        return "RealmForOpenQA"
    if any(n.startswith(("query_embedder.", "embedder.")) for n in names):
        return "RealmScorer"
    if any(n.startswith("qa_outputs.") for n in names):
        return "RealmReader"
    if "cls.dense.weight" in names:
        return "RealmEmbedder"
    if any(n.startswith("cls.predictions.") for n in names):
        return "BertForMaskedLM"
    return "BertModel"


def _embedder_root(cls: str, which: str, tensors: dict) -> str:
    """The prefix of the query ("query") or document ("doc") embedder in a checkpoint."""
    if cls == "RealmForOpenQA":
        return "embedder."  # one embedder: its documents are the block_emb buffer
    if cls == "RealmScorer":  # HF's scorer: `embedder` embeds candidates, `query_embedder`
        # queries; a scorer whose two are one network may be saved under either name alone
        roots = [r for r in ("query_embedder.", "embedder.") if _has_root(tensors, r)]
        if not roots:
            return "embedder."  # fails naming the tensor it looked for
        return roots[0] if which == "query" else roots[-1]
    return ""


def _has_root(tensors: dict, root: str) -> bool:
    return any(n.startswith(root) for n in tensors)


def _embedder(t: _Tensors, fields: dict) -> dict:
    params = {"bert": _bert(t, fields, pooler=True)}
    if t.has("cls.dense.weight"):
        params["projection"] = t.linear("cls.dense")
        params["projection_LayerNorm"] = t.layer_norm("cls.LayerNorm")
    # (embeddings.position_ids: a constant buffer older transformers saved, not a weight)
    ignored = [
        n
        for n in t.unused()
        if not n.startswith("cls.predictions.") and not n.endswith("embeddings.position_ids")
    ]
    if t.root == "":
        ignored = [n for n in ignored if not n.startswith(("qa_outputs.", "cls.predictions."))]
    if ignored:
        log.warning("%s: tensors not used by the embedder: %s", t.source, ", ".join(ignored[:8]))
    return params


def _reader(t: _Tensors, fields: dict, with_span_head: bool | None) -> dict:
    params = {"bert": _bert(t, fields, pooler=False)}
    params["mlm"] = {
        "transform": t.linear("cls.predictions.transform.dense"),
        "transform_LayerNorm": t.layer_norm("cls.predictions.transform.LayerNorm"),
        "bias": t.get("cls.predictions.bias")
        if t.has("cls.predictions.bias")
        else t.get("cls.predictions.decoder.bias"),
    }
    if t.has("cls.predictions.decoder.bias") and t.has("cls.predictions.bias"):
        if not np.array_equal(t.get("cls.predictions.decoder.bias"), params["mlm"]["bias"]):
            log.warning(
                "%s: cls.predictions.decoder.bias differs from cls.predictions.bias; "
                "using cls.predictions.bias",
                t.source,
            )
    if t.has("cls.predictions.decoder.weight"):
        dec = t.get("cls.predictions.decoder.weight")
        word = params["bert"]["embeddings"]["word_embeddings"]["embedding"]
        if dec.shape != word.shape or not np.allclose(dec, word, atol=1e-6):
            # RealmReader checkpoints store an untied, unused MLM decoder: the BERT keeps its
            # word embeddings and MLM logits use them (realm-jax always ties the decoder).
            log.warning(
                "%s: MLM decoder weight differs from the word embeddings; using the "
                "word embeddings (tied decoder)",
                t.source,
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
        if not n.startswith(("realm.pooler", "bert.pooler", "cls.seq_relationship"))
    ]
    if ignored:
        log.warning("%s: tensors not used by the reader: %s", t.source, ", ".join(ignored[:8]))
    return params


def embedder_params(path: str, which: str = "query") -> tuple[dict, dict]:
    """Params for `models.Embedder` from a RealmEmbedder, RealmScorer, RealmForOpenQA,
    BertModel, BertForMaskedLM, RealmKnowledgeAugEncoder or RealmReader folder: the query
    embedder (`which`="query") or the document embedder ("doc"), which differ only in a
    RealmScorer that has its own query_embedder.

    A BERT-only checkpoint (no retrieval projection) fills the BERT and pooler only; the
    returned dict then lacks 'projection', which keeps its fresh initialisation.
    Returns (params, ModelConfig fields of the checkpoint).
    """
    hf, tensors = read_hf_folder(path)
    fields = hf_model_fields(hf)
    root = _embedder_root(checkpoint_class(hf, tensors, path), which, tensors)
    return _embedder(_Tensors(tensors, path, root), fields), fields


def reader_params(path: str, with_span_head: bool | None = None) -> tuple[dict, dict]:
    """Params for `models.Reader` from a RealmKnowledgeAugEncoder, RealmReader,
    RealmForOpenQA (its reader), BertForMaskedLM or BertForPreTraining folder. The span head
    is imported when present (RealmReader, RealmForOpenQA) unless with_span_head=False."""
    hf, tensors = read_hf_folder(path)
    cls = checkpoint_class(hf, tensors, path)
    if cls in NO_READER:
        raise WeightImportError(
            f"{path}: a {cls} holds no reader (no trained MLM head); give a "
            f"{', '.join(READER_CLASSES)} or BertForMaskedLM folder"
        )
    fields = hf_model_fields(hf)
    root = "reader." if cls == "RealmForOpenQA" else ""
    return _reader(_Tensors(tensors, path, root), fields, with_span_head), fields


@dataclasses.dataclass
class ImportedRealm:
    """Every network a HuggingFace folder holds, as realm-jax params (None where it has none)."""

    cls: str  # the checkpoint's class
    fields: dict  # ModelConfig fields (HF has one architecture for all its networks)
    query_embedder: dict | None
    doc_embedder: dict | None  # None: the query embedder embeds documents too
    reader: dict | None
    block_emb: np.ndarray | None  # RealmForOpenQA's index [num_blocks, proj_size]


def import_folder(path: str) -> ImportedRealm:
    """All networks of a HuggingFace BERT or REALM folder (read once)."""
    hf, tensors = read_hf_folder(path)
    return import_tensors(hf, tensors, path)


def import_tensors(hf: dict, tensors: dict[str, np.ndarray], path: str) -> ImportedRealm:
    """All networks of a HF state dict with HF names (a folder's tensors, or another source's
    mapped to them) and its config.json fields; `path` names the source in errors."""
    cls = checkpoint_class(hf, tensors, path)
    fields = hf_model_fields(hf)
    query = doc = reader = block_emb = None
    if cls in EMBEDDER_CLASSES or cls in BERT_CLASSES:
        query = _embedder(_Tensors(tensors, path, _embedder_root(cls, "query", tensors)), fields)
        if (
            cls == "RealmScorer"
            and _has_root(tensors, "query_embedder.")
            and _has_root(tensors, "embedder.")
        ):
            doc = _embedder(_Tensors(tensors, path, "embedder."), fields)
    if cls not in NO_READER:
        root = "reader." if cls == "RealmForOpenQA" else ""
        reader = _reader(_Tensors(tensors, path, root), fields, None)
    if "block_emb" in tensors:
        block_emb = np.asarray(tensors["block_emb"], np.float32)
        if block_emb.ndim != 2 or block_emb.shape[1] != fields.get("proj_size", -1):
            raise WeightImportError(
                f"{path}: block_emb has shape {block_emb.shape}, expected [num_blocks, "
                f"retriever_proj_size={fields.get('proj_size')}]"
            )
    return ImportedRealm(cls, fields, query, doc, reader, block_emb)


def merge_params(target, loaded: dict, where: str = "params"):
    """Replace leaves of `target` (a params tree, possibly with LogicallyPartitioned boxes)
    by those in `loaded`; every loaded leaf must exist in target with the same shape."""
    from flax import linen as nn  # here: reading a folder's config and files needs no JAX

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
