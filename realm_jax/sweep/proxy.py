"""Optuna's gRPC storage proxy in front of a sweep's database, for workers on many hosts:

    python -m realm_jax.sweep.proxy --storage postgresql://USER:PASSWORD@HOST/DB \\
        [--host 0.0.0.0] [--port 13000]

then `realm-jax sweep ... --storage grpc://THIS_HOST:13000` on every worker host (tpu/sweep.sh).
The workers and the trainers they start then need neither the database's driver nor its
password, and the database sees one connection pool. It creates the study tables if needed and
serves until it is stopped (Ctrl-C, SIGTERM). A SQLite URL works too (one machine's file, served
to others).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m realm_jax.sweep.proxy",
        description="Optuna's gRPC storage proxy in front of a sweep's database.",
    )
    p.add_argument("--storage", required=True, help="the database: postgresql://..., sqlite:///...")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    p.add_argument("--port", type=int, default=13000, help="port to listen on (default 13000)")
    args = p.parse_args(argv)
    import warnings

    import optuna

    from realm_jax.config import ConfigError
    from realm_jax.sweep import storage

    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    if args.storage.startswith("grpc://"):
        print(
            "realm_jax.sweep.proxy: error: --storage is the database behind the proxy, "
            "not another proxy",
            file=sys.stderr,
        )
        return 2
    try:
        st = storage.open_storage(args.storage, create=True)
    except ConfigError as e:
        print(f"realm_jax.sweep.proxy: error: {e}", file=sys.stderr)
        return 2
    print(
        f"realm_jax.sweep.proxy: serving {storage.redact(args.storage)} on "
        f"grpc://{args.host}:{args.port}",
        flush=True,
    )
    try:
        optuna.storages.run_grpc_proxy_server(st, host=args.host, port=args.port)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
