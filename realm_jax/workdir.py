"""The ONLY place run paths are built: everything a run writes lives under its workdir.

A workdir (and data.data_dir) may be a local path or an object-store URL (gs://bucket/run):
paths are built with realm_jax.fs, which keeps a URL a URL."""

from __future__ import annotations

from realm_jax import fs


def root(workdir: str) -> str:
    return fs.abspath(workdir)


def data_dir(config, workdir: str) -> str:
    """Prepared datasets: config.data.data_dir, or <workdir>/data."""
    return config.data.data_dir or fs.join(root(workdir), "data")


def checkpoint_dir(workdir: str) -> str:
    return fs.join(root(workdir), "checkpoints")


def embedder_export_dir(workdir: str) -> str:
    """The trainer's small exports of the document embedder alone (<step>/, orbax), written
    every refresh.export_every steps for the refresh job (checkpoint.export_manager)."""
    return fs.join(root(workdir), "embedder")


def damaged_checkpoint_dir(workdir: str) -> str:
    """Checkpoints that failed to restore, moved out of rotation (<step>-<UTC time>/), never
    deleted: kept for inspection."""
    return fs.join(root(workdir), "checkpoints-damaged")


def example_ids_path(workdir: str) -> str:
    """The example ids of every step, when train.record_example_ids is on (train/loop.py)."""
    return fs.join(root(workdir), "example_ids.jsonl")


def index_dir(workdir: str) -> str:
    """Published index versions (step_<N>/) and the trainers' leases."""
    return fs.join(root(workdir), "index")


def tb_dir(workdir: str) -> str:
    """TensorBoard event files."""
    return fs.join(root(workdir), "tb")


def metrics_path(workdir: str) -> str:
    """The training loop's final metrics (JSON): last step, train metrics, latest evaluation."""
    return fs.join(root(workdir), "metrics.json")


def best_dir(workdir: str) -> str:
    """Fine-tuning: the checkpoint with the best dev exact match (orbax, kept by metric)."""
    return fs.join(root(workdir), "best")


def eval_dir(workdir: str) -> str:
    """`evaluate`'s predictions and metrics files."""
    return fs.join(root(workdir), "eval")


def lock_path(workdir: str, role: str) -> str:
    """The lock file one process of `role` holds for the run (lock.py)."""
    return fs.join(root(workdir), f"{role}.lock")


def profile_dir(workdir: str) -> str:
    """train.profile_steps' jax.profiler traces: the TensorBoard logdir, whose profile plugin
    opens <logdir>/plugins/profile/<run>/*.xplane.pb."""
    return tb_dir(workdir)


def pruned_path(workdir: str) -> str:
    """Written when the sweep's pruner stopped the run (sweep/trial.py): JSON {"step", "value",
    "objective", "time"}; the sweep's worker reads it to mark the trial pruned."""
    return fs.join(root(workdir), "PRUNED")
