"""A sentence-embedding model as the retriever's start (config.model.init_retriever_from): a
sentence-transformers folder or HuggingFace hub id whose BERT starts both embedders, with the
pooling, normalisation, query/passage prefixes and score scale its files and card define.

`resolve(config, overrides)` runs once where a command's config is loaded (the CLI, the
Python API, a sweep): it reads the model's config.json (its architecture becomes
config.model.embedder.*, proj_size its width) and its sentence-transformers files
(modules.json; the Pooling module's config.json for "mean" or "cls"; a Normalize module;
config_sentence_transformers.json's "prompts" for the query and document prefixes), and for
the three models below the card's table where the files say less. A field also given on the
command line keeps its given value (a warning says so). `bert_params(path)` gives the weights.

The vocabulary must be realm-jax's (bert-base-uncased WordPiece, realm_jax/assets/vocab.txt):
the prepared blocks and queries are its token ids. The three models below all use it.
"""

from __future__ import annotations

import json
import logging
import os

from realm_jax import config as config_lib
from realm_jax import fs, tokenization
from realm_jax import workdir as paths
from realm_jax.interop import hf_import

log = logging.getLogger(__name__)

# What each model's card defines, for what a folder's files may not say (older
# sentence-transformers folders carry no prompts). retrieval_scale: the inverse temperature of
# the contrastive loss each was trained with, so that REALM's and ICT's softmax over retrieved
# blocks starts as sharp as the model's own training:
KNOWN = {
    # all-MiniLM-L6-v2's card: mean pooling, normalised, no prefix; trained with the cosine
    # similarity of every pair in the batch and cross-entropy (its train_script.py: scale 20,
    # sentence-transformers' MultipleNegativesRankingLoss default).
    "sentence-transformers/all-MiniLM-L6-v2": dict(
        embedder_pooling="mean", embedder_normalize=True, query_prefix="", doc_prefix="",
        retrieval_scale=20.0,
    ),
    # bge-small-en-v1.5's card: [CLS] pooling, normalised; queries for retrieval take the
    # instruction below, passages none; "we finetune the models by contrastive learning with a
    # temperature of 0.01" (its FAQ), so scale 100.
    "BAAI/bge-small-en-v1.5": dict(
        embedder_pooling="cls", embedder_normalize=True,
        query_prefix="Represent this sentence for searching relevant passages: ", doc_prefix="",
        retrieval_scale=100.0,
    ),
    # e5-small-v2's card: mean pooling, normalised, "query: " and "passage: " prefixes ("this
    # is how the model is trained"); "we use a low temperature 0.01 for InfoNCE contrastive
    # loss" (its FAQ; Wang et al. 2022, arXiv:2212.03533), so scale 100.
    "intfloat/e5-small-v2": dict(
        embedder_pooling="mean", embedder_normalize=True, query_prefix="query: ",
        doc_prefix="passage: ", retrieval_scale=100.0,
    ),
}  # fmt: skip
# A normalised model of no known card: sentence-transformers' MultipleNegativesRankingLoss
# default scale, what most of its models were trained with.
DEFAULT_NORMALIZED_SCALE = 20.0

# The fields resolve() sets, as config.model keys.
ARCHITECTURE = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
)
RETRIEVAL_FIELDS = (
    "embedder_pooling",
    "embedder_normalize",
    "query_prefix",
    "doc_prefix",
    "retrieval_scale",
)
DERIVED = (*(f"embedder.{k}" for k in ARCHITECTURE), "proj_size", *RETRIEVAL_FIELDS)
ST_MODULES = "sentence_transformers.models."
ST_FILES = (
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)


class SentenceEmbedderError(config_lib.ConfigError):
    """A model that cannot start realm-jax's retriever, said in one line."""


def _known(name: str) -> dict | None:
    for key, card in KNOWN.items():
        if name.strip("/").lower() == key.lower():
            return card
    return None


def _json(folder: str, name: str, shown: str) -> dict | list | None:
    path = fs.join(folder, name)
    if not fs.isfile(path):
        return None
    try:
        return json.loads(fs.read_text(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise SentenceEmbedderError(f"{shown}/{name}: not JSON ({e})") from None


def _from_files(folder: str, shown: str) -> dict:
    """The retrieval fields the folder's sentence-transformers files state (none for a folder
    without them: a plain BERT)."""
    modules = _json(folder, "modules.json", shown)
    if modules is None:
        return {}
    if not isinstance(modules, list):
        raise SentenceEmbedderError(f"{shown}/modules.json: not a list of modules")
    out: dict = {"embedder_normalize": False}
    pooling = None
    for m in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(m.get("type", "")).removeprefix(ST_MODULES)
        if kind == "Transformer":
            if m.get("path", "") not in ("", "."):
                raise SentenceEmbedderError(
                    f"{shown}: its Transformer module is in {m.get('path')!r}; realm-jax reads "
                    "the BERT at the folder's top (config.json + weights)"
                )
        elif kind == "Pooling":
            pooling = _pooling(folder, m.get("path", "1_Pooling"), shown)
        elif kind == "Normalize":
            out["embedder_normalize"] = True
        else:
            raise SentenceEmbedderError(
                f"{shown}: module {m.get('type')!r} is not supported (realm-jax embeds with "
                "Transformer, Pooling (mean or cls) and Normalize only)"
            )
    if pooling is None:
        raise SentenceEmbedderError(f"{shown}/modules.json: no Pooling module")
    out["embedder_pooling"] = pooling
    st = _json(folder, "config_sentence_transformers.json", shown) or {}
    prompts = st.get("prompts") or {} if isinstance(st, dict) else {}
    if prompts.get("query"):
        out["query_prefix"] = prompts["query"]
    for name in ("document", "passage", "corpus"):
        if prompts.get(name):
            out["doc_prefix"] = prompts[name]
            break
    return out


def _pooling(folder: str, sub: str, shown: str) -> str:
    cfg = _json(folder, f"{sub}/config.json", shown)
    if cfg is None:
        raise SentenceEmbedderError(f"{shown}/{sub}/config.json: missing (the Pooling module's)")
    if "pooling_mode" in cfg:  # newer sentence-transformers write one name
        modes = [cfg["pooling_mode"]]
    else:
        modes = [
            k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
            for k, v in cfg.items()
            if k.startswith("pooling_mode_") and v
        ]
    if cfg.get("include_prompt", True) is False:
        raise SentenceEmbedderError(
            f"{shown}/{sub}/config.json: include_prompt=false (the prompt left out of the "
            "pooling) is not supported"
        )
    if modes == ["mean"] or modes == ["cls"]:
        return modes[0]
    raise SentenceEmbedderError(
        f"{shown}/{sub}/config.json: pooling {'+'.join(modes) or 'none'} is not supported "
        "(realm-jax pools with mean or cls)"
    )


def describe(name: str) -> dict:
    """{config.model key: value} that model `name` (a folder or hub id) implies: its
    architecture (model.embedder.*), proj_size = its width, and the retrieval fields."""
    try:
        folder = hf_import.resolve(name)
        if not fs.isdir(folder):
            raise hf_import.WeightImportError(f"{name}: no such folder")
        hf = json.loads(fs.read_text(fs.join(folder, "config.json")))
        hf_import.declared_class(hf, name)
        hf_import.check_vocab(folder, tokenization.VOCAB_PATH)
    except hf_import.WeightImportError as e:
        raise SentenceEmbedderError(f"model.init_retriever_from: {e}") from None
    except (OSError, ValueError) as e:
        raise SentenceEmbedderError(f"model.init_retriever_from={name}: {e}") from None
    fields = hf_import.hf_model_fields(hf)
    if fields["vocab_size"] != 30522:
        raise SentenceEmbedderError(
            f"model.init_retriever_from={name}: vocab_size {fields['vocab_size']}, not the "
            "30,522 wordpieces of bert-base-uncased that realm-jax tokenises with"
        )
    if not fs.isfile(fs.join(folder, "vocab.txt")):
        log.warning("%s: no vocab.txt; taken to be bert-base-uncased's", name)
    out = {f"embedder.{k}": fields[k] for k in ARCHITECTURE}
    out["proj_size"] = fields["hidden_size"]
    found = _from_files(folder, name)
    card = _known(name) or {}
    if not found and not card:
        raise SentenceEmbedderError(
            f"model.init_retriever_from={name}: no sentence-transformers files (modules.json) "
            f"and not one of the known models ({', '.join(KNOWN)}); for a plain BERT use "
            "model.init_embedder_from"
        )
    for k in RETRIEVAL_FIELDS:
        if k in found:
            out[k] = found[k]
        elif k in card:
            out[k] = card[k]
    if card and any(card[k] != found[k] for k in found if k != "retrieval_scale"):
        diff = {k: (found[k], card[k]) for k in found if card[k] != found[k]}
        log.warning("%s: its files differ from its card's (files, card): %s; the files win",
                    name, diff)  # fmt: skip
    out.setdefault("query_prefix", "")
    out.setdefault("doc_prefix", "")
    if "retrieval_scale" not in out:
        out["retrieval_scale"] = DEFAULT_NORMALIZED_SCALE if out["embedder_normalize"] else 1.0
    return out


def _override_keys(overrides) -> set[str]:
    keys = set()
    for item in overrides or ():
        key = item.split("=", 1)[0].removeprefix("--").removeprefix("config.")
        keys.add(key)
    return keys


def _get(config, key: str):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def _set(config, key: str, value) -> None:
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


RUN_CONFIG = "run_config.json"  # a workdir's record of its config (realm_jax/run_record.py)
_SOURCES = ("init_embedders_from_ict", "init_from_realm")  # runs whose embedders start this one


def _recorded(workdir: str, depth: int = 3) -> str:
    """The model.init_retriever_from a run's workdir was started with: its record's override,
    else that of the ICT or REALM run it started from (recorded likewise), "" when none. A
    relative path is taken from the directory the run was started in."""
    try:
        record = json.loads(fs.read_text(fs.join(paths.root(workdir), RUN_CONFIG)))
        overrides = dict(o.split("=", 1) for o in record.get("overrides", []) if "=" in o)
        cwd = record.get("cwd", "")
    except (OSError, ValueError, TypeError, AttributeError, fs.StorageError):
        return ""

    def there(path: str) -> str:
        local = path and not fs.is_remote(path) and not os.path.isabs(path)
        return (
            os.path.join(cwd, path)
            if local and cwd and os.path.exists(os.path.join(cwd, path))
            else path
        )

    found = overrides.get("model.init_retriever_from", "")
    if found:
        return there(found)
    for field in _SOURCES:
        src = overrides.get(f"model.{field}", "")
        if src and depth > 1:
            found = _recorded(there(src), depth - 1)
            if found:
                return found
    return ""


def resolve(config, overrides=()) -> str | None:
    """Set config.model's retriever fields from model.init_retriever_from, in place;
    idempotent. When it is empty, a run that starts its embedders from an ICT or REALM
    workdir (model.init_embedders_from_ict, init_from_realm) whose record says it started
    from a sentence embedder takes that one's (the checkpoint's architecture); else nothing.
    `overrides`: the command line's ("a.b=value"); a derived field given there keeps its
    given value. model.init_embedder_from (another source of the embedders' weights) is
    cleared, or an error when given on the command line too. Returns a line saying what it
    set, for the command's output (None when nothing)."""
    model = config.get("model")
    if model is None or "init_retriever_from" not in model:
        return None
    name, inherited = model.init_retriever_from, ""
    if not name:
        for field in _SOURCES:
            src = model.get(field, "")
            name = _recorded(src) if src else ""
            if name:
                inherited = f" (as model.{field}={src} was started)"
                model.init_retriever_from = name
                break
    if not name:
        return None
    given = _override_keys(overrides)
    derived = describe(name)
    changed = []
    for key, value in derived.items():
        full = f"model.{key}"
        current = _get(config, full)
        if full in given:
            if current != value:
                log.warning(
                    "%s=%r (given) replaces %r from model.init_retriever_from=%s",
                    full, current, value, name,
                )  # fmt: skip
            continue
        if isinstance(current, float) and isinstance(value, int):
            value = float(value)
        if current != value:
            _set(config, full, value)
            changed.append(f"{key}={value!r}")
    if model.get("init_embedder_from", ""):
        if "model.init_embedder_from" in given:
            raise SentenceEmbedderError(
                f"model.init_embedder_from={model.init_embedder_from} and "
                f"model.init_retriever_from={name} both start the embedders: give one"
            )
        log.info("model.init_retriever_from=%s replaces model.init_embedder_from=%s",
                 name, model.init_embedder_from)  # fmt: skip
        model.init_embedder_from = ""
    kept = [k for k in derived if f"model.{k}" in given]
    line = f"model.init_retriever_from={name}{inherited}"
    if changed:
        line += f" sets model.{', model.'.join(changed)}"
    if kept:
        line += f"; given on the command line: model.{', model.'.join(kept)}"
    log.info("%s", line)
    return line


def bert_params(name: str, ecfg) -> dict:
    """The embedder params ({"bert": ...}) of sentence-embedding model `name`, checked against
    the embedders' architecture `ecfg` (a ModelConfig): its BERT alone (with its pooler only
    where the embedder has one: embedder_pooling "realm" given on the command line)."""
    loaded, fields = hf_import.embedder_params(name)
    hf_import.check_fields(ecfg, fields, name, "config.model.embedder")
    keep_pooler = ecfg.embedder_pooling == "realm"
    bert = {k: v for k, v in loaded["bert"].items() if k != "pooler" or keep_pooler}
    return {"bert": bert}
