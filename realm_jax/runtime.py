"""Process set-up before any JAX work: logging, fake CPU devices, jax.distributed.

A multi-process job (a pod, or `--coordinator` on one machine) must not outlive the loss of one
of its processes: the survivors would wait in their next collective for a peer that never comes
(measured: a gloo all-reduce waited over 240 s and would have waited on). JAX's coordination
service, which process 0 hosts, bounds it: every process sends it heartbeats, and when one has
been silent for `heartbeat_timeout_seconds` the service reports the error to every other
process, whose JAX client ends it (SIGABRT, exit status 134) after one log line,
`F... client.h:80] Terminating process because the JAX distributed service detected fatal
errors. This most likely indicates that another task died; ...` naming the dead task. When
process 0 dies the others lose the service itself and stop the same way, at once on one
machine, within the heartbeat timeout across hosts. JAX's default is 100 s; `setup` passes
HEARTBEAT_TIMEOUT_S (REALM_JAX_HEARTBEAT_TIMEOUT overrides it), so a survivor stops within
that many seconds plus a few. Relaunching every process resumes from the newest complete
checkpoint (docs/reliability.md, "When a process of a multi-process job dies").
"""

from __future__ import annotations

import logging
import os

NOISY_LOGGERS = ("absl", "orbax", "jax._src", "tensorflow_datasets", "bm25s")

# Seconds without a heartbeat before the coordination service declares a process dead and
# stops the whole job (JAX's default: 100). The heartbeats come from a JAX client thread, so a
# long compile or a slow Python step does not delay them; too short a timeout would end a
# healthy job on a host or network stalled that long.
HEARTBEAT_TIMEOUT_S = 30
HEARTBEAT_TIMEOUT_ENV = "REALM_JAX_HEARTBEAT_TIMEOUT"

log = logging.getLogger("realm_jax.runtime")


def heartbeat_timeout() -> int:
    """jax.distributed's heartbeat timeout in seconds: $REALM_JAX_HEARTBEAT_TIMEOUT (a whole
    number >= 1) when set, else HEARTBEAT_TIMEOUT_S."""
    raw = os.environ.get(HEARTBEAT_TIMEOUT_ENV, "").strip()
    if not raw:
        return HEARTBEAT_TIMEOUT_S
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={raw!r}: must be a whole number of seconds >= 1")
    return int(raw)


def mark_absl_flags_parsed() -> None:
    """Mark absl's flags parsed (at their defaults) unless something parsed them already.

    grain reads absl flags of its own (--grain_enable_multiprocess_worker_profiling, ...) when
    a DataLoader with data.worker_count > 0 starts its worker processes; realm-jax parses its
    command line with argparse, never absl, and reading an unparsed absl flag raises
    UnparsedFlagAccessError, so every run with grain workers failed as its data iterator
    started. The defaults are what a program with no absl command line gets."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# A child process that must not outlive its parent (`local`'s refresh job) is started with its
# parent's pid in this variable; setup() then asks the kernel to SIGTERM it when that parent
# dies. Set by the child itself rather than in a preexec_fn, whose fork runs Python's at-fork
# hooks and JAX's warning "os.fork() was called ... JAX is multithreaded" in the parent.
PARENT_ENV = "REALM_JAX_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """When $REALM_JAX_DIE_WITH_PARENT names this process's parent: SIGTERM this process when
    the parent dies, even by kill -9 (Linux prctl PR_SET_PDEATHSIG), and exit now if it died
    already (before the prctl); elsewhere the parent still stops it on a normal exit."""
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent.isdigit():
        return
    import signal

    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux
    if os.getppid() != int(parent):  # the parent died before the prctl: reparented
        os.kill(os.getpid(), signal.SIGTERM)


def setup(args) -> None:
    """From the CLI's common flags: --verbose, --cpu_devices, --coordinator/--num_processes/
    --process_id (explicit clusters; gloo collectives on CPU) or --multihost (TPU pods)."""
    die_with_parent()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    mark_absl_flags_parsed()
    if args.cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.coordinator or args.multihost:
        import jax

        timeout = heartbeat_timeout()
        if args.coordinator:
            if jax.config.jax_platforms in (None, "", "cpu") or args.cpu_devices:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                args.coordinator,
                args.num_processes,
                args.process_id,
                heartbeat_timeout_seconds=timeout,
            )
        else:
            jax.distributed.initialize(heartbeat_timeout_seconds=timeout)
        log.info(
            "jax.distributed: if a process of this job dies, the others stop within about "
            "%d s (%s=%d): then relaunch them all; training resumes from the newest checkpoint",
            timeout + 5,
            HEARTBEAT_TIMEOUT_ENV,
            timeout,
        )


def compilation_cache(folder: str) -> str:
    """Turn on XLA's persistent compilation cache in `folder` (config
    mesh.compilation_cache_dir; "" = off) unless JAX_COMPILATION_CACHE_DIR already chose one.
    Returns the folder in use ("" for none). maxtext does the same (jax_cache_dir)."""
    import jax

    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    if chosen or not folder:
        return chosen
    if "://" not in folder:
        folder = os.path.expanduser(folder)
        os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


# What the error of a collective says when a process at its other end is gone or stalled:
# gloo's TCP pairs on CPU (a killed peer resets the connection; a new communicator waits 30 s
# for a peer's address), the coordination service's RPCs when process 0 is gone.
PEER_LOST_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Gloo context initialization failed",
    "Socket closed",
    "heartbeat",
)


def peer_lost_message(error: BaseException) -> str | None:
    """One line for a multi-process job whose collective failed because another process is
    gone or stalled (None in a one-process job, or when the error does not look like that).
    The loop logs it before the traceback, so the first error of the log says what happened;
    when a process died, JAX's coordination service then ends this one within the heartbeat
    timeout (at exit, JAX waits for the others at a shutdown barrier until it does)."""
    import jax

    if jax.process_count() == 1:
        return None
    text = str(error)
    if not any(marker in text for marker in PEER_LOST_MARKERS):
        return None
    first = " ".join(text.split())[:200]
    return (
        f"process {jax.process_index()} of {jax.process_count()}: a collective with the other "
        f"processes failed ({type(error).__name__}: {first}): another process of this job has "
        f"died or stalled, and this one stops too (if one died, JAX's coordination service "
        f"ends every other within {heartbeat_timeout()} s). Relaunch every process: training "
        "resumes from the newest checkpoint"
    )


def barrier(name: str, timeout_s: float) -> None:
    """Every process of the job waits here for the others, up to `timeout_s` (nothing to do in
    a one-process job). Through JAX's coordination service, as orbax and jax's own array
    serialization wait (`client.wait_at_barrier`), not a device collective: gloo on CPU gives
    a collective 30 s for every process to arrive, while process 0 may wait out a dead
    holder's lease (lock.py) for up to a minute before the others may start."""
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client JAX's own serialization uses

    distributed.global_state.client.wait_at_barrier(f"realm_jax:{name}", int(timeout_s * 1000))
