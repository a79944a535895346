"""What train.grad_accum buys: the REALM train step's memory at the paper's batch of 512.

    python benchmarks/grad_accum.py [--config configs/realm.py:squad] [--num_blocks 23512]

Compiles REALM's train step (`realm-jax plan`, one process per setting, XLA:CPU, one device)
for batch 64 and 128 in one pass, 512 in one pass, and 512 in 4 and 8 micro-batches
(pretrain/step.py accumulated_grads), and writes the "REALM gradient accumulation: memory"
section of docs/benchmarks.md: XLA's per-device total (arguments + step temporaries), GiB.
Compilation only: nothing is trained, no data is read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402

GiB = 1024**3
SETTINGS = [(64, 1), (128, 1), (512, 1), (512, 4), (512, 8)]  # (batch, micro-batches)


def plan(config: str, num_blocks: int, batch: int, accum: int, out: str) -> dict:
    cmd = [
        *(sys.executable, "-m", "realm_jax", "plan", "--config", config),
        *("--topology", "cpu:1", "--num_blocks", str(num_blocks), "--programs", "train"),
        f"--config.train.batch_size={batch}",
        f"--config.train.grad_accum={accum}",
        *("--json", out),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.load(open(out))["programs"][0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/realm.py:squad")
    ap.add_argument("--num_blocks", type=int, default=23512)  # the ablation suite's corpus
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch, accum in SETTINGS:
            p = plan(args.config, args.num_blocks, batch, accum, os.path.join(tmp, "p.json"))
            print(f"batch {batch} in {accum}: {p['total'] / GiB:.2f} GiB", flush=True)
            rows.append((batch, accum, p["xla"]["temporaries"] / GiB, p["total"] / GiB))
    base = {b: t for b, a, _, t in rows if a == 1}
    lines = [
        "| batch | micro-batches (train.grad_accum) | sentences per pass | step temporaries "
        "| total per device | total / batch 64's |",
        "|---|---|---|---|---|---|",
    ]
    for batch, accum, temp, total in rows:
        lines.append(
            f"| {batch} | {accum} | {batch // accum} | {temp:.2f} | {total:.2f} "
            f"| {total / base[64]:.2f} |"
        )
    body = (
        f"`python benchmarks/grad_accum.py --config {args.config} --num_blocks {args.num_blocks}`: "
        "XLA's compiled memory of REALM's train step on one CPU device, GiB (arguments: "
        "parameters, optimizer state, index and batch; temporaries: activations and "
        "gradients). A step in micro-batches holds one micro-batch's activations plus one "
        "float32 gradient sum.\n\n" + "\n".join(lines)
    )
    write_section("REALM gradient accumulation: memory", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
