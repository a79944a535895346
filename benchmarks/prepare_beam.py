"""`prepare` on Apache Beam (DirectRunner, a worker process per core) against the in-process
path: throughput and peak memory at 10k, 100k and 200k passages (in process up to 100k).

    python benchmarks/prepare_beam.py [--corpus ../shared/data/squad/corpus_train.jsonl]
        [--sizes 10000,100000,200000] [--ner-up-to 10000] [--local-up-to 100000] [--window-kb N]

The corpora are the SQuAD paragraphs (18,896 real passages) repeated to size: copy r > 0 of a
passage gets the id "<id>#r" and the title "<title> (r)", so ids stay unique and the held-out
split (by title hash) spreads over the copies. Each run is a fresh `python -m realm_jax
prepare` process; its peak memory is the largest sum of RSS over it and all its children
(Beam's worker processes included), sampled every 0.2 s. Masking: salient (spaCy NER) up to
--ner-up-to passages, random above (NER dominates the time: 100k passages would take about ten
times the 10k salient run), so the 100k point measures the memory bound and the streaming
stages, the 10k points NER throughput. --window-kb sets data.beam_window_kb (the corpus one
round of pipelines covers on the local runner). Writes "Prepare on Apache Beam" in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402

SQUAD = os.path.join(os.path.dirname(REPO), "shared", "data", "squad", "corpus_train.jsonl")


def make_corpus(src: str, n: int, out: str) -> str:
    """The first n passages of src repeated with altered ids and titles (see the docstring)."""
    with open(src) as f:
        docs = [json.loads(line) for line in f]
    with open(out, "w") as g:
        for i in range(n):
            r, d = divmod(i, len(docs))
            doc = docs[d] if r == 0 else {**docs[d], "id": f"{docs[d]['id']}#{r}"}
            if r:
                doc["title"] = f"{doc['title']} ({r})"
            g.write(json.dumps(doc) + "\n")
    return out


def _rss(proc: psutil.Process) -> tuple[int, int, int]:
    """(RSS of the whole tree, of the main process, of its largest child) in bytes."""
    main, children = 0, []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        if p.pid == proc.pid:
            main = rss
        else:
            children.append(rss)
    return main + sum(children), main, max(children, default=0)


def run(corpus: str, engine: str, masking: str, workdir: str, workers: int, window_kb) -> dict:
    """One prepare in a fresh process: wall time, peak RSS of the process tree, counts."""
    cmd = [
        sys.executable,
        "-m",
        "realm_jax",
        "prepare",
        "--config",
        os.path.join(REPO, "configs/realm.py:squad"),
        "--workdir",
        workdir,
        f"--config.data.corpus={corpus}",
        f"--config.data.data_dir={workdir}/data",
        f"--config.data.masking={masking}",
        f"--config.data.engine={engine}",
        f"--config.data.ner_processes={workers}",
    ]
    if engine == "beam" and window_kb is not None:
        cmd.append(f"--config.data.beam_window_kb={window_kb}")
    if engine == "beam":
        cmd.append(
            f"--beam_options=--direct_num_workers={workers} "
            "--direct_running_mode=multi_processing --default_sdk_harness_log_level=WARNING"
        )
    start, peak = time.time(), (0, 0, 0)
    with open(os.path.join(workdir + ".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            peak = tuple(map(max, peak, _rss(ps)))
            time.sleep(0.2)
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}): see {workdir}.log")
    with open(os.path.join(workdir, "data", "summary.json")) as f:
        s = json.load(f)
    c = s["counts"]
    row = {
        "engine": engine,
        "masking": s["masking"],
        "passages": c["documents"],
        "blocks": c["blocks"],
        "examples": c["examples"] + c["eval_examples"],
        "wall_s": wall,
        "peak_gib": peak[0] / 2**30,
        "main_gib": peak[1] / 2**30,
        "child_gib": peak[2] / 2**30,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default=SQUAD)
    p.add_argument("--sizes", default="10000,100000,200000")
    p.add_argument("--ner-up-to", type=int, default=10_000, help="salient masking up to here")
    p.add_argument("--local-up-to", type=int, default=100_000, help="in-process runs up to here")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--window-kb", type=int, help="data.beam_window_kb (default: the config's)")
    a = p.parse_args()
    if a.window_kb is None:
        from configs.realm import get_config

        a.window_kb = get_config("squad").data.beam_window_kb
    if not os.path.exists(a.corpus):
        raise SystemExit(f"needs {a.corpus} (the project's ../shared folder)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.sizes.split(",")]:
            corpus = make_corpus(a.corpus, n, os.path.join(tmp, f"corpus_{n}.jsonl"))
            maskings = ["salient", "random"] if n <= a.ner_up_to else ["random"]
            for masking in maskings:
                for engine in ("local", "beam"):
                    if engine == "local" and n > a.local_up_to:
                        continue
                    wd = os.path.join(tmp, f"{engine}_{masking}_{n}")
                    rows.append(run(corpus, engine, masking, wd, a.workers, a.window_kb))
    lines = [
        f"`prepare` (config `squad`: block_len 192, query_len 64) of the SQuAD paragraphs "
        f"(18,896 real passages; the 100k corpus repeats them with altered ids and titles), "
        f"in process (spaCy with {a.workers} processes) and on Apache Beam's DirectRunner "
        f"(FnApiRunner, {a.workers} worker processes, multi_processing) in windows of "
        f"`data.beam_window_kb` = {a.window_kb:,} KiB of corpus (the SQuAD corpus is ~810 "
        "bytes a passage: the 10k corpus is ~1 window, the 100k one ~10, the 200k one ~20). "
        "Each row is a fresh `python -m realm_jax prepare` process; wall time includes "
        "start-up (Beam: the scan pipeline, then per window the blocks, held-out and "
        "training examples pipelines); "
        "peak memory is the largest sum of RSS over the process and its children (sampled "
        "every 0.2 s; shared pages count once per process), split into the main process "
        "(Beam: the runner, which holds a window's shuffled data in memory) and the largest "
        "child (Beam: a worker; in process: a spaCy process). Salient masking (spaCy NER) at "
        "10k; random masking at 100k and 200k (salient masking there would take about ten "
        "times the "
        "10k salient row). "
        f"Command: `python benchmarks/prepare_beam.py --window-kb {a.window_kb}`.",
        "",
        "| engine | masking | passages | blocks | examples | wall (s) | passages/s "
        "| peak RSS, all (GiB) | main process | largest worker |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['masking']} | {r['passages']:,} | {r['blocks']:,} | "
            f"{r['examples']:,} | {r['wall_s']:.0f} | {r['passages'] / r['wall_s']:.0f} | "
            f"{r['peak_gib']:.2f} | {r['main_gib']:.2f} | "
            + (f"{r['child_gib']:.2f} |" if r["child_gib"] else "- |")
        )
    write_section("Prepare on Apache Beam", "\n".join(lines))


if __name__ == "__main__":
    main()
