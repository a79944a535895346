"""Load `configs/*.py:variant` files and apply `--config.a.b=value` overrides.

Configs are ml_collections ConfigDicts, locked after loading so that a typo in an override
(or in code) fails loudly instead of silently adding a new field.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

import ml_collections


class ConfigError(ValueError):
    """A config file, variant or override that cannot be used."""


def _where(error: BaseException, path: str) -> str:
    """'path:line' of the deepest traceback frame in the config file `path` (else 'path')."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    tb = error.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{path}:{line}" if line else path


def _load_module(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    if not path.endswith(".py"):
        raise ConfigError(
            f"{path} is not a Python config file (give a .py file defining get_config(variant), "
            "such as configs/realm.py:smoke)"
        )
    name = "realm_jax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the config file's own code: say where (-v shows the traceback)
        msg = e.msg if isinstance(e, SyntaxError) else str(e)
        raise ConfigError(f"{_where(e, path)}: {type(e).__name__}: {msg}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(arg)")
    return module


# train.* fields a task config (configs/ict.py, configs/orqa.py) takes from configs/realm.py's
# variant on purpose: the same AdamW and loop settings, and two REALM-only fields the task does
# not read. Each task config lists these and any others in its INHERITED tuple;
# tests/test_configs.py fails on a train field inherited without being listed.
# Models and data the recipes name (docs/reference.md "Models and data by name"):
# bert-tiny (Turc et al. 2019, 2 layers, 128 wide) by its HuggingFace hub id, fetched once into
# the HuggingFace cache (interop/hub.py); every model option takes a folder or an id.
BERT_TINY = "google/bert_uncased_L-2_H-128_A-2"
# all-MiniLM-L6-v2 (sentence-transformers, 6 layers, 384 wide, bert-base-uncased's vocabulary) by
# hub id: the own-corpus recipe's retriever start (configs/realm.py:own, model.init_retriever_from)
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# SQuAD v1.1's training set (CC BY-SA 4.0), SQuAD's own JSON: the corpus (its paragraphs) and
# the questions of the squad chain, downloaded once (data/download.py, data/squad_json.py)
SQUAD_TRAIN_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset/train-v1.1.json"
TEAM_SQUAD = "../shared/data/squad"  # the team's JSONL copy (the results' runs read it)


def squad_files() -> tuple[str, str]:
    """(corpus, questions) of the squad chain: the team's JSONL copy where it is there (every
    figure in docs/results.md was measured on it: the same paragraphs, ids "train/<title>/<k>"),
    else SQuAD's official file by URL (ids "<title>/<k>"); both from one place, so the
    questions' gold passages are always the corpus's ids."""
    corpus, qa = f"{TEAM_SQUAD}/corpus_train.jsonl", f"{TEAM_SQUAD}/qa_train.jsonl"
    if os.path.isfile(corpus) and os.path.isfile(qa):
        return corpus, qa
    return SQUAD_TRAIN_URL, SQUAD_TRAIN_URL


SHARED_TRAIN_FIELDS = (
    "train.weight_decay",
    "train.grad_clip",
    "train.adam_b1",
    "train.adam_b2",
    "train.adam_eps",
    "train.seed",
    "train.keep_checkpoints",
    "train.preemption_save",
    "train.max_nonfinite",
    "train.stall_timeout_s",
    "train.stall_floor_s",
    "train.first_step_timeout_s",
    "train.record_example_ids",
    "train.stop_check_every",  # the loop's collective stop check: every task's alike
    "train.profile_steps",  # the loop's profiler trace: every task's alike
    "train.num_candidates",  # REALM's candidates: ICT and fine-tuning do not read it
    "train.mlm_vocab_chunk",  # REALM's MLM head: ICT and fine-tuning have none
    "train.grad_accum",  # REALM's micro-batches: ICT and fine-tuning take one pass
    "train.null_doc",  # REALM's null document: ICT and fine-tuning have none
    "train.bm25_candidates",  # REALM's second retriever: ICT and fine-tuning do not read it
    "train.article_block_steps",  # REALM's curriculum: ICT and fine-tuning have none
    "train.inbatch_negatives",  # REALM's prior over the batch: ICT has its own in-batch loss
    "train.imitation_weight",  # REALM's imitation term: ICT has ict.positives=bm25
    "train.realm_retriever_grad",  # REALM's gradient on the retriever: ICT has no reader
    "train.imitation_negatives",  # REALM's imitation term's negatives
)


def sibling_config(config_file: str, name: str, arg: str | None) -> ml_collections.ConfigDict:
    """get_config(arg) of the config file `name` beside `config_file`: a task's config
    (configs/ict.py, configs/orqa.py) builds on configs/realm.py's variant this way."""
    here = os.path.dirname(os.path.abspath(config_file))
    return _load_module(os.path.join(here, name)).get_config(arg)


def split_spec(spec: str) -> tuple[str, str | None]:
    """'configs/realm.py:smoke' -> ('configs/realm.py', 'smoke')."""
    path, _, arg = spec.partition(":")
    return path, (arg or None)


def load_config(
    spec: str, overrides: list[str] | tuple[str, ...] = ()
) -> ml_collections.ConfigDict:
    """Load a config from 'path.py[:variant]' and apply 'a.b=value' overrides."""
    path, arg = split_spec(spec)
    module = _load_module(path)
    try:
        config = module.get_config(arg)
    except (ValueError, KeyError) as e:  # an unknown variant, as the config file words it
        raise ConfigError(f"{spec}: {e}") from e
    except Exception as e:  # the config file's own code
        raise ConfigError(f"{_where(e, path)}: {type(e).__name__}: {e}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"{spec}: get_config returned {type(config).__name__}, not a ConfigDict")
    config.lock()
    for item in overrides:
        apply_override(config, item)
    return config


def _all_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in config.items():
        full = f"{prefix}{k}"
        keys.append(full)
        if isinstance(v, ml_collections.ConfigDict):
            keys.extend(_all_keys(v, full + "."))
    return keys


def _parse_value(raw: str, current, key: str):
    if isinstance(current, bool):
        low = raw.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}: expected a boolean, got {raw!r}")
    if isinstance(current, int):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected an integer, got {raw!r}") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected a number, got {raw!r}") from None
    if isinstance(current, (tuple, list)):
        value = _parse_tuple(raw)
        if value is None:
            raise ConfigError(f"--config.{key}: expected a tuple such as (2, 4), got {raw!r}")
        return type(current)(value)
    return raw


def _parse_tuple(raw: str) -> tuple | None:
    """'(2, 4)', '[8]', '8,' or "('data', 'model')" -> a tuple of ints, floats or strings;
    None if malformed. Parsed by hand: ast.literal_eval on CPython 3.11.7 can raise
    SystemError ('AST constructor recursion depth mismatch') while another thread compiles
    code, which happened here with orbax's background threads alive."""
    text = raw.strip()
    if text[:1] in "([":
        if text[-1:] != {"(": ")", "[": "]"}[text[0]]:
            return None
        text = text[1:-1]
    parts = [p.strip() for p in text.split(",")]
    if parts and parts[-1] == "" and len(parts) > 1:
        parts.pop()  # a trailing comma: (8,)
    items = []
    for part in parts:
        if not part:
            return None
        if len(part) >= 2 and part[0] == part[-1] and part[0] in "'\"":
            items.append(part[1:-1])
            continue
        try:
            items.append(int(part))
        except ValueError:
            try:
                items.append(float(part))
            except ValueError:
                return None
    return tuple(items)


def _suggestions(config: ml_collections.ConfigDict, key: str) -> list[str]:
    """Up to 3 value keys close to a misspelt `key` ('train.lrr' -> train.lr), else those
    with its last part ('lr' -> train.lr)."""
    known = [
        k for k in _all_keys(config) if not isinstance(_get(config, k), ml_collections.ConfigDict)
    ]
    last = key.rsplit(".", 1)[-1]
    return (
        difflib.get_close_matches(key, known, n=3)
        or [k for k in known if k.rsplit(".", 1)[-1] == last][:3]
    )


def apply_override(config: ml_collections.ConfigDict, item: str) -> None:
    """Apply one 'a.b=value' override; unknown keys raise a ConfigError naming the key."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.removeprefix("--").removeprefix("config.")
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            close = _suggestions(config, key)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        if i < len(parts) - 1:
            node = node[part]
    current = node[parts[-1]]
    if isinstance(current, ml_collections.ConfigDict):
        raise ConfigError(f"config key {key!r} is a section, not a value")
    node[parts[-1]] = _parse_value(raw, current, key)


def default_config_path() -> str:
    """configs/realm.py next to the package (a source checkout) or in the CWD."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for base in (here, os.getcwd()):
        path = os.path.join(base, "configs", "realm.py")
        if os.path.isfile(path):
            return path
    return os.path.join("configs", "realm.py")


# ------------------------------------------------------------------------------- validation
# Values every command can check before any work: (field, test, what is allowed). A field
# absent from a config (another task's section) is not checked.
MIN_BLOCK_LEN = 8  # [CLS] title [SEP] body [SEP]: a title keeps at most half of a block
MIN_QUERY_LEN = 8  # [CLS] sentence [SEP], with room for a masked span
CHOICES = {
    "task": ("realm", "ict", "qa"),
    "data.masking": ("salient", "random"),
    "data.mask_mode": ("salient", "random_span", "uniform"),  # = data/masking.py MASK_MODES
    "data.eval_mask_mode": ("", "salient", "random_span", "uniform"),  # "" = data.mask_mode
    "train.null_doc": ("scored", "fixed"),  # = pretrain/step.py NULL_DOCS
    "train.imitation_negatives": ("candidates", "positives"),  # pretrain/step.py imitation_term
    "ict.positives": ("own_block", "bm25"),
    "qa.dev_retriever": ("dense", "bm25", "hybrid"),
    "qa.retriever": ("dense", "bm25", "hybrid"),
    "data.eval_split_key": ("title", "doc_id"),
    "data.engine": ("auto", "local", "beam"),
    "refresh.mode": ("external", "inprocess", "amortized"),
    "model.dtype": ("float32", "bfloat16"),
    "model.embedder_pooling": ("realm", "mean", "cls"),  # = model/bert.py EMBEDDER_POOLINGS
    "model.embedder.hidden_act": ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    "model.reader.hidden_act": ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
}


def _at_least(n):
    return (lambda v: v >= n), f"at least {n}"


RANGES = {
    "data.block_len": _at_least(MIN_BLOCK_LEN),
    "data.query_len": _at_least(MIN_QUERY_LEN),
    "data.max_predictions": _at_least(1),
    "data.min_sentence_tokens": _at_least(0),
    "data.random_span_max": _at_least(1),
    "data.worker_count": _at_least(0),
    "data.ner_processes": _at_least(1),
    "data.beam_min_passages": _at_least(0),
    "data.beam_chunk_kb": _at_least(1),
    "data.beam_window_kb": _at_least(0),
    "data.beam_shard_records": _at_least(1),
    "data.release_chunk_blocks": _at_least(1),
    "data.eval_fraction": ((lambda v: 0 <= v < 1), "in [0, 1)"),
    "train.batch_size": _at_least(1),
    "train.grad_accum": _at_least(1),
    "train.eval_batch_size": _at_least(1),
    "train.steps": _at_least(1),
    "train.lr": ((lambda v: v > 0), "positive"),
    "train.warmup_steps": ((lambda v: v >= -1), "-1 (automatic) or at least 0"),
    "train.embedder_lr_scale": _at_least(0),
    "train.embedders_frozen_steps": _at_least(0),
    "train.own_block_steps": _at_least(0),
    "train.bm25_candidates": _at_least(0),
    "train.imitation_weight": _at_least(0),
    "train.article_block_steps": _at_least(0),
    "train.embedders_warmup_steps": _at_least(0),
    "train.weight_decay": _at_least(0),
    "train.grad_clip": ((lambda v: v > 0), "positive"),
    "train.mlm_vocab_chunk": ((lambda v: v >= -1), "-1 (dense logits), 0 (all) or positive"),
    "train.log_every": _at_least(1),
    "train.checkpoint_every": _at_least(1),
    "train.keep_checkpoints": _at_least(1),
    "train.eval_every": ((lambda v: v >= 0), "0 (off) or positive"),
    "train.eval_examples": ((lambda v: v >= 0), "0 (all) or positive"),
    "train.max_nonfinite": _at_least(1),
    "train.stall_timeout_s": ((lambda v: v >= 0), "0 (automatic) or positive seconds"),
    "train.stall_floor_s": ((lambda v: v > 0), "positive seconds"),
    "train.first_step_timeout_s": ((lambda v: v > 0), "positive seconds"),
    "refresh.every": _at_least(1),
    "refresh.max_restarts": _at_least(0),
    "refresh.stopped_grace_s": ((lambda v: v > 0), "positive seconds"),
    "refresh.check_every": _at_least(1),
    "refresh.keep": _at_least(1),
    "refresh.embed_batch_size": _at_least(1),
    "refresh.poll_seconds": ((lambda v: v > 0), "positive"),
    "refresh.wait_seconds": _at_least(0),
    "refresh.progress_every_blocks": _at_least(1),
    "ict.mask_rate": ((lambda v: 0 <= v <= 1), "in [0, 1]"),
    "qa.bm25_weight": _at_least(0),
    "qa.hybrid_bm25_weight": _at_least(0),
    "qa.hybrid_pool": _at_least(1),
    "qa.refresh_every": _at_least(0),
}
for _part in ("embedder", "reader"):
    for _field in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
        RANGES[f"model.{_part}.{_field}"] = _at_least(1)
    RANGES[f"model.{_part}.max_position_embeddings"] = _at_least(MIN_QUERY_LEN)
    RANGES[f"model.{_part}.dropout"] = ((lambda v: 0 <= v < 1), "in [0, 1)")
RANGES["model.proj_size"] = _at_least(1)
RANGES["model.retrieval_scale"] = ((lambda v: v > 0), "positive")  # a scale keeps the ranking


_MISSING = object()


def _get(config: ml_collections.ConfigDict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _mesh_problems(config) -> list[str]:
    axes, shape = _get(config, "mesh.axes"), _get(config, "mesh.shape")
    if axes is _MISSING or shape is _MISSING:
        return []
    axes, shape = tuple(axes), tuple(shape)
    if len(axes) != len(shape):
        return [f"mesh.axes={axes} and mesh.shape={shape}: must have the same length"]
    out = []
    if "data" not in axes:
        out.append(f"mesh.axes={axes}: must include 'data'")
    if any(s != -1 and s < 1 for s in shape) or shape.count(-1) > 1:
        out.append(f"mesh.shape={shape}: sizes must be positive, with at most one -1 (the rest)")
    elif "data" in axes and shape[axes.index("data")] != -1:
        data = shape[axes.index("data")]  # known now; a -1 is checked once devices are known
        keys = ["train.batch_size"]
        evaluates = _get(config, "train.eval_every") not in (0, _MISSING)
        if _get(config, "task") == "realm" and evaluates:
            keys.append("train.eval_batch_size")  # REALM's evaluation shards its batch too
        for key in keys:
            b = _get(config, key)
            if b is not _MISSING and b > 0 and b % data:
                out.append(
                    f"{key}={b}: must be divisible by the mesh's data axis ({data}, "
                    f"mesh.shape={shape}); change {key} or mesh.shape"
                )
    data = shape[axes.index("data")] if "data" in axes else 1
    out.extend(_accum_problems(config, max(data, 1)))  # -1: known once devices are
    return out


def _accum_problems(config, data: int) -> list[str]:
    """REALM's batch must split into train.grad_accum micro-batches, each over the data axis
    (data = 1 while the axis is -1: sharding.check_batch checks it once devices are known)."""
    n, b = _get(config, "train.grad_accum"), _get(config, "train.batch_size")
    if _get(config, "task") != "realm" or _MISSING in (n, b) or n <= 1 or b % (n * data) == 0:
        return []
    return [
        f"train.grad_accum={n}: train.batch_size={b} must be divisible by {n * data} "
        f"(grad_accum x the mesh's data axis {data}); change either"
    ]


def _length_problems(config) -> list[str]:
    """Inputs must fit the networks' position tables (REALM and ICT pre-training)."""
    task = _get(config, "task")
    block, query = _get(config, "data.block_len"), _get(config, "data.query_len")
    emb = _get(config, "model.embedder.max_position_embeddings")
    reader = _get(config, "model.reader.max_position_embeddings")
    if task not in ("realm", "ict") or _MISSING in (block, query, emb, reader):
        return []
    out = [
        f"{key}={n}: must be at most model.embedder.max_position_embeddings ({emb})"
        for key, n in (("data.block_len", block), ("data.query_len", query))
        if n > emb
    ]
    if task == "realm" and query + block - 1 > reader:
        out.append(
            f"data.query_len + data.block_len - 1 = {query + block - 1} (the reader's input): "
            f"must be at most model.reader.max_position_embeddings ({reader})"
        )
    return out


def _lockstep_problems(config) -> list[str]:
    """A lockstep refresh waits at every refresh.every steps for that step's checkpoint."""
    lockstep, mode = _get(config, "refresh.lockstep"), _get(config, "refresh.mode")
    every, ckpt = _get(config, "refresh.every"), _get(config, "train.checkpoint_every")
    if lockstep is not True or mode != "external" or _get(config, "task") != "realm":
        return []
    if _MISSING in (every, ckpt) or every < 1 or ckpt < 1 or every % ckpt == 0:
        return []
    return [
        f"refresh.lockstep=True needs train.checkpoint_every ({ckpt}) to divide refresh.every "
        f"({every}): the trainer waits at every refresh.every steps for that step's index"
    ]


def check_reader_start(config: ml_collections.ConfigDict) -> None:
    """A fresh fine-tuning run (configs/orqa.py) whose embedders start from a sentence embedder
    (model.init_retriever_from) must start its reader from something: a ConfigError naming
    model.init_from_realm and model.init_reader_from when both are empty (configs/orqa.py:own
    leaves init_from_realm to the user). Not part of validate(): `evaluate --retrieval_only
    --checkpoint initial` scores such a retriever with no reader at all."""
    retriever = _get(config, "model.init_retriever_from")
    starts = [_get(config, f"model.{k}") for k in ("init_from_realm", "init_reader_from")]
    if retriever in (_MISSING, "") or any(x not in (_MISSING, "") for x in starts):
        return
    raise ConfigError(
        "model.init_from_realm and model.init_reader_from are both empty: fine-tuning would "
        "start the reader from random weights beside the retriever of "
        f"model.init_retriever_from={retriever}; give --config.model.init_from_realm=<your "
        "REALM workdir> (the own recipe), or --config.model.init_reader_from=<a BERT folder or "
        f"hub id, e.g. {BERT_TINY}> to fine-tune without REALM"
    )


def validate(config: ml_collections.ConfigDict) -> None:
    """Check the config's values before any work (the CLI calls this after loading): a
    ConfigError naming each bad field, its value and what is allowed. Checks that need the
    devices or the prepared data (a mesh with -1, blocks per device) run where those are
    known, still before any checkpoint is written."""
    problems = []
    for key, allowed in CHOICES.items():
        value = _get(config, key)
        if value is not _MISSING and value not in allowed:
            problems.append(f"{key}={value!r}: must be one of {', '.join(allowed)}")
    for key, (ok, allowed) in RANGES.items():
        value = _get(config, key)
        if value is not _MISSING and not ok(value):
            problems.append(f"{key}={value!r}: must be {allowed}")
    if _get(config, "task") == "realm":
        own, frozen = (
            _get(config, "train.own_block_steps"),
            _get(config, "train.embedders_frozen_steps"),
        )
        scale = _get(config, "train.embedder_lr_scale")
        if _MISSING not in (own, frozen) and own > frozen and scale != 0:
            problems.append(
                f"train.own_block_steps={own}: must be at most train.embedders_frozen_steps "
                f"({frozen}) unless train.embedder_lr_scale=0: a retriever that trains while "
                "the own block can be retrieved learns the trivial match (the release always "
                "excludes the own block)"
            )
        mode = _get(config, "data.mask_mode")
        for key in ("train.bm25_candidates", "train.article_block_steps"):
            m = _get(config, key)
            if m is not _MISSING and m > 0 and mode not in (_MISSING, "salient"):
                problems.append(
                    f"{key}={m}: needs data.mask_mode=salient, not {mode!r} (its blocks are "
                    "found once per salient span, with BM25's candidates)"
                )
        weight, m = _get(config, "train.imitation_weight"), _get(config, "train.bm25_candidates")
        if _MISSING not in (weight, m) and weight > 0 and m < 1:
            problems.append(
                f"train.imitation_weight={weight}: needs train.bm25_candidates >= 1 (its "
                "positive is BM25's top block for the masked sentence, a joined candidate)"
            )
        if _get(config, "train.realm_retriever_grad") is False and weight in (0, _MISSING):
            problems.append(
                "train.realm_retriever_grad=False with train.imitation_weight=0: the "
                "embedders would get no gradient at all; freeze them with "
                "train.embedders_frozen_steps instead"
            )
        k = _get(config, "train.num_candidates")
        if k is not _MISSING and k < 2:
            problems.append(
                f"train.num_candidates={k}: must be at least 2 (the null document and at "
                "least one retrieved block)"
            )
    for part in ("embedder", "reader"):
        h, n = _get(config, f"model.{part}.hidden_size"), _get(config, f"model.{part}.num_heads")
        if _MISSING not in (h, n) and h > 0 and n > 0 and h % n:
            problems.append(
                f"model.{part}.hidden_size={h}: must be divisible by model.{part}.num_heads ({n})"
            )
    problems += _mesh_problems(config) + _length_problems(config) + _lockstep_problems(config)
    if problems:
        raise ConfigError("; ".join(problems))
