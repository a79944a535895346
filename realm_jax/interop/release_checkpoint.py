"""The REALM/ORQA release's TF1 checkpoints as HuggingFace REALM state dicts (no TensorFlow).

    kind, state, block_emb = read_release_checkpoint("gs://realm-data/cc_news_pretrained/embedder")
    # kind "RealmEmbedder"; state {"realm.embeddings.word_embeddings.weight": [V, H], ...,
    # "cls.dense.weight": [128, H], ...}; block_emb [13353718, 128] from encoded/encoded.ckpt

`state` uses the names (and PyTorch layouts: Linear weights [out, in], TF kernels transposed)
of transformers' RealmEmbedder, RealmKnowledgeAugEncoder, RealmReader or RealmForOpenQA, so
interop/hf_import.py's mapping from HF names to realm-jax params takes it as it takes a HF
folder's tensors; `hf_config(kind, state)` gives the config.json fields it reads.

What each release checkpoint holds (variable names as transformers' load_tf_weights_in_realm
maps them, and language/orqa/models/{ict,orqa}_model.py make them):
  cc_news_pretrained/embedder (TF-Hub module, variables/variables)   -> RealmEmbedder
      module/module/module/bert/...            BERT               -> realm.*
      module/module/module/cls/predictions/... BERT's MLM head    -> cls.predictions.*
      module/module/dense/{kernel,bias}        projection [H,128] -> cls.dense.*
      module/module/LayerNorm/{gamma,beta}                        -> cls.LayerNorm.*
    and encoded/encoded.ckpt: block_emb [num_blocks, 128], row i = block i of blocks.tfr
  cc_news_pretrained/bert (TF-Hub module)                        -> RealmKnowledgeAugEncoder
      bert/..., cls/predictions/...                               -> realm.*, cls.predictions.*
  orqa_{nq,wq}_model_from_realm (export/best_default/checkpoint/model.ckpt-N) -> RealmForOpenQA
      module/module/module/module/bert/..., module/module/module/{dense,LayerNorm}/
          the fine-tuned query embedder                          -> embedder.realm.*, embedder.cls.*
      reader/module/bert/..., reader/module/cls/predictions/...   -> reader.realm.*, reader.cls.*
      reader/dense ([H, 2*span_hidden]: the start and end projections), reader/dense_1
          ([span_hidden, 1]), reader/layer_normalization        -> reader.qa_outputs.*
    (its block_emb is the retriever module's encoded/encoded.ckpt: pass block_emb_path;
    the model_dir's params.json, run_params, names that module and the span width)
The nesting depth of `module/` is found from the names, not assumed. Optimizer slots
(adam_m/adam_v), global_step and heads HF's REALM lacks (cls/seq_relationship) are dropped
(the heads logged, at DEBUG: -v shows them).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable

import numpy as np

from realm_jax import fs
from realm_jax.interop.tf_checkpoint import CheckpointError, TFCheckpoint

log = logging.getLogger(__name__)

KINDS = ("RealmEmbedder", "RealmKnowledgeAugEncoder", "RealmReader", "RealmForOpenQA")
TRAINING_STATE = {
    "adam_m",
    "adam_v",
    "Adam",
    "Adam_1",
    "AdamWeightDecayOptimizer",
    "AdamWeightDecayOptimizer_1",
    "global_step",
    "beta1_power",
    "beta2_power",
}
_EMBEDDER_BERT = re.compile(r"^((?:module/)*)module/bert/embeddings/word_embeddings$")
_READER_BERT = "reader/module/"
SPAN_HEAD = {  # ORQA's span scorer (orqa_model.read) -> HF RealmReaderProjection
    "reader/dense/": "qa_outputs.dense_intermediate.",
    "reader/dense_1/": "qa_outputs.dense_output.",
    "reader/layer_normalization/": "qa_outputs.layer_normalization.",
}


class ReleaseCheckpointError(CheckpointError):
    """A checkpoint whose variables match none of the release's layouts."""


def _hf_suffix(parts: list[str]) -> tuple[str, bool] | None:
    """(HF name suffix, transpose?) for a TF variable path below a known scope, or None for a
    variable HF's REALM has no place for."""
    *scopes, leaf = parts
    out = []
    for s in scopes:
        m = re.fullmatch(r"layer_(\d+)", s)
        out += ["layer", m.group(1)] if m else [s]
    if leaf == "kernel":
        return ".".join([*out, "weight"]), True
    if leaf == "gamma":
        return ".".join([*out, "weight"]), False
    if leaf in ("beta", "bias", "output_bias"):
        return ".".join([*out, "bias"]), False
    if leaf.endswith("_embeddings"):
        return ".".join([*out, leaf, "weight"]), False
    return None


def _layout(names: set[str]) -> tuple[str, dict[str, str]]:
    """(kind, {TF scope prefix: HF name prefix}) of a checkpoint's variable names."""
    scopes: dict[str, str] = {}
    embedders = sorted(
        m.group(1)
        for n in names
        if (m := _EMBEDDER_BERT.match(n)) and f"{m.group(1)}dense/kernel" in names
    )
    reader = f"{_READER_BERT}bert/embeddings/word_embeddings" in names
    encoder = "bert/embeddings/word_embeddings" in names
    if len(embedders) > 1:
        raise ReleaseCheckpointError(f"more than one embedder in the checkpoint: {embedders}")
    if embedders and reader:
        kind, emb, rd = "RealmForOpenQA", "embedder.", "reader."
    elif embedders:
        kind, emb, rd = "RealmEmbedder", "", ""
    elif reader:
        kind, emb, rd = "RealmReader", "", ""
    elif encoder:
        return "RealmKnowledgeAugEncoder", {
            "bert/": "realm.",
            "cls/predictions/": "cls.predictions.",
        }
    else:
        sample = ", ".join(sorted(names)[:6])
        raise ReleaseCheckpointError(
            "no REALM/ORQA model in the checkpoint (looked for [module/...]module/bert/ with a "
            f"projection, reader/module/bert/ and bert/); its variables: {sample} ..."
        )
    if embedders:
        q = embedders[0]
        scopes[f"{q}module/bert/"] = f"{emb}realm."
        scopes[f"{q}module/cls/predictions/"] = f"{emb}cls.predictions."
        scopes[f"{q}dense/"] = f"{emb}cls.dense."
        scopes[f"{q}LayerNorm/"] = f"{emb}cls.LayerNorm."
    if reader:
        scopes[f"{_READER_BERT}bert/"] = f"{rd}realm."
        scopes[f"{_READER_BERT}cls/predictions/"] = f"{rd}cls.predictions."
        scopes.update({tf: rd + hf for tf, hf in SPAN_HEAD.items()})
    return kind, scopes


def map_release_names(
    names: Iterable[str],
) -> tuple[str, dict[str, tuple[str, bool]], list[str]]:
    """(kind, {TF name: (HF name, transpose?)}, TF names left out) for a release checkpoint's
    variable names. Training state (optimizer slots, global_step) is left out silently."""
    names = {n for n in names if n != "block_emb"}
    kind, scopes = _layout(names)
    mapping, skipped = {}, []
    for name in sorted(names):
        if TRAINING_STATE & set(name.split("/")):
            continue
        scope = max((s for s in scopes if name.startswith(s)), key=len, default=None)
        hf = _hf_suffix(name[len(scope) :].split("/")) if scope else None
        if hf is None:
            skipped.append(name)
            continue
        mapping[name] = (scopes[scope] + hf[0], hf[1])
    return kind, mapping, skipped


def read_block_emb(path: str) -> np.ndarray:
    """The release's block embeddings [num_blocks, proj] (variable block_emb) from
    encoded/encoded.ckpt, its folder, or an embedder module folder holding encoded/."""
    enc = fs.join(path, "encoded", "encoded.ckpt")
    ckpt = TFCheckpoint(enc if fs.isfile(enc + ".index") else path)
    if "block_emb" not in ckpt.entries:
        raise ReleaseCheckpointError(f"{ckpt.prefix}: no variable block_emb")
    return ckpt.read("block_emb")


def read_release_checkpoint(
    path: str, *, block_emb_path: str | None = None, with_block_emb: bool = True
) -> tuple[str, dict[str, np.ndarray], np.ndarray | None]:
    """(HF class name, HF-named state dict, block_emb or None) of a release checkpoint.

    block_emb comes from the checkpoint itself when it has one, else from `block_emb_path`,
    else from <path>/encoded/encoded.ckpt when `path` is an embedder module folder holding it
    (cc_news_pretrained/embedder does); with_block_emb=False skips it (6.8 GB for the
    release's 13.35M blocks)."""
    ckpt = TFCheckpoint(path)
    if set(ckpt.entries) == {"block_emb"}:
        raise ReleaseCheckpointError(
            f"{ckpt.prefix} holds only block_emb (the corpus embeddings): read it with "
            "read_block_emb, and the model from the module folder"
        )
    kind, mapping, skipped = map_release_names(ckpt.entries)
    if skipped:
        log.debug("%s: variables without a HF REALM counterpart, left out: %s", path, skipped)
    state = {}
    for tf_name, (hf_name, transpose) in mapping.items():
        value = ckpt.read(tf_name)
        state[hf_name] = np.ascontiguousarray(value.T) if transpose else value
    block_emb = None
    if with_block_emb:
        if "block_emb" in ckpt.entries:
            block_emb = ckpt.read("block_emb")
        elif block_emb_path:
            block_emb = read_block_emb(block_emb_path)
        elif fs.isdir(path) and fs.isfile(fs.join(path, "encoded", "encoded.ckpt.index")):
            block_emb = read_block_emb(path)
    return kind, state, block_emb


def split_open_qa(state: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """A RealmForOpenQA state dict as (RealmEmbedder state, RealmReader state): each part's
    names without its `embedder.` / `reader.` prefix, as hf_import reads a single model."""
    parts: tuple[dict, dict] = ({}, {})
    for name, value in state.items():
        if name.startswith("embedder."):
            parts[0][name[len("embedder.") :]] = value
        elif name.startswith("reader."):
            parts[1][name[len("reader.") :]] = value
    return parts


def hf_config(
    kind: str,
    state: dict[str, np.ndarray],
    *,
    num_heads: int | None = None,
    num_blocks=None,
    fallback_heads: int | None = None,
    run: dict | None = None,
) -> dict:
    """A transformers RealmConfig-style dict (config.json fields) for a mapped state dict:
    sizes from the tensors; what no tensor shows is the release's (BERT's tanh-approximated
    GELU, "gelu_new"; LayerNorm eps 1e-12, the span head's 1e-3; heads of 64 dimensions
    unless num_heads says otherwise; fallback_heads where the width is no multiple of 64).
    `run`: an ORQA run's params.json (run_params) adds the span head's max_span_width and
    the reader's input length it was trained with."""
    p = {"RealmForOpenQA": "reader."}.get(kind, "")
    word = state[f"{p}realm.embeddings.word_embeddings.weight"]
    hidden = int(word.shape[1])
    if num_heads is None and hidden % 64 == 0:
        num_heads = hidden // 64
    elif num_heads is None:
        if not fallback_heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of 64: give num_heads")
        num_heads = fallback_heads
    layers = {
        int(m.group(1)) for n in state if (m := re.match(rf"{p}realm\.encoder\.layer\.(\d+)\.", n))
    }
    out = {
        "architectures": [kind],
        "model_type": "realm",
        "vocab_size": int(word.shape[0]),
        "hidden_size": hidden,
        "num_hidden_layers": len(layers),
        "num_attention_heads": int(num_heads),
        "intermediate_size": int(
            state[f"{p}realm.encoder.layer.0.intermediate.dense.weight"].shape[0]
        ),
        "hidden_act": "gelu_new",
        "max_position_embeddings": int(
            state[f"{p}realm.embeddings.position_embeddings.weight"].shape[0]
        ),
        "type_vocab_size": int(state[f"{p}realm.embeddings.token_type_embeddings.weight"].shape[0]),
        "layer_norm_eps": 1e-12,
        "reader_layer_norm_eps": 1e-3,
    }
    proj = {"RealmForOpenQA": "embedder."}.get(kind, "") + "cls.dense.weight"
    if proj in state:
        out["retriever_proj_size"] = int(state[proj].shape[0])
    span = f"{p}qa_outputs.dense_output.weight"
    if span in state:
        out["span_hidden_size"] = int(state[span].shape[1])
    if num_blocks is not None:
        out["num_block_records"] = int(num_blocks)
    for key in ("max_span_width", "reader_seq_len"):
        if key in (run or {}):
            out[key] = int(run[key])
    return out


RUN_PARAMS = "params.json"  # ORQA's model_dir/params.json: the run's flags


def run_params(path: str) -> dict:
    """The ORQA run parameters (params.json: retriever_module_path, num_block_records,
    max_span_width, reader_seq_len, ...) of a model_dir, or {} when `path` has none."""
    if not fs.isdir(path) or not fs.isfile(fs.join(path, RUN_PARAMS)):
        return {}
    where = fs.join(path, RUN_PARAMS)
    try:
        out = json.loads(fs.read_text(where))
    except (ValueError, UnicodeDecodeError) as e:
        raise ReleaseCheckpointError(f"{where}: not JSON ({e})") from None
    if not isinstance(out, dict):
        raise ReleaseCheckpointError(f"{where}: not ORQA's run parameters")
    return out


def module_vocab(path: str) -> str | None:
    """The vocabulary a TF-Hub module folder ships (assets/vocab.txt), if any."""
    cand = fs.join(path, "assets", "vocab.txt")
    return cand if fs.isdir(path) and fs.isfile(cand) else None
