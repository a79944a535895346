"""Expand a config file's `sweep()` into named points of `--config.k=v` overrides.

`sweep()` returns a list of override dicts such as {"train.lr": 1e-4}. Every point is applied
to the config here, so a misspelt key or a wrong type fails before a pod is booked. A point's
name is its overrides, shortened to the last part of each key; it is also the point's folder
under the sweep's workdir prefix, so it holds only [A-Za-z0-9_.,=+-] (tpu/launch.sh's rule).

    python -m realm_jax.sweep configs/realm.py[:variant]   # variant defaults to "small"

prints one `NAME<TAB>--config.a=b --config.c=d` line per point (tpu/sweep.sh reads them).
"""

from __future__ import annotations

import hashlib
import re
import sys

from realm_jax.config import ConfigError, _load_module, load_config, split_spec

DEFAULT_VARIANT = "small"  # the variant sweeps are validated against unless the spec names one
_UNSAFE = re.compile(r"[^A-Za-z0-9_.,=+-]")  # tpu/launch.sh accepts these in a run name
MAX_NAME = 120  # a folder name's length well under a filesystem's 255 bytes


def resolve_spec(config_spec: str) -> str:
    """'configs/realm.py' -> 'configs/realm.py:small': the variant every command of a sweep
    must get, as the points were validated against it."""
    path, variant = split_spec(config_spec)
    return f"{path}:{variant or DEFAULT_VARIANT}"


def _format_value(value) -> str:
    """A value as an override parses it back: tuples as (a, b), everything else via str."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def _name_value(value) -> str:
    """A value in a folder name: tuples as 4x8, characters a shell or launch.sh minds as _."""
    if isinstance(value, (tuple, list)):
        return "x".join(_name_value(v) for v in value)
    return _UNSAFE.sub("_", str(value))


def _run_name(point: dict) -> str:
    """{"train.lr": 5e-5, "train.num_candidates": 4} -> "lr=5e-05,num_candidates=4"."""
    name = ",".join(f"{key.rsplit('.', 1)[-1]}={_name_value(v)}" for key, v in point.items())
    if len(name) > MAX_NAME:  # keep it unique: the cut-off part goes into a hash
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def sweep_points(config_spec: str, extra: list[str] | tuple[str, ...] = ()):
    """[(run name, ["--config.k=v", ...])] for every point of the config file's `sweep()`.

    `config_spec` is 'path.py' or 'path.py:variant' (default variant: "small"). `extra` are
    overrides ("k=v") every point gets first, validated with each point. Raises ConfigError if
    the file has no sweep() or a point does not apply to the config.
    """
    path, _ = split_spec(config_spec)
    module = _load_module(path)
    if not callable(getattr(module, "sweep", None)):
        raise ConfigError(f"{path} defines no sweep() function")
    spec = resolve_spec(config_spec)
    if extra:  # the overrides every point shares, named as such when they do not apply
        try:
            load_config(spec, extra)
        except ConfigError as e:
            raise ConfigError(f"{spec}: the sweep's common overrides: {e}") from None
    points = []
    for i, point in enumerate(module.sweep()):
        if not isinstance(point, dict) or not point:
            raise ConfigError(f"{path}: sweep point {i} is not a non-empty dict: {point!r}")
        overrides = [f"{key}={_format_value(v)}" for key, v in point.items()]
        try:
            load_config(spec, [*extra, *overrides])
        except ConfigError as e:
            raise ConfigError(f"{path}: sweep point {i} ({point}): {e}") from None
        points.append((_run_name(point), [f"--config.{o}" for o in overrides]))
    if not points:
        raise ConfigError(f"{path}: sweep() returned no points")
    names = [name for name, _ in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: sweep points have duplicate run names: {names}")
    return points


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m realm_jax.sweep CONFIG_FILE[:VARIANT]", file=sys.stderr)
        return 2
    try:
        points = sweep_points(argv[0])
    except ConfigError as e:
        print(f"realm_jax.sweep: {e}", file=sys.stderr)
        return 1
    for name, overrides in points:
        print(f"{name}\t{' '.join(overrides)}")
    return 0
