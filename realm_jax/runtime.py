"""Process set-up before any JAX work: logging, fake CPU devices, jax.distributed."""

from __future__ import annotations

import logging
import os

NOISY_LOGGERS = ("absl", "orbax", "jax._src", "tensorflow_datasets", "bm25s")


def setup(args) -> None:
    """From the CLI's common flags: --verbose, --cpu_devices, --coordinator/--num_processes/
    --process_id (explicit clusters; gloo collectives on CPU) or --multihost (TPU pods)."""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.coordinator or args.multihost:
        import jax

        if args.coordinator:
            if jax.config.jax_platforms in (None, "", "cpu") or args.cpu_devices:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        else:
            jax.distributed.initialize()
