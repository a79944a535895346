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


def _load_module(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    name = "realm_jax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(arg)")
    return module


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
            known = _all_keys(config)
            close = difflib.get_close_matches(key, known, n=3)
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
