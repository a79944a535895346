"""Every shipped config variant and sweep point loads; overrides are typed and checked; the CLI
rejects a misspelt key before JAX starts."""

import os
import re

import ml_collections
import pytest

from realm_jax import sweep
from realm_jax.config import ConfigError, load_config
from tests.conftest import REPO, run_cli

CONFIG = os.path.join(REPO, "configs", "realm.py")
VARIANTS = ("smoke", "small", "base", "squad", "own")
COMMANDS = ("prepare", "train", "refresh", "local", "finetune", "evaluate", "ask")


def _leaves(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_loads_and_is_locked(variant):
    config = load_config(f"{CONFIG}:{variant}")
    assert config.variant == variant
    for part in (config.model.embedder, config.model.reader):
        assert part.hidden_size % part.num_heads == 0
    with pytest.raises(AttributeError):
        config.train.lrr = 1.0  # a misspelt field must not be silently added
    with pytest.raises(AttributeError):
        config.new_section = 1
    assert "lrr" not in config.train


def test_default_variant_is_smoke():
    assert load_config(CONFIG).variant == "smoke"


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="tiny"):
        load_config(f"{CONFIG}:tiny")


def _commented_assignments() -> tuple[set[str], list[str]]:
    """(fields assigned in configs/realm.py as 'section.field', lines lacking a # comment)."""
    pattern = re.compile(r"^\s*(?:c\.(\w+)\.(\w+)|m\.(\w+)|c\.(variant|task))\s*=[^=]")
    fields, uncommented = set(), []
    with open(CONFIG) as f:
        for lineno, line in enumerate(f, 1):
            m = pattern.match(line)
            if not m:
                continue
            section, field, model_field, top = m.groups()
            fields.add(
                f"{section}.{field}" if section else f"model.{model_field}" if model_field else top
            )
            if "#" not in line:
                uncommented.append(f"configs/realm.py:{lineno}: {line.strip()}")
    return fields, uncommented


def test_every_field_has_a_comment():
    fields, uncommented = _commented_assignments()
    assert not uncommented, "config fields without a comment:\n" + "\n".join(uncommented)
    for variant in VARIANTS:
        leaves = _leaves(load_config(f"{CONFIG}:{variant}"))
        # model.embedder.X and model.reader.X are assigned once, as m.X in _bert()
        leaves = [re.sub(r"^model\.(embedder|reader)\.", "model.", k) for k in leaves]
        missing = sorted(set(leaves) - fields)
        assert not missing, f"{variant}: fields not assigned on a commented line: {missing}"


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("train.steps=123", "train.steps", 123),  # int
        ("train.lr=2e-4", "train.lr", 2e-4),  # float
        ("train.lr=1", "train.lr", 1.0),  # an int literal for a float field
        ("train.preemption_save=false", "train.preemption_save", False),  # bool
        ("refresh.build_scann=True", "refresh.build_scann", True),
        ("data.masking=random", "data.masking", "random"),  # str
        ("mesh.shape=(2, 4)", "mesh.shape", (2, 4)),  # tuple
        ("mesh.shape=(8,)", "mesh.shape", (8,)),
        ("mesh.axes=('x', \"y\")", "mesh.axes", ("x", "y")),
        ("--config.model.dtype=bfloat16", "model.dtype", "bfloat16"),  # CLI spelling
    ],
)
def test_override_types(override, key, expected):
    config = load_config(f"{CONFIG}:smoke", [override])
    section, field = key.split(".")
    value = config[section][field]
    assert value == expected and type(value) is type(expected)


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(ConfigError, match=r"train\.lrr") as err:
        load_config(f"{CONFIG}:smoke", ["train.lrr=1e-4"])
    assert "train.lr" in str(err.value).replace("train.lrr", "")  # the suggestion
    with pytest.raises(ConfigError, match=r"nosuch\.field"):
        load_config(f"{CONFIG}:smoke", ["nosuch.field=1"])
    with pytest.raises(ConfigError, match="section"):
        load_config(f"{CONFIG}:smoke", ["train=1"])


@pytest.mark.parametrize(
    "override",
    [
        "train.steps=abc",
        "train.steps=1.5",
        "train.lr=fast",
        "train.preemption_save=maybe",
        "mesh.shape=(2,",
        "train.lr",
    ],
)
def test_wrong_type_is_rejected(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(f"{CONFIG}:smoke", [override])


def test_every_sweep_point_validates():
    import importlib.util

    spec = importlib.util.spec_from_file_location("realm_config_for_test", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    raw = module.sweep()
    for variant in VARIANTS:
        points = sweep.sweep_points(f"{CONFIG}:{variant}")
        assert len(points) == len(raw)
        assert len({name for name, _ in points}) == len(points)
        for (name, overrides), point in zip(points, raw, strict=True):
            assert all(o.startswith("--config.") for o in overrides)
            config = load_config(f"{CONFIG}:{variant}", overrides)
            for key, value in point.items():
                section, field = key.split(".")
                assert config[section][field] == value, (name, key)
                assert f"{field}={value}" in name


def test_sweep_names():
    points = sweep.sweep_points(CONFIG)  # default variant: small
    assert points[0] == (
        "lr=5e-05,num_candidates=4",
        ["--config.train.lr=5e-05", "--config.train.num_candidates=4"],
    )
    with pytest.raises(ConfigError, match="declares a search"):  # the world variant searches
        sweep.sweep_points(f"{CONFIG}:world")


def test_bad_sweeps_fail_before_launch(tmp_path):
    base = (
        "def get_config(arg=None):\n    import ml_collections\n"
        "    c = ml_collections.ConfigDict()\n    c.train = ml_collections.ConfigDict()\n"
        "    c.train.lr = 0.1  # lr\n    c.train.shape = (1, 2)  # shape\n    return c\n"
    )
    no_sweep = tmp_path / "no_sweep.py"
    no_sweep.write_text(base)
    with pytest.raises(ConfigError, match="sweep"):
        sweep.sweep_points(str(no_sweep))
    typo = tmp_path / "typo.py"
    typo.write_text(base + "def sweep():\n    return [{'train.lr': 1.0}, {'train.lrr': 2.0}]\n")
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        sweep.sweep_points(str(typo))
    wrong_type = tmp_path / "wrong_type.py"
    wrong_type.write_text(base + "def sweep():\n    return [{'train.lr': 'fast'}]\n")
    with pytest.raises(ConfigError, match="train.lr"):
        sweep.sweep_points(str(wrong_type))
    tuples = tmp_path / "tuples.py"
    tuples.write_text(base + "def sweep():\n    return [{'train.shape': (4, 8)}]\n")
    assert sweep.sweep_points(str(tuples)) == [("shape=4x8", ["--config.train.shape=(4,8)"])]


def test_cli_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), (command, result.stdout)


def test_cli_rejects_unknown_override_before_work(tmp_path):
    result = run_cli("train", "--workdir", str(tmp_path / "run"), "--config.train.lrr=1")
    assert result.returncode != 0
    assert "train.lrr" in result.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def _mutated(config: ml_collections.ConfigDict, section: str) -> ml_collections.ConfigDict:
    """A copy of `config` with every scalar field of `section` changed (numbers doubled plus
    one, booleans flipped, strings suffixed)."""
    out = ml_collections.ConfigDict(config.to_dict())
    for key, value in out[section].items():
        if isinstance(value, bool):
            out[section][key] = not value
        elif isinstance(value, int | float):
            out[section][key] = type(value)(value * 2 + 1)
        elif isinstance(value, str):
            out[section][key] = value + "-mutated"
    return out


@pytest.mark.parametrize(
    "task,variant",
    [(t, v) for t in ("ict", "orqa") for v in VARIANTS if (t, v) != ("ict", "own")]
    + [("orqa", "squad_read"), ("orqa", "own_read")],
)
def test_task_configs_inherit_no_training_setting_silently(task, variant, monkeypatch):
    """A task config (ICT, ORQA) built on configs/realm.py must set every train.* field that
    shapes what it trains itself, or name it in its INHERITED tuple. Every train field of the
    REALM variant is changed under it; a task field that follows the change was inherited.
    (configs/ict.py:squad once ran ICT at a tenth of its LR through REALM's
    train.embedder_lr_scale=0.1.)"""
    from realm_jax import config as config_lib

    real = config_lib.sibling_config

    def mutated_base(config_file, name, arg):
        return _mutated(real(config_file, name, arg), "train")

    path = os.path.join(REPO, "configs", f"{task}.py")
    plain = load_config(f"{path}:{variant}")
    monkeypatch.setattr(config_lib, "sibling_config", mutated_base)
    shifted = load_config(f"{path}:{variant}")
    followed = {f"train.{k}" for k in plain.train if plain.train[k] != shifted.train[k]}
    allowed = set(config_lib._load_module(path).INHERITED)
    assert followed <= allowed, f"{task}.py:{variant} inherits {sorted(followed - allowed)}"
    assert "train.embedder_lr_scale" not in allowed


def test_ict_squad_trains_its_embedders_at_the_full_lr():
    ict = load_config(os.path.join(REPO, "configs", "ict.py") + ":squad")
    realm = load_config(f"{CONFIG}:squad")
    assert realm.train.embedder_lr_scale == 0.1 and ict.train.embedder_lr_scale == 1.0


def test_the_reading_phase_trains_the_reader_alone_on_training_articles():
    """configs/orqa.py:squad_read (issue 22's reading phase): bert-tiny's reader on gold
    passages, one block a question, no held-out article, the retriever left as it is; its span
    head fits the squad recipe's, so REALM pre-training can carry it into fine-tuning."""
    read = load_config(os.path.join(REPO, "configs", "orqa.py") + ":squad_read")
    squad = load_config(os.path.join(REPO, "configs", "orqa.py") + ":squad")
    realm = load_config(f"{CONFIG}:squad")
    assert read.variant == "squad_read" and read.task == "qa"
    assert read.qa.gold_in_beam and read.qa.reader_beam_size == 1
    assert read.qa.train_holdout == "train" and read.train.embedder_lr_scale == 0.0
    assert read.model.init_from_realm == ""
    assert read.model.init_reader_from == "google/bert_uncased_L-2_H-128_A-2"  # by hub id
    for field in ("span_hidden_size", "max_span_width"):
        assert read.model[field] == squad.model[field] == realm.model[field]
    assert not realm.model.init_span_head_from_realm  # pre-training's head is never trained


def test_lockstep_refresh_needs_checkpoints_at_every_refresh():
    from realm_jax.config import validate

    over = ["refresh.lockstep=true", "refresh.every=5"]
    validate(load_config(f"{CONFIG}:smoke", over + ["train.checkpoint_every=5"]))
    with pytest.raises(ConfigError, match="checkpoint_every.*divide refresh.every"):
        validate(load_config(f"{CONFIG}:smoke", over + ["train.checkpoint_every=3"]))


def test_own_block_steps_need_a_frozen_retriever():
    """train.own_block_steps lets REALM retrieve the masked sentence's own block: allowed only
    while the embedders are frozen (train.embedders_frozen_steps, or embedder_lr_scale=0)."""
    from realm_jax.config import validate

    validate(
        load_config(
            f"{CONFIG}:smoke", ["train.own_block_steps=5", "train.embedders_frozen_steps=5"]
        )
    )
    validate(
        load_config(f"{CONFIG}:smoke", ["train.own_block_steps=5", "train.embedder_lr_scale=0"])
    )
    with pytest.raises(ConfigError, match="own_block_steps=6: must be at most"):
        validate(
            load_config(
                f"{CONFIG}:smoke", ["train.own_block_steps=6", "train.embedders_frozen_steps=5"]
            )
        )
    with pytest.raises(ConfigError, match="embedders_frozen_steps=-1: must be at least 0"):
        validate(load_config(f"{CONFIG}:smoke", ["train.embedders_frozen_steps=-1"]))


def test_grad_accum_must_split_the_batch_over_the_data_axis():
    """train.grad_accum micro-batches must each divide over the mesh's data axis: a named
    error before any work (smoke: batch 8)."""
    from realm_jax.config import validate

    validate(load_config(f"{CONFIG}:smoke", ["train.grad_accum=4", "mesh.shape=(2, -1)"]))
    with pytest.raises(ConfigError, match=r"train\.grad_accum=4: train\.batch_size=8 .* by 16"):
        validate(load_config(f"{CONFIG}:smoke", ["train.grad_accum=4", "mesh.shape=(4, -1)"]))
    with pytest.raises(ConfigError, match=r"train\.grad_accum=3"):
        validate(load_config(f"{CONFIG}:smoke", ["train.grad_accum=3"]))
    with pytest.raises(ConfigError, match=r"train\.grad_accum=0: must be at least 1"):
        validate(load_config(f"{CONFIG}:smoke", ["train.grad_accum=0"]))


ORQA = os.path.join(REPO, "configs", "orqa.py")
ICT = os.path.join(REPO, "configs", "ict.py")


def test_own_is_the_squad_recipe_from_minilm_without_ict():
    """configs/realm.py:own and configs/orqa.py:own (issue 59): squad's sizes and bert-tiny
    reader, the embedders from all-MiniLM-L6-v2 by hub id and no ICT (configs/ict.py refuses
    `own`), the corpus and questions the user's (no default), answers from the hybrid."""
    from realm_jax import config as config_lib

    own, squad = load_config(f"{CONFIG}:own"), load_config(f"{CONFIG}:squad")
    assert config_lib.MINILM == "sentence-transformers/all-MiniLM-L6-v2"
    m = own.model
    assert m.init_retriever_from == config_lib.MINILM and m.init_reader_from == config_lib.BERT_TINY
    assert m.init_embedders_from_ict == "" and m.init_embedder_from == ""
    assert own.data.corpus == "" and own.data.data_dir == ""
    assert own.refresh.mode == "inprocess" and own.refresh.every == 50
    assert own.train.to_dict() == squad.train.to_dict()
    for key in ("block_len", "query_len", "max_predictions", "eval_fraction", "masking"):
        assert own.data[key] == squad.data[key], key
    assert own.model.reader.to_dict() == squad.model.reader.to_dict()
    qa, qa_squad = load_config(f"{ORQA}:own"), load_config(f"{ORQA}:squad")
    assert qa.variant == "own" and qa.task == "qa"
    assert qa.qa.retriever == "hybrid" and qa_squad.qa.retriever == "dense"
    assert qa.qa.train_file == qa.qa.dev_file == ""
    assert (qa.qa.train_holdout, qa.qa.dev_holdout) == ("train", "heldout")
    assert qa.model.init_from_realm == "" and qa.model.init_reader_from == ""
    assert qa.model.init_retriever_from == config_lib.MINILM
    assert qa.train.to_dict() == qa_squad.train.to_dict()
    for key in ("retriever_beam_size", "reader_beam_size", "hybrid_bm25_weight", "gold_in_beam"):
        assert qa.qa[key] == qa_squad.qa[key], key
    with pytest.raises(ConfigError, match="no ICT stage"):
        load_config(f"{ICT}:own")


def test_own_read_is_the_reading_phase_on_the_users_data_from_minilm():
    """configs/orqa.py:own_read (issue 59, the recipe's default): squad_read's reading phase
    (bert-tiny's reader, one gold block a question, the retriever frozen) with own's data
    (the user's corpus and questions) and all-MiniLM-L6-v2 retrieving; it answers from the
    hybrid's top 5 (squad's reader beam), as the study's 12.2% was read, and it needs no REALM
    run."""
    from realm_jax import config as config_lib
    from realm_jax.config import check_reader_start
    from realm_jax.qa.evaluation import eval_reader_beam

    read = load_config(f"{ORQA}:own_read")
    squad_read, own = load_config(f"{ORQA}:squad_read"), load_config(f"{ORQA}:own")
    assert read.variant == "own_read" and read.task == "qa"
    assert read.model.init_retriever_from == config_lib.MINILM
    assert read.model.init_reader_from == config_lib.BERT_TINY and read.model.init_from_realm == ""
    check_reader_start(read)  # no REALM workdir needed
    assert read.train.to_dict() == squad_read.train.to_dict()  # 2,400 steps, embedders frozen
    assert read.train.embedder_lr_scale == 0.0
    assert read.qa.reader_beam_size == 1 and read.qa.gold_in_beam
    assert eval_reader_beam(read.qa) == 5 == own.qa.reader_beam_size == eval_reader_beam(own.qa)
    assert eval_reader_beam(squad_read.qa) == 1  # (scored with `evaluate --retriever gold`)
    assert read.qa.retriever == "hybrid" and read.qa.train_file == read.qa.dev_file == ""
    for key in ("retriever_beam_size", "hybrid_bm25_weight", "bm25_weight", "train_holdout"):
        assert read.qa[key] == own.qa[key], key
    assert read.data.to_dict() == own.data.to_dict()


def test_own_resolves_minilm_by_id_offline_and_needs_a_reader_start():
    """The hub id resolves offline (the tests' seeded cache) into MiniLM's architecture and
    retrieval fields; configs/orqa.py:own without model.init_from_realm (or init_reader_from)
    is one error naming both fields when finetune starts afresh (not in validate: a
    retrieval-only evaluation of the start needs no reader)."""
    from realm_jax.config import check_reader_start, validate
    from realm_jax.interop import sentence_embedder
    from tests.support.sentence_model import minilm_by_id

    minilm_by_id()
    realm = load_config(f"{CONFIG}:own")
    assert sentence_embedder.resolve(realm).startswith("model.init_retriever_from=sentence-")
    e = realm.model
    assert (e.embedder.hidden_size, e.embedder.num_layers, e.proj_size) == (384, 6, 384)
    assert (e.embedder_pooling, e.embedder_normalize, e.retrieval_scale) == ("mean", True, 20.0)
    assert e.reader.hidden_size == 128  # bert-tiny's reader
    validate(realm)
    qa = load_config(f"{ORQA}:own")
    sentence_embedder.resolve(qa)
    validate(qa)  # `evaluate --retrieval_only --checkpoint initial` needs no reader
    with pytest.raises(ConfigError, match=r"model\.init_from_realm and model\.init_reader_from"):
        check_reader_start(qa)  # finetune's check before a fresh run
    for given in ("model.init_from_realm=runs/mine", "model.init_reader_from=x"):
        check_reader_start(load_config(f"{ORQA}:own", [given]))
    check_reader_start(load_config(f"{ORQA}:smoke"))  # no sentence embedder: not its concern


def test_evaluate_and_ask_default_to_the_configs_retriever():
    """--retriever not given: the config's qa.retriever (own: hybrid), dense without one."""
    from realm_jax import cli

    parser = cli._parser()
    for command in ("evaluate", "ask"):
        assert parser.parse_args([command, "--workdir", "w"]).retriever is None
    assert cli.default_retriever(load_config(f"{ORQA}:own")) == "hybrid"
    assert cli.default_retriever(load_config(f"{ORQA}:smoke")) == "dense"
    assert cli.default_retriever(load_config(f"{CONFIG}:smoke")) == "dense"  # no qa section
    with pytest.raises(ConfigError, match="qa.retriever"):
        from realm_jax.config import validate

        validate(load_config(f"{ORQA}:own", ["qa.retriever=gold"]))


def test_a_missing_corpus_or_question_file_names_its_field():
    from realm_jax.corpus_errors import CorpusError
    from realm_jax.data import prepare
    from realm_jax.qa import data as qa_data

    with pytest.raises(CorpusError, match=r"data\.corpus is empty.*--config\.data\.corpus="):
        prepare.fingerprint(load_config(f"{CONFIG}:own").data)
    with pytest.raises(ValueError, match=r"qa\.train_file is empty"):
        qa_data.load_questions("", "auto", "train", "unused")
    with pytest.raises(ValueError, match=r"qa\.dev_file is empty"):
        qa_data.load_questions("", "auto", "heldout", "unused")
