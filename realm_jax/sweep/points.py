"""A sweep's points as config overrides and folder names, and a config file's sweep() read.

A point is a dict of config fields, such as {"train.lr": 1e-4}; its name is its overrides
shortened to the last part of each key ("lr=0.0001"), and it is also the trial's folder under the
sweep's workdir prefix, so it holds only [A-Za-z0-9_.,=+-] (tpu/launch.sh's rule). Floats are
named with 4 significant digits (a search's draws), the override keeps every digit.

`sweep_points(spec)` expands a grid sweep into (name, ["--config.k=v", ...]) pairs, each point
applied to the config (experiments/ablations runs its arms from it); space.load() checks a
sweep fully (validation, objective, search space) for the engine.
"""

from __future__ import annotations

import hashlib
import inspect
import re

from realm_jax.config import ConfigError, _load_module, load_config, split_spec

DEFAULT_VARIANT = "small"  # the variant sweeps are validated against unless the spec names one
_UNSAFE = re.compile(r"[^A-Za-z0-9_.,=+-]")  # tpu/launch.sh accepts these in a run name
MAX_NAME = 120  # a folder name's length well under a filesystem's 255 bytes


def resolve_spec(config_spec: str) -> str:
    """'configs/realm.py' -> 'configs/realm.py:small': the variant every command of a sweep
    must get, as the points were validated against it."""
    path, variant = split_spec(config_spec)
    return f"{path}:{variant or DEFAULT_VARIANT}"


def format_value(value) -> str:
    """A value as an override parses it back: tuples as (a, b), everything else via str."""
    if isinstance(value, tuple | list):
        return "(" + ",".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def _name_value(value) -> str:
    """A value in a folder name: tuples as 4x8, floats to 4 digits, characters a shell or
    launch.sh minds as _."""
    if isinstance(value, tuple | list):
        return "x".join(_name_value(v) for v in value)
    if isinstance(value, float):
        value = f"{value:.4g}"
    return _UNSAFE.sub("_", str(value))


def run_name(point: dict) -> str:
    """{"train.lr": 5e-5, "train.num_candidates": 4} -> "lr=5e-05,num_candidates=4"."""
    name = ",".join(f"{key.rsplit('.', 1)[-1]}={_name_value(v)}" for key, v in point.items())
    if len(name) > MAX_NAME:  # keep it unique: the cut-off part goes into a hash
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def read_sweep(path: str, variant: str | None):
    """What the config file's sweep() returns: sweep(variant) when it takes an argument."""
    module = _load_module(path)
    fn = getattr(module, "sweep", None)
    if not callable(fn):
        raise ConfigError(f"{path} defines no sweep() function")
    try:
        return fn(variant) if inspect.signature(fn).parameters else fn()
    except ConfigError:
        raise
    except Exception as e:  # the config file's own code
        raise ConfigError(f"{path}: sweep() raised {type(e).__name__}: {e}") from e


def sweep_points(config_spec: str, extra: list[str] | tuple[str, ...] = ()):
    """[(run name, ["--config.k=v", ...])] for every point of the config file's grid sweep.

    `config_spec` is 'path.py' or 'path.py:variant' (default variant: "small"). `extra` are
    overrides ("k=v") every point gets first, applied with each point. Raises ConfigError if
    the file has no sweep(), declares a search, or a point does not apply to the config.
    """
    spec = resolve_spec(config_spec)
    path, variant = split_spec(spec)
    value = read_sweep(path, variant)
    kind = type(value).__name__  # space.Search or space.Grid (space.py builds on this module)
    if kind == "Search":
        raise ConfigError(f"{spec}: sweep() declares a search, not a grid of points")
    raw = value.points if kind == "Grid" else value
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"{path}: sweep() must return a list of override dicts")
    if extra:  # the overrides every point shares, named as such when they do not apply
        try:
            load_config(spec, extra)
        except ConfigError as e:
            raise ConfigError(f"{spec}: the sweep's common overrides: {e}") from None
    points = []
    for i, point in enumerate(raw):
        if not isinstance(point, dict) or not point:
            raise ConfigError(f"{path}: sweep point {i} is not a non-empty dict: {point!r}")
        overrides = [f"{key}={format_value(v)}" for key, v in point.items()]
        try:
            load_config(spec, [*extra, *overrides])
        except ConfigError as e:
            raise ConfigError(f"{path}: sweep point {i} ({point}): {e}") from None
        points.append((run_name(point), [f"--config.{o}" for o in overrides]))
    if not points:
        raise ConfigError(f"{path}: sweep() returned no points")
    names = [name for name, _ in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: sweep points have duplicate run names: {names}")
    return points
