"""Sweeps: a config file's `sweep()` expanded into named points (points.py), run one after
another locally or launched on a TPU VM (runner.py), and tabled from what the runs wrote
(table.py). `python -m realm_jax sweep` is the command; `python -m realm_jax.sweep FILE`
prints the points for tpu/sweep.sh."""

from realm_jax.sweep.points import DEFAULT_VARIANT, main, resolve_spec, sweep_points

__all__ = ["DEFAULT_VARIANT", "main", "resolve_spec", "sweep_points"]
