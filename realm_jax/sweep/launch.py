"""How a sweep trial runs: the plan each worker gets, the trial's data folder, its prepare and
training commands (here, or on a TPU slice through tpu/launch.sh --wait), where its log goes, and
the child processes that die with the process that started them (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys

from realm_jax import fs
from realm_jax.sweep import space, storage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PR_SET_PDEATHSIG = 1
# data fields that only the reader of a prepared folder uses (the masks drawn at read time,
# grain's worker processes): trials differing in them share one prepared folder
READ_TIME_DATA_FIELDS = ("data_dir", "mask_mode", "eval_mask_mode", "worker_count")


@dataclasses.dataclass
class Plan:
    """What the sweep command hands each worker (JSON on its command line)."""

    spec: str
    extra: list
    prefix: str
    storage: str
    study: str
    worker: int = 0
    workers: int = 1
    trials: int = 0  # a search's budget of finished (complete + pruned) trials
    first_number: int = 0  # the study's first trial number of this sweep run
    cpu_devices: int = 0
    tpu: list | None = None  # [NAME, ZONE] of the worker's slice
    heartbeat_s: float = storage.HEARTBEAT_S
    grace_s: float = storage.GRACE_S
    retry_s: float = storage.RETRY_S
    prepared: list = dataclasses.field(default_factory=list)  # data folders ready before start


def die_with_parent() -> None:
    """preexec_fn: this child gets SIGTERM when the process that started it dies (Linux)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the child outlives a killed parent
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def data_key(config) -> str:
    """What a prepared folder depends on: the `data` section but where it lives and what is
    read-time only (conservative: another field prepare ignores only costs a second prepare)."""
    fields = {k: v for k, v in config.data.to_dict().items() if k not in READ_TIME_DATA_FIELDS}
    return json.dumps(fields, sort_keys=True, default=str)


def data_folder(config, base, prefix: str) -> str:
    """The trial's prepared data: the config's data.data_dir; else PREFIX/data when its data
    section is the sweep's base config's, PREFIX/data-<hash> when a trial's params change it."""
    if config.data.data_dir:
        return config.data.data_dir
    key = data_key(config)
    if key == data_key(base):
        return fs.join(prefix, "data")
    return fs.join(prefix, "data-" + hashlib.sha1(key.encode()).hexdigest()[:8])


def prepare_command(plan: Plan, point: dict, folder: str) -> list[str]:
    cmd = [sys.executable, "-m", "realm_jax", "prepare", "--config", plan.spec]
    cmd += ["--workdir", plan.prefix]
    return cmd + _config_args(plan, point, folder)


def _config_args(plan: Plan, point: dict, folder: str) -> list[str]:
    over = [*plan.extra, *space.overrides(point), f"data.data_dir={folder}"]
    return [f"--config.{o}" for o in over]


def trial_command(
    plan: Plan, task: str, name: str, workdir: str, point: dict, folder: str, link: str
) -> list[str]:
    """The trial's training command: here, or on the worker's slice through tpu/launch.sh."""
    if plan.tpu:
        path, variant = plan.spec.rsplit(":", 1)
        spec = f"{os.path.relpath(os.path.abspath(path), REPO)}:{variant}"  # as the VMs see it
        cmd = [os.path.join(REPO, "tpu", "launch.sh"), "--wait", "--run", name]
        cmd += ["--env", f"REALM_JAX_TRIAL={link}", *plan.tpu, workdir, spec]
        return cmd + _config_args(plan, point, folder)
    cmd = [sys.executable, "-m", "realm_jax", space.RUN_COMMAND[task], "--config", plan.spec]
    cmd += ["--workdir", workdir]
    if plan.cpu_devices:
        cmd += ["--cpu_devices", str(plan.cpu_devices)]
    return cmd + _config_args(plan, point, folder)


def log_path(workdir: str) -> str:
    """Where a trial's output is appended while it runs: WORKDIR/sweep.log, or for a gs://
    workdir a local file under fs.cache_root()/sweep-logs/ (copied up when the trial ends)."""
    if not fs.is_remote(workdir):
        return os.path.join(workdir, "sweep.log")
    rel = workdir.partition("://")[2]
    return os.path.join(fs.cache_root(), "sweep-logs", *rel.split("/"), "sweep.log")


def echo(data: bytes, label: str, final: bool) -> bytes:
    """Print each complete line of `data` with the label; returns the incomplete rest."""
    *lines, rest = data.split(b"\n")
    if final and rest:
        lines, rest = [*lines, rest], b""
    for line in lines:
        print(f"{label} {line.decode(errors='replace')}", flush=True)
    return rest


def stream_plain(cmd: list[str], label: str) -> int:
    """Run cmd with its output echoed line by line with `label` (prepare)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    for line in proc.stdout:
        print(f"{label} {line.decode(errors='replace')}", end="", flush=True)
    return proc.wait()
