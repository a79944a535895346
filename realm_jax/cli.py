"""`python -m realm_jax <command>` (also `realm-jax`): the one entry point.

Every command takes --config configs/realm.py:<variant> and overrides as
--config.section.field=value; the config is locked, so an unknown key is an error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "prepare": "build the TFDS block and pre-training datasets from raw text",
    "train": "train config.task: REALM (trainer only; pair it with `refresh`) or ICT",
    "refresh": "the index refresh job: re-embed the corpus from new checkpoints, publish",
    "local": "trainer + refresher together on one machine (Ctrl-C stops both)",
    "ict": "the Inverse Cloze Task warm start of the embedders (configs/ict.py)",
    "finetune": "open-domain QA fine-tuning (not yet implemented)",
    "evaluate": "exact-match evaluation (not yet implemented)",
    "ask": "retrieve the top blocks for a question with the latest index (ScaNN)",
}

# command -> "module:function" (imported only when run). `train` and `local` depend on the
# config's task (config.task): TASK_COMMANDS[task][command].
ENTRY = {
    "prepare": "realm_jax.data.prepare:command",
    "refresh": "realm_jax.index.refresher:command",
    "ict": "realm_jax.ict.command:command",
    "finetune": "realm_jax.qa.commands:finetune",
    "evaluate": "realm_jax.qa.commands:evaluate",
    "ask": "realm_jax.index.ask:command",
}
TASK_COMMANDS = {
    "realm": {
        "train": "realm_jax.pretrain.commands:train_command",
        "local": "realm_jax.pretrain.commands:local",
    },
    "ict": {"train": "realm_jax.ict.command:command", "local": "realm_jax.ict.command:command"},
}


def entry_point(command: str, config) -> str:
    """The "module:function" that runs `command` for this config."""
    if command in ENTRY:
        return ENTRY[command]
    task = config.task
    if task not in TASK_COMMANDS:
        raise ValueError(f"config.task must be one of {sorted(TASK_COMMANDS)}, got {task!r}")
    return TASK_COMMANDS[task][command]


def _parser() -> argparse.ArgumentParser:
    from realm_jax.config import default_config_path

    p = argparse.ArgumentParser(
        prog="realm-jax",
        description="REALM retrieval-augmented pre-training in JAX/Flax.",
        epilog="Config overrides: --config.train.lr=1e-4 (any field of the config file).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        s = sub.add_parser(name, help=help_text, description=help_text)
        s.add_argument(
            "--config",
            default=f"{default_config_path()}:smoke",
            help="config file and variant, e.g. configs/realm.py:smoke",
        )
        s.add_argument(
            "--workdir", required=True, help="run directory (data, checkpoints, index, tb)"
        )
        s.add_argument(
            "--cpu_devices",
            type=int,
            default=0,
            help="fake this many CPU devices (testing sharding on one machine)",
        )
        s.add_argument("--coordinator", default="", help="multi-process: coordinator host:port")
        s.add_argument("--num_processes", type=int, default=1, help="multi-process: process count")
        s.add_argument("--process_id", type=int, default=0, help="multi-process: this process")
        s.add_argument(
            "--multihost",
            action="store_true",
            help="call jax.distributed.initialize() with auto-detection (TPU pods)",
        )
        s.add_argument("-v", "--verbose", action="store_true", help="debug logging")
        if name == "prepare":
            s.add_argument(
                "--overwrite",
                action="store_true",
                help="replace a prepared dataset built from different input",
            )
        if name == "refresh":
            s.add_argument(
                "--max_versions",
                type=int,
                default=None,
                help="exit after publishing this many index versions",
            )
        if name == "ask":
            s.add_argument("question", nargs="+", help="the question or masked sentence")
            s.add_argument("--top_k", type=int, default=5, help="blocks to show")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    parser = _parser()
    args = parser.parse_args(rest)
    if args.command is None:
        parser.print_help()
        return 2
    from realm_jax.config import ConfigError, load_config

    try:
        config = load_config(args.config, [o[len("--config.") :] for o in overrides])
    except ConfigError as e:
        parser.exit(2, f"realm-jax: config error: {e}\n")
    from realm_jax import runtime

    runtime.setup(args)
    module, function = entry_point(args.command, config).split(":")
    from realm_jax.train.loop import TrainingStopped

    try:
        return getattr(importlib.import_module(module), function)(config, args) or 0
    except TrainingStopped as e:
        print(f"realm-jax {args.command}: stopped: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
