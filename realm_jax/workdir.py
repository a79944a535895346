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


def index_dir(workdir: str) -> str:
    """Published index versions (step_<N>/) and the trainers' leases."""
    return os.path.join(root(workdir), "index")


def tb_dir(workdir: str) -> str:
    """TensorBoard event files."""
    return os.path.join(root(workdir), "tb")
