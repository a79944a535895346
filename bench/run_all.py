"""Run every benchmark in turn (`make bench`); each writes its own section of
docs/benchmarks.md. Some need ../shared/data/squad; those are skipped with a message without it.
"""

from __future__ import annotations

import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
SQUAD = os.path.join(BENCH, "..", "..", "shared", "data", "squad", "corpus_train.jsonl")
SCRIPTS = [
    ("train_throughput.py", False),
    ("token_fetch.py", False),
    ("scann_recall.py", False),
    ("prepare_throughput.py", True),
    ("refresh_throughput.py", True),
]


def main() -> int:
    failed = []
    for script, needs_squad in SCRIPTS:
        if needs_squad and not os.path.exists(SQUAD):
            print(f"skip {script}: needs {os.path.normpath(SQUAD)}")
            continue
        print(f"== {script}", flush=True)
        if subprocess.call([sys.executable, os.path.join(BENCH, script)]) != 0:
            failed.append(script)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
