"""Run the benchmarks in turn (`make bench`); each writes its own section of docs/benchmarks.md.

    python benchmarks/run_all.py            # the cheap ones: about 5 minutes on 2 CPU cores
    python benchmarks/run_all.py --all      # every one run_all knows, the long ones too
    python benchmarks/run_all.py --list     # what would run, and nothing else

The cheap ones need nothing but this repository. The long ones need ../shared/data/squad (skipped
with a message without it) and take 10 minutes or more each on 2 cores. Benchmarks that need a
side venv or hours (plan_base.py, peer_hf_realm.py, refresh_scale.py, refresh_1m.py,
prepare_scale.py, prepare_beam.py, prepare_release.py, grad_accum.py) are run by hand or by
their own make target (`make plan`, `make peer-bench`); each docstring says how.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SQUAD = os.path.join(HERE, "..", "..", "shared", "data", "squad", "corpus_train.jsonl")
# (script, needs ../shared/data/squad); wall time measured on 2 CPU cores (2026-11-26)
CHEAP = [
    ("scann_recall.py", False),  # about 10 s
    ("token_fetch.py", False),  # a few seconds
    ("train_throughput.py", False),  # about 4.5 minutes (4 sizes)
]
LONG = [
    ("mips_vs_scann.py", False),  # a 1M-vector index on device and in ScaNN
    ("prepare_throughput.py", True),  # about 10 minutes (spaCy NER)
    ("refresh_throughput.py", True),  # about 10 minutes (3 refreshes of 19,706 blocks)
    ("frozen_step.py", False),  # about 4 minutes (the MiniLM setting is most of it)
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true", help="the long benchmarks too")
    ap.add_argument("--list", action="store_true", help="print what would run, run nothing")
    args = ap.parse_args(argv)
    scripts = CHEAP + LONG if args.all else CHEAP
    if args.list:
        for script, needs_squad in scripts:
            print(f"benchmarks/{script}" + (" (needs ../shared/data/squad)" if needs_squad else ""))
        return 0
    failed = []
    for script, needs_squad in scripts:
        if needs_squad and not os.path.exists(SQUAD):
            print(f"skip {script}: needs {os.path.normpath(SQUAD)}")
            continue
        print(f"== {script}", flush=True)
        if subprocess.call([sys.executable, os.path.join(HERE, script)]) != 0:
            failed.append(script)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
