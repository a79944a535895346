"""`update` killed with SIGKILL at each of its stages while readers read (issue 61), through
the real CLI, into the "Update drills" section of docs/reliability.md.

    python acceptance/update_drills.py [--root runs/update-drills] [--no_doc]

On configs/orqa.py:smoke and the bundled sample: a workdir whose frozen index is published
(`evaluate --checkpoint initial --retrieval_only`, the index `finetune` would publish first),
one CHANGES file (documents added, replaced and deleted). The reference is that update run
uninterrupted in a copy of the workdir. Then, for each stage (after the diff, inside the
embedding, after the new blocks are written, after the version's index is written, after its
manifest is written but before it is renamed into place), a fresh copy is updated with
REALM_JAX_DRILL_UPDATE=<stage>:<mark> (update.py's drill points: the process notes its pid
there and waits), killed with SIGKILL, and run again. Meanwhile a reader process opens the
newest version over and over as `ask`, `evaluate` and the Python API do (versions.open_view,
its index, its blocks) and checks each read is whole. What must hold:
- after the kill the workdir still serves the previous version (0), whole;
- the re-run publishes version 1 equal to the reference (live rows, documents, index rows);
- the killed run's temp folder is gone after the re-run;
- the reader never saw an error or a version whose index and blocks disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
DOC = os.path.join(REPO, "docs", "reliability.md")
STAGES = ("diffed", "embedding", "segment", "index", "manifest")
CONFIG = "configs/orqa.py:smoke"


def _env(**more) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(more)
    return env


def cli(*args: str, env=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=REPO,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}):\n{p.stderr[-3000:]}")


def base_workdir(root: str) -> str:
    """The bundled sample prepared, its frozen index published (no fine-tuning)."""
    work = os.path.join(root, "base")
    if os.path.isdir(os.path.join(work, "index")):
        return work
    _check(cli("prepare", "--config", CONFIG, "--workdir", work), "prepare")
    p = cli(
        "evaluate",
        "--workdir",
        work,
        "--checkpoint",
        "initial",
        "--retrieval_only",
        "--limit",
        "8",
    )
    _check(p, "evaluate --checkpoint initial")
    return work


def write_changes(root: str, work: str) -> str:
    """3 added documents, 2 replaced (sample documents with new text), 2 deleted."""
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        docs = [json.loads(line) for line in f][:10]
    ids = [d.get("id") for d in docs]
    from realm_jax.config import load_config
    from realm_jax.data import versions

    cfg = load_config(os.path.join(REPO, CONFIG), [f"data.data_dir={work}/data"])
    have = sorted(versions.open_view(cfg, work).docs())
    ids = [i for i in ids if i in have] or have
    lines = [
        {
            "id": f"drill-{i}",
            "title": f"Drill town {i}",
            "text": f"Drill town {i} was founded "
            f"in {1600 + i} by weavers. Its river is called the Orn{i}.",
        }
        for i in range(3)
    ]
    lines += [
        {"id": ids[0], "title": "Replaced", "text": "This document was replaced in a drill."},
        {"id": ids[1], "title": "Replaced too", "text": "Another replaced document, in a drill."},
        {"id": ids[2], "delete": True},
        {"id": ids[3], "delete": True},
    ]
    path = os.path.join(root, "changes.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    return path


def snapshot(work: str) -> dict:
    """The newest version as readers see it: version, live rows, documents, index rows."""
    import numpy as np

    from realm_jax.config import load_config
    from realm_jax.data import versions
    from realm_jax.index import store

    cfg = load_config(os.path.join(REPO, CONFIG), [f"data.data_dir={work}/data"])
    v = versions.open_view(cfg, work)
    emb = store.load_embeddings(store.latest_valid(v.index_dir)[1])
    return {"version": v.version, "rows": v.rows, "docs": v.docs(), "emb": np.asarray(emb)}


def same(a: dict, b: dict) -> bool:
    import numpy as np

    return (
        a["version"] == b["version"]
        and np.array_equal(a["rows"], b["rows"])
        and a["docs"] == b["docs"]
        and np.allclose(a["emb"], b["emb"], rtol=1e-5, atol=1e-6)
    )


def reader(work: str, out: str, stop: str) -> int:
    """Read the newest version until `stop` exists; one JSON line per version seen, and any
    error, into `out`."""
    import numpy as np

    from realm_jax.config import load_config
    from realm_jax.data import versions
    from realm_jax.index import store

    cfg = load_config(os.path.join(REPO, CONFIG), [f"data.data_dir={work}/data"])
    seen, reads, errors = {}, 0, []
    while not os.path.exists(stop):
        try:
            v = versions.open_view(cfg, work)
            emb = store.load_embeddings(store.latest_valid(v.index_dir)[1])
            if len(emb) != len(v):
                raise AssertionError(f"version {v.version}: {len(emb)} index rows, {len(v)} blocks")
            top = int(np.argmax(emb @ emb[len(v) - 1]))
            v.text(v.row(top))  # the hit's block reads
            v.text(v.row(len(v) - 1))
            seen[v.version] = seen.get(v.version, 0) + 1
            reads += 1
        except Exception as e:  # noqa: BLE001 (every failure is the drill's finding)
            errors.append(f"{type(e).__name__}: {e}"[:300])
    with open(out, "w") as f:
        json.dump({"reads": reads, "versions": seen, "errors": errors}, f)
    return 0


def _temps(work: str) -> list[str]:
    folder = os.path.join(work, "corpus")
    return [n for n in os.listdir(folder) if n.startswith(".tmp-")] if os.path.isdir(folder) else []


def drill(root: str, stage: str, base: str, changes: str, ref: dict) -> dict:
    work = os.path.join(root, f"kill-{stage}")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    mark, stop, rout = (os.path.join(root, f"{stage}.{x}") for x in ("mark", "stop", "reader"))
    for p in (mark, stop, rout):
        if os.path.exists(p):
            os.remove(p)
    rd = subprocess.Popen(
        [sys.executable, __file__, "_reader", work, rout, stop], cwd=REPO, env=_env()
    )
    args = ("update", "--workdir", work, "--corpus", changes)
    up = subprocess.Popen(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=REPO,
        env=_env(REALM_JAX_DRILL_UPDATE=f"{stage}:{mark}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    t0 = time.time()
    while not os.path.exists(mark):
        if up.poll() is not None or time.time() - t0 > 600:
            raise RuntimeError(f"update never reached stage {stage} (exit {up.returncode})")
        time.sleep(0.05)
    up.send_signal(signal.SIGKILL)
    up.wait()
    after_kill = snapshot(work)
    tmp_left = _temps(work)
    t1 = time.time()
    p = cli(*args)
    rerun_s = time.time() - t1
    _check(p, f"update re-run after the kill at {stage}")
    done = snapshot(work)
    tmp_after = _temps(work)
    time.sleep(1.0)
    open(stop, "w").close()
    rd.wait(timeout=120)
    with open(rout) as f:
        r = json.load(f)
    return {
        "stage": stage,
        "served_after_kill": after_kill["version"],
        "temp_after_kill": len(tmp_left),
        "rerun_seconds": round(rerun_s, 1),
        "rerun_equals_reference": same(done, ref),
        "temp_after_rerun": len(tmp_after),
        "reader_reads": r["reads"],
        "reader_versions": r["versions"],
        "reader_errors": r["errors"],
    }


def checks(rows: list[dict]) -> list[tuple[bool, str]]:
    out = []
    for x in rows:
        s = x["stage"]
        out += [
            (x["served_after_kill"] == 0, f"{s}: version 0 still served after the kill"),
            (x["rerun_equals_reference"], f"{s}: the re-run's version 1 equals the reference"),
            (x["temp_after_rerun"] == 0, f"{s}: no temp folder left after the re-run"),
            (not x["reader_errors"] and x["reader_reads"] > 0, f"{s}: every read whole"),
        ]
    return out


def write_doc(rows, ok_list, minutes: float, ref_s: float) -> None:
    from benchmarks._report import write_section

    table = [
        "| killed at | served after the kill | temp folders left | re-run | re-run = reference "
        "| temp left after | reader reads (versions seen) | reader errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        seen = ", ".join(f"v{k}: {n}" for k, n in sorted(x["reader_versions"].items()))
        table.append(
            f"| {x['stage']} | version {x['served_after_kill']} | {x['temp_after_kill']} | "
            f"{x['rerun_seconds']} s | {'yes' if x['rerun_equals_reference'] else 'NO'} | "
            f"{x['temp_after_rerun']} | {x['reader_reads']} ({seen}) | "
            f"{len(x['reader_errors'])} |"
        )
    passed = sum(ok for ok, _ in ok_list)
    text = "\n".join(
        [
            f"Written by `python acceptance/update_drills.py` ({minutes:.1f} minutes): "
            "`update` (issue 61) killed with SIGKILL at each of its stages on "
            f"`{CONFIG}` and the bundled sample (3 documents added, 2 replaced, 2 deleted; "
            f"the uninterrupted update took {ref_s:.1f} s), a reader process opening the "
            "newest version over and over meanwhile as `ask`, `evaluate` and the Python API "
            "do. The stages are update.py's drill points (REALM_JAX_DRILL_UPDATE): after the "
            "diff, inside the embedding, after the new blocks are written, after the "
            "version's index is written, after its manifest is written in the temp folder "
            "(before the rename that publishes it).",
            "",
            *table,
            "",
            f"{passed}/{len(ok_list)} checks passed: "
            + "; ".join(msg + ("" if ok else " FAILED") for ok, msg in ok_list[:4])
            + " (and the same for every stage).",
        ]
    )
    write_section("Update drills", text, doc=DOC)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_reader":
        return reader(*sys.argv[2:5])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.join(REPO, "runs", "update-drills"))
    p.add_argument("--no_doc", action="store_true")
    p.add_argument("--stages", default=",".join(STAGES))
    a = p.parse_args()
    root, t0 = os.path.abspath(a.root), time.time()
    os.makedirs(root, exist_ok=True)
    base = base_workdir(root)
    changes = write_changes(root, base)
    refw = os.path.join(root, "reference")
    shutil.rmtree(refw, ignore_errors=True)
    shutil.copytree(base, refw)
    t1 = time.time()
    _check(cli("update", "--workdir", refw, "--corpus", changes), "the reference update")
    ref_s = time.time() - t1
    ref = snapshot(refw)
    rows = []
    for stage in a.stages.split(","):
        rows.append(drill(root, stage, base, changes, ref))
        print(json.dumps(rows[-1]))
    ok_list = checks(rows)
    for ok, msg in ok_list:
        print(("ok   " if ok else "FAIL ") + msg)
    ok = all(x for x, _ in ok_list)
    minutes = (time.time() - t0) / 60
    if not a.no_doc and a.stages == ",".join(STAGES):
        write_doc(rows, ok_list, minutes, ref_s)
    print(f"update drills {'passed' if ok else 'FAILED'} in {minutes:.1f} minutes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
