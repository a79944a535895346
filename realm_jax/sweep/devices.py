"""Each local sweep worker on its own devices: the environment worker i of n starts with.

  CPU            the workers share the cores; each trial sees the config's own devices (and
                 --cpu_devices), nothing set here
  GPU host       CUDA_VISIBLE_DEVICES: the GPUs split into n equal groups, worker i the i-th
                 (n must divide the GPU count)
  TPU VM         the chips split into n boxes, each worker's trainers a single-process TPU
                 "slice" of its own: TPU_VISIBLE_CHIPS (its chip ids), TPU_CHIPS_PER_PROCESS_BOUNDS
                 (its box, x,y,z), TPU_PROCESS_BOUNDS=1,1,1 (one process), TPU_PROCESS_PORT and
                 TPU_PROCESS_ADDRESSES (its own port: two libtpu clients on one host must not
                 share one), CLOUD_TPU_TASK_ID=0, ALLOW_MULTIPLE_LIBTPU_LOAD=1. The host's chip
                 grid is halved along its longest even side until there are n boxes (n a power of
                 two dividing the chips); chip ids count x fastest (id = x + X*(y + Y*z)).
                 A TPU VM pod (more than one host) is split by slices instead: --tpu.

The platform is told from the machine, never by starting JAX here (a client would hold the
accelerators the trainers need): TPU chips as /dev/accel* or /dev/vfio/N device files, GPUs from
CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

from realm_jax.config import ConfigError

TPU_PORT = 8476  # libtpu's default; worker i uses TPU_PORT + i
# chips on one TPU VM host -> its chip grid (x, y, z): v4-8/v5p-8 (4 chips, 2x2x1), v5e/v6e
# hosts of 1, 4 or 8 chips (8: 2x4)
TPU_HOST_GRID = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


def platform_info() -> dict:
    """{"platform": "tpu", "chips": N} | {"platform": "gpu", "gpus": [ids]} | {"platform":
    "cpu"} for this machine (JAX_PLATFORMS=cpu: cpu)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return {"platform": "cpu"}
    chips = glob.glob("/dev/accel[0-9]*") or [
        p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit()
    ]
    if chips:
        return {"platform": "tpu", "chips": len(chips)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
        return {"platform": "gpu", "gpus": ids} if ids else {"platform": "cpu"}
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            n = len(re.findall(r"^GPU \d+:", out.stdout, re.M))
        except (OSError, subprocess.SubprocessError):
            n = 0
        if n:
            return {"platform": "gpu", "gpus": [str(i) for i in range(n)]}
    return {"platform": "cpu"}


def _boxes(grid: tuple[int, int, int], n: int) -> tuple[list[int], list[int]]:
    """(box size, boxes per side) splitting the chip grid into n equal boxes."""
    box, per = list(grid), [1, 1, 1]
    left = n
    while left > 1:
        sides = [d for d in range(3) if box[d] % 2 == 0]
        if not sides or left % 2:
            raise ConfigError(
                f"--workers {n}: a TPU host's {'x'.join(map(str, grid))} chips split into a "
                "power of two of equal boxes only (1, 2, 4, ... up to its chips)"
            )
        d = max(sides, key=lambda s: box[s])
        box[d] //= 2
        per[d] *= 2
        left //= 2
    return box, per


def worker_env(i: int, n: int, info: dict) -> dict[str, str]:
    """The environment variables worker i of n sets for its trials (module docstring)."""
    if not 0 <= i < n:
        raise ValueError(f"worker {i} of {n}")
    platform = info.get("platform", "cpu")
    if platform == "cpu" or n == 1 and platform == "gpu":
        return {}
    if platform == "gpu":
        gpus = list(info["gpus"])
        if len(gpus) % n:
            raise ConfigError(f"--workers {n}: this host's {len(gpus)} GPUs do not split in {n}")
        k = len(gpus) // n
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * k : (i + 1) * k])}
    if platform != "tpu":
        raise ValueError(f"platform {platform!r}")
    chips = int(info["chips"])
    if n == 1:
        return {}
    if chips not in TPU_HOST_GRID:
        raise ConfigError(f"--workers {n}: a TPU host of {chips} chips is not one this splits")
    grid = TPU_HOST_GRID[chips]
    box, per = _boxes(grid, n)
    bx, by, bz = i % per[0], (i // per[0]) % per[1], i // (per[0] * per[1])  # x fastest
    ids = [
        x + grid[0] * (y + grid[1] * z)
        for z in range(bz * box[2], (bz + 1) * box[2])
        for y in range(by * box[1], (by + 1) * box[1])
        for x in range(bx * box[0], (bx + 1) * box[0])
    ]
    port = TPU_PORT + i
    return {
        "TPU_VISIBLE_CHIPS": ",".join(map(str, sorted(ids))),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": ",".join(map(str, box)),
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(port),
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
        "CLOUD_TPU_TASK_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
