"""Expand a config file's `sweep()` into named runs of `--config.k=v` overrides.

`sweep()` returns a list of override dicts such as {"train.lr": 1e-4}. Every point is applied
to the config here, so a misspelt key or a wrong type fails before a pod is booked.

    python -m realm_jax.sweep configs/realm.py[:variant]   # variant defaults to "small"

prints one `NAME<TAB>--config.a=b --config.c=d` line per point (tpu/sweep.sh reads them).
"""

from __future__ import annotations

import sys

from realm_jax.config import ConfigError, _load_module, load_config, split_spec

DEFAULT_VARIANT = "small"  # the variant sweeps are validated against unless the spec names one


def _format_value(value) -> str:
    """A value as an override parses it back: tuples as (a, b), everything else via str."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def _run_name(point: dict) -> str:
    """{"train.lr": 5e-5, "train.num_candidates": 4} -> "lr=5e-05,num_candidates=4"."""
    parts = [f"{key.rsplit('.', 1)[-1]}={_format_value(v)}" for key, v in point.items()]
    return ",".join(parts).replace(" ", "")


def sweep_points(config_spec: str) -> list[tuple[str, list[str]]]:
    """[(run name, ["--config.k=v", ...])] for every point of the config file's `sweep()`.

    `config_spec` is 'path.py' or 'path.py:variant' (default variant: "small"). Raises
    ConfigError if the file has no sweep() or a point does not apply to the config.
    """
    path, variant = split_spec(config_spec)
    module = _load_module(path)
    if not callable(getattr(module, "sweep", None)):
        raise ConfigError(f"{path} defines no sweep() function")
    spec = f"{path}:{variant or DEFAULT_VARIANT}"
    points = []
    for i, point in enumerate(module.sweep()):
        if not isinstance(point, dict) or not point:
            raise ConfigError(f"{path}: sweep point {i} is not a non-empty dict: {point!r}")
        overrides = [f"{key}={_format_value(v)}" for key, v in point.items()]
        try:
            load_config(spec, overrides)
        except ConfigError as e:
            raise ConfigError(f"{path}: sweep point {i} ({point}): {e}") from None
        points.append((_run_name(point), [f"--config.{o}" for o in overrides]))
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


if __name__ == "__main__":
    sys.exit(main())
