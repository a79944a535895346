"""Every shipped config variant and sweep point loads; overrides are typed and checked; the CLI
rejects a misspelt key before JAX starts."""

import os
import re
import subprocess
import sys

import ml_collections
import pytest

from realm_jax import sweep
from realm_jax.config import ConfigError, load_config
from tests.conftest import REPO

CONFIG = os.path.join(REPO, "configs", "realm.py")
VARIANTS = ("smoke", "small", "base", "squad")
COMMANDS = ("prepare", "train", "refresh", "local", "finetune", "evaluate", "ask")


def _leaves(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


def test_sweep_names_and_cli(capsys):
    points = sweep.sweep_points(CONFIG)  # default variant: small
    assert points[0] == (
        "lr=5e-05,num_candidates=4",
        ["--config.train.lr=5e-05", "--config.train.num_candidates=4"],
    )
    assert sweep.main([CONFIG]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0] == "lr=5e-05,num_candidates=4\t--config.train.lr=5e-05 "
        "--config.train.num_candidates=4"
    )
    assert len(lines) == len(points)


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
    result = _run_cli("--help")
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), (command, result.stdout)


def test_cli_rejects_unknown_override_before_work(tmp_path):
    result = _run_cli("train", "--workdir", str(tmp_path / "run"), "--config.train.lrr=1")
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
    [(t, v) for t in ("ict", "orqa") for v in VARIANTS] + [("orqa", "squad_read")],
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
