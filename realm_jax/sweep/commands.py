"""`realm-jax sweep`: run a config's sweep() as an Optuna study (study.py), or table one."""

from __future__ import annotations

from realm_jax.config import ConfigError
from realm_jax.sweep import study


def command(args, overrides: list[str]) -> int:
    """From cli.py's parsed arguments; `overrides` ("k=v") apply to every trial."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    if args.table:
        if args.workdir or args.dry_run or args.tpu or args.trials or overrides:
            raise ConfigError("--table PREFIX only rewrites the table (with --storage, --study)")
        return study.table_command(args)
    if not args.workdir:
        raise ConfigError("sweep needs --workdir PREFIX (or --table PREFIX)")
    return study.run(args, overrides)
