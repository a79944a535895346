"""The ONLY place run paths are built: everything a run writes lives under its workdir."""

from __future__ import annotations

import os


def root(workdir: str) -> str:
    return os.path.abspath(workdir)


def data_dir(config, workdir: str) -> str:
    """Prepared datasets: config.data.data_dir, or <workdir>/data."""
    return config.data.data_dir or os.path.join(root(workdir), "data")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(root(workdir), "checkpoints")


def damaged_checkpoint_dir(workdir: str) -> str:
    """Checkpoints that failed to restore, moved out of rotation (<step>-<UTC time>/), never
    deleted: kept for inspection."""
    return os.path.join(root(workdir), "checkpoints-damaged")


def index_dir(workdir: str) -> str:
    """Published index versions (step_<N>/) and the trainers' leases."""
    return os.path.join(root(workdir), "index")


def tb_dir(workdir: str) -> str:
    """TensorBoard event files."""
    return os.path.join(root(workdir), "tb")


def best_dir(workdir: str) -> str:
    """Fine-tuning: the checkpoint with the best dev exact match (orbax, kept by metric)."""
    return os.path.join(root(workdir), "best")


def eval_dir(workdir: str) -> str:
    """`evaluate`'s predictions and metrics files."""
    return os.path.join(root(workdir), "eval")


def lock_path(workdir: str, role: str) -> str:
    """The lock file one process of `role` holds for the run (lock.py)."""
    return os.path.join(root(workdir), f"{role}.lock")
