"""Implementations of the CLI commands (each takes the loaded config and parsed args)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading

log = logging.getLogger("realm_jax")


def prepare(config, args) -> int:
    from realm_jax.data import prepare as prep
    from realm_jax.trainer import data_dir

    prep.prepare(config, data_dir(config, args.workdir), overwrite=args.overwrite)
    return 0


def _task_train(config):
    """The train function of config.task (realm or ict)."""
    if config.task == "ict":
        from realm_jax.ict.task import train as fn
    elif config.task == "realm":
        from realm_jax.trainer import train as fn
    else:
        raise ValueError(f"config.task must be realm or ict, got {config.task!r}")
    return fn


def train(config, args) -> int:
    _task_train(config)(config, args.workdir)
    return 0


def ict(config, args) -> int:
    """`realm-jax ict`: the Inverse Cloze Task (configs/ict.py)."""
    if config.task != "ict":
        print(
            f"realm-jax ict: {args.config} is a {config.task!r} config; use configs/ict.py",
            file=sys.stderr,
        )
        return 2
    return train(config, args)


def _load_tokens(config, workdir):
    from realm_jax.data import prepare as prep
    from realm_jax.trainer import data_dir

    return prep.load_blocks(data_dir(config, workdir))[0]


def refresh(config, args) -> int:
    from realm_jax.refresh import Refresher

    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    Refresher(config, args.workdir, _load_tokens(config, args.workdir)).run(
        stop, max_versions=args.max_versions
    )
    return 0


def _passthrough_args(args) -> list[str]:
    out = ["--config", args.config, "--workdir", args.workdir]
    out += [a for a in sys.argv[1:] if a.startswith("--config.")]
    return out


def local(config, args) -> int:
    """Trainer in this process, refresher as a child process; both stop together."""

    child = None
    if config.refresh.mode == "external" and config.task == "realm":
        cmd = [sys.executable, "-m", "realm_jax", "refresh", *_passthrough_args(args)]
        child = subprocess.Popen(cmd)
        log.info("local: started refresher (pid %d)", child.pid)
    try:
        _task_train(config)(config, args.workdir)
    finally:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
            log.info("local: refresher stopped")
    return 0


def _not_yet(command: str, what: str) -> int:
    print(
        f"realm-jax {command}: {what} is not implemented yet (see README 'Known gaps').",
        file=sys.stderr,
    )
    return 3


def finetune(config, args) -> int:
    return _not_yet("finetune", "open-domain QA fine-tuning")


def evaluate(config, args) -> int:
    return _not_yet("evaluate", "exact-match evaluation")


def ask(config, args) -> int:
    from realm_jax import serve

    for title, text, score in serve.ask(config, args.workdir, " ".join(args.question), args.top_k):
        print(f"[{score:8.3f}] {title}: {text[:200]}")
    return 0
