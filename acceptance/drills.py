"""Reliability drills (issue 14): kill -9 the trainer and the refresh job at random moments,
damage checkpoints, and check what survived, through the real CLI as a user runs it. Each
drill prints what it proved; the results go to the "Drills" section of docs/reliability.md.

    python acceptance/drills.py            # 10 trainer kills, 4 refresher kills, 3 kinds of damage
    python acceptance/drills.py --quick    # 3 trainer kills, 2 refresher kills, 1 kind of damage

Drills (all on configs/realm.py:smoke, 2 fake CPU devices, the bundled sample prepared once
into <root>/data and shared by every run through data.data_dir):

- trainer: `local` (trainer + refresh job) killed with SIGKILL at seeded random moments (2-5
  steps into a run, at a random point of a step: paced in steps, so the same on any machine), one
  of them while an orbax async save is in flight (a save the log started that has not
  completed), one inside an index swap, then resumed. Every resume must start from the
  newest checkpoint that was complete at the kill, and the example ids each step trained
  on (train.record_example_ids) must equal an uninterrupted run's for every step.
- refresher: `train` and `refresh` as two processes; the refresh job is killed with SIGKILL
  while it writes an index version (its .tmp-step_* folder seen in index/) and restarted. A
  watcher reads every published version as the trainer would, the moment it appears: none
  may be partial; the trainer must only take up versions that verified, and the restarted
  job must go on publishing.
- damage: the newest checkpoint truncated, zero-filled or missing a file; `train` must
  resume from the one before, move the damaged one to checkpoints-damaged/ and end with the
  same parameters and example ids as the undamaged run (in-process refresh, which makes a
  resume bit-exact when refresh.every divides train.checkpoint_every).

The index swap is over in about a millisecond on this corpus, too short to hit from outside,
so the drill runs the trainer through this file (`drills.py _cli ...`), which wraps the feed's
index load to note its start in a file and pause DRILL_SWAP_PAUSE seconds before loading:
the kill then lands inside IndexFeed._load_published. Nothing else differs from the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)
DOC = os.path.join(REPO, "docs", "reliability.md")
SWAP_PAUSE = 0.4  # seconds the wrapped index load waits before reading (the swap window)
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([0-9.naninf]+)", re.M)


# ------------------------------------------------------------------------------ processes


class Run:
    """One CLI process (realm_jax through this file's _cli wrapper), its output in a log."""

    def __init__(self, name: str, root: str, args: list[str], env: dict | None = None):
        self.name, self.log = name, os.path.join(root, "logs", f"{name}.log")
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        self.started = time.time()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "_cli", *args],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        self.pid = self.proc.pid

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def children(self) -> list[int]:
        """Pids of this process's children (`local`'s refresh job)."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def kill9(self) -> float:
        """SIGKILL this process (not its group); the moment, seconds after its start."""
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()
        return time.time() - self.started

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise RuntimeError(f"{self.name} ran past {timeout:.0f}s; see {self.log}") from None


def wait_for(predicate, timeout: float, interval: float = 0.005, what: str = "a condition"):
    """Poll `predicate` until it returns something truthy; that value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (its parent was killed and nobody reaped it yet) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def common_args(root: str, work: str, *overrides: str) -> list[str]:
    """A smoke run on the shared prepared data, logging every step, no held-out evaluation."""
    return [
        "--config",
        "configs/realm.py:smoke",
        "--workdir",
        work,
        "--cpu_devices",
        "2",
        f"--config.data.data_dir={os.path.join(root, 'data')}",
        "--config.train.log_every=1",
        "--config.train.eval_every=0",
        "--config.train.record_example_ids=true",
        "--config.refresh.poll_seconds=0.2",
        *overrides,
    ]


def prepare(root: str) -> None:
    """Prepare the bundled sample once into <root>/data (idempotent: reused when there)."""
    args = common_args(root, os.path.join(root, "prep"))
    run = Run("prepare", root, ["prepare", *args[:4], args[6]])  # config, workdir, data_dir
    if run.wait(600) != 0:
        raise RuntimeError(f"prepare failed; see {run.log}")


# ------------------------------------------------------------------------------ run state


def example_ids(work: str) -> tuple[dict[int, list[int]], int]:
    """({step: the ids its last record says}, number of records) from example_ids.jsonl; a
    line cut by a kill is not a record."""
    out, n = {}, 0
    try:
        with open(os.path.join(work, "example_ids.jsonl")) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                out[rec["step"]], n = rec["example_ids"], n + 1
    except FileNotFoundError:
        pass
    return out, n


def records_since(work: str, n0: int) -> list[int]:
    """The steps recorded after the first n0 records (what the current run trained)."""
    steps = []
    try:
        with open(os.path.join(work, "example_ids.jsonl")) as f:
            for i, line in enumerate(f):
                if i >= n0 and line.endswith("\n"):
                    steps.append(json.loads(line)["step"])
    except FileNotFoundError:
        pass
    return steps


def checkpoints(work: str) -> tuple[list[int], list[str]]:
    """(complete checkpoint steps, orbax tmp folders of saves in flight) in checkpoints/."""
    try:
        names = os.listdir(os.path.join(work, "checkpoints"))
    except FileNotFoundError:
        return [], []
    return sorted(int(n) for n in names if n.isdigit()), sorted(n for n in names if "tmp" in n)


def tmp_folders(work: str) -> set[tuple[str, int]]:
    """(name, inode) of the orbax tmp folders in checkpoints/: a save in flight, or one a
    kill cut short (orbax leaves those until it saves that step again)."""
    out = set()
    for name in checkpoints(work)[1]:
        try:
            out.add((name, os.stat(os.path.join(work, "checkpoints", name)).st_ino))
        except FileNotFoundError:
            pass
    return out


def saves_started(text: str) -> list[int]:
    """Steps whose async save a run's log says it started."""
    return [int(n) for n in re.findall(r"checkpoint (\d+): save started", text)]


def resumed_from(text: str) -> int | None:
    m = re.search(r"resumed from checkpoint (\d+)", text)
    return int(m.group(1)) if m else None


def last_loss(text: str) -> tuple[int, str] | None:
    steps = STEP_LINE.findall(text)
    return (int(steps[-1][0]), steps[-1][2]) if steps else None


def final_params(work: str, step: int) -> dict:
    """Checkpoint `step`'s train state as host numpy arrays, flattened by path."""
    import logging

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.ERROR)  # "no _CHECKPOINT_METADATA" in state/
    path = os.path.abspath(os.path.join(work, "checkpoints", str(step), "state"))
    ckpt = ocp.PyTreeCheckpointer()
    meta = ckpt.metadata(path).item_metadata
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = ckpt.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def same_params(a: dict, b: dict) -> tuple[bool, float]:
    """(bitwise equal, the largest absolute difference) of two flattened states."""
    import numpy as np

    if a.keys() != b.keys():
        return False, float("inf")
    diff = max(float(np.max(np.abs(np.asarray(a[k], np.float64) - b[k]))) for k in a)
    return all(np.array_equal(a[k], b[k]) for k in a), diff


# ------------------------------------------------------------------------------ trainer drill


def _swaps(mark: str, pid: int) -> int:
    """Index loads process `pid` began (the _cli wrapper notes each)."""
    try:
        with open(mark) as f:
            return sum(1 for line in f if line.split()[0] == str(pid))
    except FileNotFoundError:
        return 0


def _kill_trainer(
    run: Run, work: str, kind: str, rng: random.Random, n0: int, mark: str, stale: set
):
    """Wait for `kind`'s moment in `run` (a `local`), SIGKILL the trainer; what it hit, or
    None when the run ended first. `stale`: tmp_folders() before the run started."""
    wait_for(lambda: records_since(work, n0) or not run.alive(), 900, 0.05, "a first step")
    if not run.alive():
        return None
    if kind == "random":
        # Paced in steps, not seconds, so that the drill means the same on a fast machine
        # and a slow one: after 2-5 steps of this run (a checkpoint every 3, so a kill may
        # or may not find a newer one complete), at a random point of the next step.
        n = rng.randint(2, 5)
        seen, t_last, step_s = 1, time.time(), None
        while seen < n and run.alive():
            time.sleep(0.01)
            now_seen = len(records_since(work, n0))
            if now_seen > seen:
                seen, step_s, t_last = now_seen, time.time() - t_last, time.time()
        frac = rng.uniform(0.0, 1.0)
        time.sleep(frac * (step_s or 0.0))
        what = f"{frac:.2f} of a step after this run's step #{seen} was recorded"
    elif kind == "save":

        def in_flight():  # a new tmp folder, or a save the log started (orbax may reuse
            # the tmp folder an earlier kill left) that has not completed yet
            done = checkpoints(work)[0]
            started = [s for s in saves_started(run.text()) if s not in done]
            return tmp_folders(work) - stale or started or not run.alive()

        wait_for(in_flight, 300, 0.001, "a save")
        what = "an async checkpoint save in flight"
    else:
        loads = _swaps(mark, run.pid)  # the index taken at start
        wait_for(lambda: _swaps(mark, run.pid) > loads or not run.alive(), 300, 0.002, "a swap")
        delay = rng.uniform(0.0, SWAP_PAUSE / 2)
        time.sleep(delay)
        what = f"inside an index swap ({delay * 1000:.0f} ms into it)"
    children = run.children()
    if not run.alive():
        return None
    moment = run.kill9()
    done = checkpoints(work)[0]  # the process is dead: what was complete at the kill
    tmp = sorted(name for name, _ in tmp_folders(work))  # saves cut short, this run's or not
    text = run.text()
    # A save in flight: started in the log and not complete, or a tmp folder this run made
    # (orbax creates it before mgr.save returns and the log line is written).
    made = {int(name.split(".")[0]) for name, _ in tmp_folders(work) - stale}
    row = {
        "in_flight": sorted(made | {s for s in saves_started(text) if s not in done}),
        "kind": kind,
        "what": what,
        "moment": moment,
        "last_step": max(records_since(work, n0), default=None),
        "complete": max(done, default=None),
        "tmp": tmp,
        "swap_open": _swaps(mark, run.pid) > text.count("index: now using version"),
    }
    # local's refresh job gets SIGTERM from the kernel (PR_SET_PDEATHSIG) when its parent dies.
    t0 = time.time()
    wait_for(lambda: all(_pid_gone(c) for c in children), 120, 0.05, "the refresh job to exit")
    row["child_exit"] = time.time() - t0
    return row


def trainer_drill(root: str, kills: int, steps: int, rng: random.Random) -> dict:
    """Kill -9 `local`'s trainer at `kills` moments, resume each time, compare example ids."""
    base, work = os.path.join(root, "trainer-base"), os.path.join(root, "trainer")
    for d in (base, work):
        shutil.rmtree(d, ignore_errors=True)
    over = [
        f"--config.train.steps={steps}",
        "--config.train.checkpoint_every=3",
        "--config.train.keep_checkpoints=3",
    ]
    mark = os.path.join(root, "swaps.txt")
    env = {"DRILL_SWAP_MARK": mark, "DRILL_SWAP_PAUSE": str(SWAP_PAUSE)}
    t0 = time.time()
    b = Run("trainer-base", root, ["local", *common_args(root, base, *over)], env)
    if b.wait(1200) != 0:
        raise RuntimeError(f"the uninterrupted run failed; see {b.log}")
    print(f"trainer drill: uninterrupted run of {steps} steps took {time.time() - t0:.0f}s")
    kinds = ["save", "swap"] + ["random"] * (kills - 2)
    rng.shuffle(kinds)
    rows, t0 = [], time.time()
    for i, kind in enumerate([*kinds, None]):
        n0, stale = example_ids(work)[1], tmp_folders(work)
        run = Run(f"trainer-{i + 1}", root, ["local", *common_args(root, work, *over)], env)
        row = None if kind is None else _kill_trainer(run, work, kind, rng, n0, mark, stale)
        if row is None and run.wait(1200) != 0:
            raise RuntimeError(f"trainer run {i + 1} failed; see {run.log}")
        if rows:  # how this run resumed after the previous kill
            rows[-1]["resumed"] = resumed_from(run.text())
            rows[-1]["first_step"] = min(records_since(work, n0), default=None)
        if row is None:
            final = run
            break
        rows.append(row)
        print(
            f"  kill {len(rows)} ({kind}): at {row['moment']:.1f}s, {row['what']}; last step "
            f"{row['last_step']}, newest complete checkpoint {row['complete']}, saves in "
            f"flight {row['in_flight'] or 'none'}, tmp folders {row['tmp'] or 'none'}"
        )
    base_ids, ids = example_ids(base)[0], example_ids(work)[0]
    return {
        "steps": steps,
        "rows": rows,
        "seconds": time.time() - t0,
        "ids_equal": all(ids.get(s) == base_ids.get(s) is not None for s in range(1, steps + 1)),
        "ids_steps": (len(base_ids), len(ids)),
        "base_loss": last_loss(b.text()),
        "loss": last_loss(final.text()),
        "final_tmp": checkpoints(work)[1],
        "errors": [ln for ln in final.text().splitlines() if " ERROR " in ln],
    }


# ------------------------------------------------------------------------------ refresher drill

TMP_VERSION = re.compile(r"^\.tmp-step_(\d+)-(\d+)-[0-9a-f]+$")  # store.publish_index's


class Watcher(threading.Thread):
    """Reads every index version the moment its final name appears, as a trainer would
    (store.verify_version, checksum included). A version that fails while its folder is
    still there is a partial index a trainer could have loaded."""

    def __init__(self, index_dir: str):
        super().__init__(daemon=True)
        self.dir, self.stop = index_dir, threading.Event()
        self.verified: set[int] = set()
        self.partial: list[str] = []
        self.seen_tmp: set[str] = set()

    def run(self) -> None:
        from realm_jax.index import store

        while not self.stop.is_set():
            try:
                names = os.listdir(self.dir)
            except FileNotFoundError:
                names = []
            for name in names:
                if TMP_VERSION.match(name):
                    self.seen_tmp.add(name)
                m = re.match(r"^step_(\d+)$", name)
                if not m or int(m.group(1)) in self.verified:
                    continue
                path = os.path.join(self.dir, name)
                try:
                    store.verify_version(path)
                    self.verified.add(int(m.group(1)))
                except (store.CorruptIndexError, OSError) as e:
                    if os.path.isdir(path):  # not a version retention was removing
                        self.partial.append(f"{name}: {e}")
            time.sleep(0.005)


def _writing(index_dir: str, pid: int) -> str | None:
    """The temp folder `pid` is writing an index version into, if any."""
    try:
        names = os.listdir(index_dir)
    except FileNotFoundError:
        return None
    return next((n for n in names if (m := TMP_VERSION.match(n)) and int(m[2]) == pid), None)


def refresher_drill(root: str, kills: int, rng: random.Random) -> dict:
    """`train` + `refresh` apart; kill -9 the refresh job while it publishes, restart it."""
    work = os.path.join(root, "refresher")
    shutil.rmtree(work, ignore_errors=True)
    index_dir = os.path.join(work, "index")
    watcher = Watcher(index_dir)
    watcher.start()
    refresh_args = ["refresh", *common_args(root, work)]
    t0 = time.time()
    ref = Run("refresher-0", root, refresh_args)
    every = ["--config.train.checkpoint_every=5"]
    trainer = Run(
        "refresher-trainer",
        root,
        ["train", *common_args(root, work, "--config.train.steps=100000", *every)],
    )
    wait_for(lambda: records_since(work, 0) or not trainer.alive(), 900, 0.05, "training")
    kinds = ["writing"] * (kills - 1) + ["random"]
    rng.shuffle(kinds)
    rows, refreshers = [], [ref]
    for i, kind in enumerate(kinds):
        wait_for(lambda r=ref: "refresh: watching" in r.text(), 300, 0.05, "the refresh job")
        if kind == "writing":
            tmp = wait_for(lambda r=ref: _writing(index_dir, r.pid), 300, 0.001, "a publish")
            delay = rng.uniform(0.0, 0.004)
            time.sleep(delay)
            what = f"{delay * 1000:.0f} ms after it began writing {tmp.split('-')[1]}"
        else:
            delay = rng.uniform(0.5, 5.0)
            time.sleep(delay)
            what = f"{delay:.2f}s after it started watching"
        moment = ref.kill9()
        left = _writing(index_dir, ref.pid)
        rows.append(
            {
                "kind": kind,
                "what": what,
                "moment": moment,
                "left": left,
                "contents": sorted(os.listdir(os.path.join(index_dir, left))) if left else [],
                "published": ref.text().count("refresh: published index"),
            }
        )
        print(f"  refresher kill {i + 1} ({kind}): at {moment:.1f}s, {what}; left {left}")
        ref = Run(f"refresher-{i + 1}", root, refresh_args)
        refreshers.append(ref)
    # The last refresh job must publish, and the trainer take that version up.
    wait_for(lambda: "refresh: published index" in ref.text(), 300, 0.1, "a publish")
    version = int(re.search(r"refresh: published index (\d+)", ref.text())[1])
    wait_for(
        lambda: f"now using version {version} " in trainer.text() or not trainer.alive(),
        300,
        0.1,
        "the trainer to take it up",
    )
    trainer.proc.send_signal(signal.SIGTERM)  # a clean stop: it saves and exits 0
    trainer_rc = trainer.wait(300)
    ref.proc.send_signal(signal.SIGTERM)
    ref.wait(120)
    time.sleep(0.1)
    watcher.stop.set()
    watcher.join()
    text = trainer.text()
    used = sorted({int(v) for v in re.findall(r"now using version (\d+) ", text)})
    return {
        "rows": rows,
        "seconds": time.time() - t0,
        "trainer_rc": trainer_rc,
        "trainer_steps": max(records_since(work, 0), default=0),
        "used": used,
        "unverified_used": [v for v in used if v not in watcher.verified],
        "verified": len(watcher.verified),
        "partial": watcher.partial,
        "skipped": [ln for ln in text.splitlines() if "skipping index version" in ln],
        "final_published": ref.text().count("refresh: published index"),
        "last_version": version,
        "tmp_left": sorted(n for n in os.listdir(index_dir) if n.startswith(".tmp")),
        "tmp_seen": len(watcher.seen_tmp),
    }


# ------------------------------------------------------------------------------ damage drill


def damage(work: str, step: int, how: str) -> str:
    """Damage checkpoint `step`'s largest array file: truncate it to half, zero-fill it or
    delete it. Returns its path relative to the checkpoint."""
    root = os.path.join(work, "checkpoints", str(step))
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(root, "state")) for f in fs]
    path = max((p for p in files if f"{os.sep}d{os.sep}" in p), key=os.path.getsize)
    size = os.path.getsize(path)
    if how == "truncated":
        os.truncate(path, size // 2)
    elif how == "zero-filled":
        with open(path, "r+b") as f:
            f.write(bytes(size))
    else:
        os.remove(path)
    return f"{os.path.relpath(path, root)} ({size} bytes)"


def damage_drill(root: str, kinds: list[str]) -> dict:
    """Damage the newest checkpoint of a finished run; `train` again must resume from the one
    before, move the damaged one aside, and end where the undamaged run ended."""
    base = os.path.join(root, "damage-base")
    shutil.rmtree(base, ignore_errors=True)
    steps, every = 16, 4
    args = common_args(
        root,
        base,
        f"--config.train.steps={steps}",
        f"--config.train.checkpoint_every={every}",
        "--config.train.keep_checkpoints=3",
        "--config.refresh.mode=inprocess",
        f"--config.refresh.every={every}",
    )
    b = Run("damage-base", root, ["train", *args])
    if b.wait(900) != 0:
        raise RuntimeError(f"the undamaged run failed; see {b.log}")
    base_params, base_ids = final_params(base, steps), example_ids(base)[0]
    rows = []
    for how in kinds:
        work = os.path.join(root, f"damage-{how}")
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        what = damage(work, steps, how)
        run = Run(f"damage-{how}", root, ["train", *[work if a == base else a for a in args]])
        rc = run.wait(900)
        text = run.text()
        aside = os.listdir(os.path.join(work, "checkpoints-damaged"))
        equal, diff = same_params(base_params, final_params(work, steps)) if rc == 0 else (0, 0)
        ids = example_ids(work)[0]
        rows.append(
            {
                "how": how,
                "file": what,
                "rc": rc,
                "resumed": resumed_from(text),
                "aside": aside,
                "log": [
                    re.sub(r"^\S+ (WARNING|ERROR) realm_jax[.\w]*: ", r"\1 ", ln)
                    for ln in text.splitlines()
                    if " WARNING realm_jax" in ln or " ERROR realm_jax" in ln
                ],
                "params_equal": equal,
                "max_diff": diff,
                "ids_equal": all(ids.get(s) == base_ids[s] for s in range(1, steps + 1)),
                "checkpoints": checkpoints(work)[0],
            }
        )
        r = rows[-1]
        print(
            f"  damage {how}: exit {rc}, resumed from {r['resumed']}, moved aside {aside}, "
            f"parameters equal {equal} (max diff {diff:.3g}), example ids equal {r['ids_equal']}"
        )
    return {"steps": steps, "every": every, "rows": rows}


# ------------------------------------------------------------------------------ verdicts


def trainer_checks(r: dict, kills: int) -> list[tuple[bool, str]]:
    rows = r["rows"]
    resumes = [x for x in rows if x.get("resumed") == x["complete"]]
    firsts = [x for x in rows if x.get("first_step") == (x["complete"] or 0) + 1]
    return [
        (len(rows) == kills, f"{len(rows)} of {kills} kills landed before the run finished"),
        (
            len(resumes) == len(rows),
            f"{len(resumes)} of {len(rows)} resumes started from the newest checkpoint complete "
            "at the kill (no step lost beyond it)",
        ),
        (
            len(firsts) == len(rows),
            f"{len(firsts)} of {len(rows)} resumed runs trained the step after it first",
        ),
        (
            any(x["in_flight"] for x in rows),
            f"{sum(1 for x in rows if x['in_flight'])} kills interrupted an async checkpoint "
            "save (started, not complete at the kill); the resume passed over it",
        ),
        (any(x["swap_open"] for x in rows), "a kill landed inside an index swap"),
        (
            r["ids_equal"],
            f"the example ids of all {r['steps']} steps equal the uninterrupted run's "
            "(none repeated, none skipped)",
        ),
        (not r["errors"], "the final run logged no error"),
    ]


def refresher_checks(r: dict) -> list[tuple[bool, str]]:
    mid = sum(1 for x in r["rows"] if x["left"])
    return [
        (mid > 0, f"{mid} of {len(r['rows'])} kills left a half-written version (.tmp-step_*)"),
        (
            not r["partial"],
            f"every one of the {r['verified']} versions published under a final name verified "
            "(checksum) the moment it appeared: no partial index was ever visible",
        ),
        (
            not r["unverified_used"] and not r["skipped"],
            f"the trainer took up {len(r['used'])} versions, each one that verified, and "
            "skipped none as corrupt",
        ),
        (
            r["final_published"] > 0,
            f"the restarted refresh job went on publishing (version {r['last_version']}, "
            "taken up by the trainer)",
        ),
        (not r["tmp_left"], "the killed jobs' temp folders were reaped by the next publish"),
        (r["trainer_rc"] == 0, "the trainer ran throughout and exited 0 on SIGTERM"),
    ]


def damage_checks(r: dict) -> list[tuple[bool, str]]:
    prev = r["steps"] - r["every"]
    out = []
    for x in r["rows"]:
        ok = (
            x["rc"] == 0
            and x["resumed"] == prev
            and len(x["aside"]) == 1
            and x["aside"][0].startswith(f"{r['steps']}-")
            and x["params_equal"]
            and x["ids_equal"]
        )
        out.append(
            (
                ok,
                f"{x['how']}: resumed from {x['resumed']}, checkpoint {r['steps']} moved to "
                f"checkpoints-damaged/{x['aside'][0] if x['aside'] else '?'}, final parameters "
                f"bitwise equal to the undamaged run's: {x['params_equal']}, example ids equal: "
                f"{x['ids_equal']}",
            )
        )
    return out


def show(name: str, checks: list[tuple[bool, str]]) -> bool:
    print(f"{name}:")
    for ok, text in checks:
        print(f"  {'PROVED' if ok else 'FAILED'}: {text}")
    return all(ok for ok, _ in checks)


# ------------------------------------------------------------------------------ the report


def _checks_md(checks) -> str:
    return "\n".join(f"- {'proved' if ok else '**FAILED**'}: {text}" for ok, text in checks)


def trainer_md(r: dict, checks) -> str:
    rows = [
        "| # | moment | what it hit | last step trained | newest complete checkpoint | "
        "save in flight | orbax tmp folders | refresh job gone after | resumed from | "
        "first step after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(r["rows"], 1):
        tmp = ", ".join(f"`{t}`" for t in x["tmp"]) or "-"
        flight = ", ".join(map(str, x["in_flight"])) or "-"
        rows.append(
            f"| {i} | {x['moment']:.1f}s | {x['kind']}: {x['what']} | {x['last_step']} | "
            f"{x['complete']} | {flight} | {tmp} | {x['child_exit']:.1f}s | {x.get('resumed')} | "
            f"{x.get('first_step')} |"
        )
    (bs, bl), (s, lo) = r["base_loss"], r["loss"] or ("-", "none: it trained no step")
    return "\n".join(
        [
            f"### Trainer killed {len(r['rows'])} times (`local`, {r['steps']} steps, a "
            "checkpoint every 3)",
            "",
            *rows,
            "",
            _checks_md(checks),
            "",
            "`moment`: seconds after that run's start (imports and compilation take most of "
            "it); `last step trained`: the last step whose batch the run recorded; `save in "
            "flight`: saves the run started (its log says so, or it made the tmp folder) that "
            "were not complete at the kill; "
            "`refresh job gone after`: how long `local`'s refresh job took to exit on the "
            "SIGTERM the kernel sends it when the trainer dies (PR_SET_PDEATHSIG). orbax tmp "
            "folders left in checkpoints/ at the end: "
            f"{', '.join(f'`{t}`' for t in r['final_tmp']) or 'none'} (orbax replaces one when "
            "it saves that step again and never lists it as a checkpoint).",
            "",
            f"The killed-and-resumed run took {r['seconds']:.0f}s in all. Its final loss "
            f"(step {s}: {lo}) and the uninterrupted run's (step {bs}: {bl}) are not expected "
            "to match: with an external refresh job, which index version a step reads depends "
            "on when the job publishes, and a restarted trainer starts from the newest version "
            "published, not the one it had. The damage drill below, with in-process refresh, "
            "shows a resume that is bit-exact.",
        ]
    )


def refresher_md(r: dict, checks) -> str:
    rows = ["| # | moment | what it hit | left behind | versions it had published |"]
    rows.append("|---|---|---|---|---|")
    for i, x in enumerate(r["rows"], 1):
        held = ", ".join(x["contents"]) or "nothing"
        left = f"`{x['left']}` holding {held}" if x["left"] else "-"
        rows.append(
            f"| {i} | {x['moment']:.1f}s | {x['kind']}: {x['what']} | {left} | {x['published']} |"
        )
    return "\n".join(
        [
            f"### Refresh job killed {len(r['rows'])} times (`train` + `refresh`)",
            "",
            *rows,
            "",
            _checks_md(checks),
            "",
            f"The trainer trained {r['trainer_steps']} steps meanwhile ({r['seconds']:.0f}s).",
        ]
    )


def damage_md(r: dict, checks) -> str:
    lines = [
        f"### Damaged checkpoints (`train`, {r['steps']} steps, a checkpoint every "
        f"{r['every']}, in-process refresh every {r['every']})",
        "",
        f"Checkpoint {r['steps']} of a finished run damaged, then the same `train` command again:",
        "",
        _checks_md(checks),
    ]
    for x in r["rows"]:
        lines += ["", f"{x['how']} (`{x['file']}`), the log's warnings and errors:", "", "```"]
        lines += [re.sub(r"/\S*/runs/drills/", "<root>/", ln) for ln in x["log"]] + ["```"]
    return "\n".join(lines)


def write_doc(results: dict, checks: dict, seed: int, minutes: float) -> None:
    from benchmarks._report import write_section

    parts = [
        f"Written by `python acceptance/drills.py` (seed {seed}, {minutes:.1f} minutes): the real "
        "CLI on `configs/realm.py:smoke`, 2 fake CPU devices, the bundled sample prepared once. "
        "Every kill is SIGKILL (kill -9) of one process. The trainer records the example ids of "
        "every step (`--config.train.record_example_ids=true`, `WORKDIR/example_ids.jsonl`). "
        "An index swap takes milliseconds here, so the drill runs the trainer through "
        f"`acceptance/drills.py _cli`, which notes each index load and pauses it {SWAP_PAUSE}s "
        "before reading: the swap kill lands inside IndexFeed._load_published.",
    ]
    if "trainer" in results:
        parts.append(trainer_md(results["trainer"], checks["trainer"]))
    if "refresher" in results:
        parts.append(refresher_md(results["refresher"], checks["refresher"]))
    if "damage" in results:
        parts.append(damage_md(results["damage"], checks["damage"]))
    write_section("Drills", "\n\n".join(parts), doc=DOC)


# ------------------------------------------------------------------------------ main


def _cli(argv: list[str]) -> int:
    """realm_jax's CLI, with the feed's index load noted and paused when DRILL_SWAP_MARK is
    set (so that a kill can land inside a swap)."""
    mark, pause = os.environ.get("DRILL_SWAP_MARK"), float(os.environ.get("DRILL_SWAP_PAUSE", 0))
    if mark:
        from realm_jax.index import store

        load = store.load_embeddings

        def noted_load(path, **kw):
            with open(mark, "a") as f:
                f.write(f"{os.getpid()} {path}\n")
            time.sleep(pause)
            return load(path, **kw)

        store.load_embeddings = noted_load  # IndexFeed reads it as store.load_embeddings
    from realm_jax import cli

    sys.argv = [sys.argv[0], *argv]  # `local` passes its --config.* on to the refresh job
    return cli.main(argv)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_cli":
        return _cli(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer kills; does not write the doc")
    p.add_argument("--root", default=os.path.join(REPO, "runs", "drills"), help="drill folder")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--only", choices=("trainer", "refresher", "damage"), action="append")
    p.add_argument("--no_doc", action="store_true", help="do not write docs/reliability.md")
    p.add_argument("--doc_only", action="store_true", help="rewrite the doc from drills.json")
    a = p.parse_args()
    root, rng, t0 = os.path.abspath(a.root), random.Random(a.seed), time.time()
    if a.doc_only:  # the last full run's results, e.g. after a change to the report's wording
        with open(os.path.join(root, "drills.json")) as f:
            saved = json.load(f)
        write_doc(saved["results"], saved["checks"], saved["seed"], saved["minutes"])
        return 0
    only = a.only or ["trainer", "refresher", "damage"]
    print(f"drills in {root}, seed {a.seed}{' (quick)' if a.quick else ''}")
    prepare(root)
    results, checks = {}, {}
    if "trainer" in only:
        kills, steps = (3, 15) if a.quick else (10, 36)
        results["trainer"] = trainer_drill(root, kills, steps, rng)
        checks["trainer"] = trainer_checks(results["trainer"], kills)
    if "refresher" in only:
        results["refresher"] = refresher_drill(root, 2 if a.quick else 4, rng)
        checks["refresher"] = refresher_checks(results["refresher"])
    if "damage" in only:
        kinds = ["zero-filled"] if a.quick else ["truncated", "zero-filled", "missing"]
        results["damage"] = damage_drill(root, kinds)
        checks["damage"] = damage_checks(results["damage"])
    ok = all([show(name, c) for name, c in checks.items()])
    minutes = (time.time() - t0) / 60
    print(f"drills {'passed' if ok else 'FAILED'} in {minutes:.1f} minutes")
    saved = {"results": results, "checks": checks, "seed": a.seed, "minutes": minutes}
    full = not a.quick and a.only is None  # only a full run's results go to the doc
    with open(os.path.join(root, "drills.json" if full else "drills-partial.json"), "w") as f:
        json.dump(saved, f, indent=1)
    if full and not a.no_doc:
        write_doc(results, checks, a.seed, minutes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
