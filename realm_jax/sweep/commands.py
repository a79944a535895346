"""`realm-jax sweep`: run a config file's sweep() locally or on a TPU VM, or table it."""

from __future__ import annotations

from realm_jax import fs
from realm_jax.config import ConfigError
from realm_jax.sweep import runner, table
from realm_jax.sweep.points import resolve_spec, sweep_points


def command(args, overrides: list[str]) -> int:
    """From cli.py's parsed arguments; `overrides` ("k=v") apply to every point. The prefix
    may be a gs:// URL (its bucket is checked before anything runs)."""
    if args.table:
        if args.table_only or args.dry_run or args.tpu:
            raise ConfigError("--table PREFIX only rewrites the table: no other sweep flag")
        prefix = fs.abspath(args.table)
        fs.check_buckets([prefix])
        runner.rewrite_table(prefix)
        print(f"wrote {fs.join(prefix, 'sweep.md')} and sweep.csv")
        return 0
    if not args.workdir:
        raise ConfigError("sweep needs --workdir PREFIX (or --table PREFIX)")
    if args.table_only:
        spec, prefix = resolve_spec(args.config), fs.abspath(args.workdir)
        fs.check_buckets([prefix])
        fs.makedirs(prefix)
        table.save_plan(prefix, spec, overrides, sweep_points(spec, overrides))
        runner.rewrite_table(prefix)
        print(f"wrote {fs.join(prefix, 'sweep.md')} and sweep.csv")
        return 0
    if args.tpu:
        return runner.run_tpu(
            args.config, args.workdir, overrides, args.tpu, prepare=args.prepare,
            dry_run=args.dry_run,
        )  # fmt: skip
    only = [n for n in getattr(args, "only", "").split(",") if n]
    if only and args.tpu:
        raise ConfigError("--only selects points of a local sweep; tpu/sweep.sh runs them all")
    return runner.run_local(
        args.config,
        args.workdir,
        overrides,
        cpu_devices=args.cpu_devices,
        dry_run=args.dry_run,
        only=only,
    )
