"""Sweeps: a config file's sweep() (a grid or a search space: space.py) run as an Optuna study
(study.py) by parallel workers (worker.py), each trial a training run linked to its trial for
pruning (trial.py), the results tabled and plotted from the study (table.py). The study lives in
a storage (storage.py; proxy.py serves one over gRPC). `python -m realm_jax sweep` is the
command."""

from realm_jax.sweep.points import DEFAULT_VARIANT, resolve_spec, sweep_points

__all__ = ["DEFAULT_VARIANT", "resolve_spec", "sweep_points"]
