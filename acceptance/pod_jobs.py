"""Multi-process jobs for the pod rehearsal (acceptance/pod_rehearsal.py): N `python -m realm_jax`
processes of one command joined by jax.distributed over loopback, as the N hosts of a TPU
slice would be. Each process logs to its own file and has its own cache folder
(REALM_JAX_CACHE), as each host of a pod has its own disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from tests.support.fake_gcs import free_port  # noqa: E402


class StageError(RuntimeError):
    """A stage of the rehearsal failed: what, and the end of the logs that say why."""


class Job:
    """`procs` processes of one realm-jax command, `devices` fake CPU devices each."""

    def __init__(
        self,
        name: str,
        args: list[str],
        *,
        procs: int,
        devices: int,
        root: str,
        env: dict[str, str],
    ):
        self.name, self.procs_n = name, procs
        self.logs, self.procs = [], []
        os.makedirs(os.path.join(root, "logs"), exist_ok=True)
        port = free_port()
        self.t0 = time.time()
        for i in range(procs):
            cmd = [sys.executable, "-m", "realm_jax", *args, "--cpu_devices", str(devices)]
            if procs > 1:
                cmd += ["--coordinator", f"127.0.0.1:{port}", "--num_processes", str(procs)]
                cmd += ["--process_id", str(i)]
            log = os.path.join(root, "logs", f"{name}-p{i}.log")
            host_env = {**env, "REALM_JAX_CACHE": os.path.join(root, f"host{i}", "cache")}
            with open(log, "ab") as out:
                out.write(f"$ {' '.join(cmd)}\n".encode())
                out.flush()
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO,
                        env=host_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            self.logs.append(log)

    def text(self, i: int = 0) -> str:
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def tail(self, i: int = 0, n: int = 12) -> str:
        return "\n".join(self.text(i).rstrip().splitlines()[-n:])

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of every process; all killed (and StageError) past `timeout` seconds."""
        deadline = time.time() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise StageError(
                    f"{self.name}: still running after {timeout:.0f}s (killed); "
                    f"end of process 0's log:\n{self.tail(0)}"
                ) from None
        return codes

    def kill9(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def terminate(self, timeout: float = 60) -> list[int]:
        """SIGTERM every process (a refresh job's normal stop), then wait."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    @property
    def seconds(self) -> float:
        return time.time() - self.t0


def run(
    name: str,
    args: list[str],
    *,
    procs: int,
    devices: int,
    root: str,
    env: dict[str, str],
    timeout: float = 900,
) -> Job:
    """Run a job to its end; StageError (with the log's end) unless every process exits 0."""
    job = Job(name, args, procs=procs, devices=devices, root=root, env=env)
    codes = job.wait(timeout)
    job.wall = job.seconds
    if any(codes):
        bad = next(i for i, c in enumerate(codes) if c)
        raise StageError(
            f"{name}: exit codes {codes}; end of process {bad}'s log ({job.logs[bad]}):\n"
            f"{job.tail(bad)}"
        )
    return job


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise StageError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def compare_curves(a: dict[int, float], b: dict[int, float], tol: float) -> tuple[bool, str]:
    """Whether two {step: value} curves agree on every step both have (at least one, and the
    same steps): |a - b| <= tol * max(1, |b|), i.e. to `tol` absolute below 1 and relative
    above (ICT's bert-tiny losses of ~10 differ by float32 summation order, ~2e-6 of them),
    and a short account of it."""
    common = sorted(set(a) & set(b))
    if not common:
        return False, f"no common steps ({sorted(a)[:5]} vs {sorted(b)[:5]})"
    diff = max(abs(a[s] - b[s]) for s in common)
    rel = max(abs(a[s] - b[s]) / max(1.0, abs(b[s])) for s in common)
    missing = sorted(set(a) ^ set(b))
    ok = rel <= tol and not missing
    extra = f", steps in one only: {missing[:6]}" if missing else ""
    return ok, f"{len(common)} steps, max |diff| {diff:.1e} (relative {rel:.1e}){extra}"
