"""Device check (issue 58): on a GPU host or TPU VM, one command runs the smoke, the world
tutorial's REALM stage, the base step's bf16 MFU and the peer benchmark, within 10 minutes.

    make device-check [DEVICE_ARGS="--quick"]
    python benchmarks/device_check.py [--install] [--quick] [--out runs/device-check]

Stages (each with its own time budget, each recorded as done / skipped / failed with the
reason, none aborting the others): environment (with --install, the accelerator extra when
JAX sees none), smoke, world, base_mfu, peer. Works offline: no hub weights are needed
(bert-tiny from --bert, ../shared or the HF cache, else random weights, said in the record).
Writes OUT/results.json and OUT/summary.md (logs in OUT/logs/) and prints the summary.
--quick: tiny budgets and steps, the base stage at the smoke model (a CPU check).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

SCHEMA = 1
STAGES = ("environment", "smoke", "world", "base_mfu", "peer")
# seconds per stage: on an accelerator they sum to 590, and no stage starts past their sum;
# a pip install of the extra (download-bound) has INSTALL_S of its own, not counted there
BUDGETS = {"environment": 40, "smoke": 130, "world": 150, "base_mfu": 180, "peer": 90}
QUICK_BUDGETS = {"environment": 40, "smoke": 200, "world": 240, "base_mfu": 180, "peer": 120}
INSTALL_S = 600
BERT_TINY_ID = "google/bert_uncased_L-2_H-128_A-2"  # realm_jax.config.BERT_TINY


class Skip(Exception):
    """A stage that cannot run here: recorded as skipped, with this reason."""


class StageError(RuntimeError):
    """A stage's command failed or ran out of time."""


# ----------------------------------------------------------------------- the stage runner


def run_stage(name: str, fn, budget: float, deadline: float, clock=time.monotonic) -> dict:
    """fn(seconds) -> its result dict, timed and recorded; never raises."""
    rec = {"name": name, "status": "done", "reason": "", "budget_s": budget, "seconds": 0.0}
    rec["result"] = {}
    left = deadline - clock()
    if left < 5:
        rec.update(status="skipped", reason="no time left within the overall limit")
        return rec
    t0 = clock()
    try:
        rec["result"] = fn(min(budget, left)) or {}
    except Skip as e:
        rec.update(status="skipped", reason=str(e))
    except Exception as e:  # noqa: BLE001 - a failed stage is recorded, the others go on
        line = (str(e).strip().splitlines() or [""])[-1][:500]
        rec.update(status="failed", reason=f"{type(e).__name__}: {line}")
    rec["seconds"] = round(clock() - t0, 1)
    return rec


def run_stages(stages: list, budgets: dict, deadline: float, clock=time.monotonic) -> list:
    """[(name, fn)] in order, each recorded by run_stage; prints one line a stage."""
    out = []
    for name, fn in stages:
        rec = run_stage(name, fn, budgets.get(name, 60), deadline, clock)
        print(f"[{name}] {rec['status']} in {rec['seconds']} s {rec['reason']}", flush=True)
        out.append(rec)
    return out


def sh(cmd: list[str], timeout: float, log: str, env: dict | None = None) -> str:
    """cmd from the repo root in its own process group (killed whole on timeout), its output
    appended to `log`; returns that output. StageError on a timeout or a non-zero exit."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        start = f.tell()
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise StageError(f"timed out after {timeout:.0f} s (log {log})") from None
    with open(log) as f:
        f.seek(start)
        text = f.read()
    if rc != 0:
        last = (text.strip().splitlines() or [""])[-1][:300]
        what = f"realm-jax {cmd[3]}" if cmd[1] == "-m" else os.path.basename(cmd[1])
        raise StageError(f"{what} exit {rc}: {last} (log {log})")
    return text


def realm(*args) -> list[str]:
    return [sys.executable, "-m", "realm_jax", *args]


def left(t0: float, budget: float) -> float:
    return budget - (time.monotonic() - t0)


# ----------------------------------------------------------------------- 0. environment

PROBE = """import json, sys, jax
from realm_jax.train import instruments
d = jax.devices()
peak = instruments.peak_flops(d[0]) if d[0].platform != "cpu" else None
print("PROBE " + json.dumps(dict(jax=jax.__version__, platform=d[0].platform,
    kind=d[0].device_kind, count=len(d), python=sys.version.split()[0], peak_flops=peak)))
"""


def probe(timeout: float, log: str) -> dict:
    """What JAX sees, from a fresh interpreter (so a just-installed plugin counts)."""
    text = sh([sys.executable, "-c", PROBE], timeout, log)
    line = [x for x in text.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE ") :])


def accelerator_hardware() -> str:
    """ "gpu" (an NVIDIA driver), "tpu" (TPU device files or a TPU VM's env) or ""."""
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        return "gpu"
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):  # v2-v4; v5e and later
        return "tpu"
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_NAME"):
        return "tpu"
    return ""


def extra_requirements(extra: str) -> list[str]:
    """pyproject.toml's [project.optional-dependencies] `extra` (the pinned jax)."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"][extra]


def unreachable_index() -> str:
    """ "" when pip's index (PIP_INDEX_URL, else PyPI) answers on port 443, else its host."""
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    host = url.split("://", 1)[-1].split("/", 1)[0].split("@")[-1].split(":")[0]
    try:
        socket.create_connection((host, 443), timeout=3.0).close()
        return ""
    except OSError:
        return host


def stage_environment(ctx, budget: float) -> dict:
    """JAX version, devices, platform; with --install, the extra when JAX sees no accelerator."""
    t0, log = time.monotonic(), ctx["log"]("environment")
    info = probe(min(40, budget), log)
    hw = accelerator_hardware()
    info["hardware"] = hw or "none found"
    if info["platform"] == "cpu" and hw:
        extra = "cuda" if hw == "gpu" else "tpu"
        if not ctx["args"].install:
            info["note"] = f"JAX sees no {hw}: rerun with --install (the [{extra}] extra)"
        elif host := unreachable_index():
            info["install"] = f"skipped: pip cannot reach {host} (offline)"
        else:
            reqs = extra_requirements(extra)
            pip = [sys.executable, "-m", "pip", "install", "--quiet", *reqs]
            sh(pip, left(t0, budget) - 15, log)
            info = dict(probe(min(40, left(t0, budget)), log), hardware=hw)
            info["install"] = " ".join(reqs)
    ctx["env"] = info
    return info


# ----------------------------------------------------------------------- 1. smoke


def platform(ctx) -> str:
    """The JAX platform (cpu, gpu, tpu): the environment stage's, else probed now."""
    if "env" not in ctx:
        try:
            ctx["env"] = probe(60, ctx["log"]("environment"))
        except StageError:
            ctx["env"] = {}
    return ctx["env"].get("platform", "cpu")


def run_metrics(workdir: str, eval_keys=("accuracy",)) -> dict:
    """The figures of a run's metrics.json: speed, MFU, goodput, held-out metrics."""
    with open(os.path.join(workdir, "metrics.json")) as f:
        m = json.load(f)
    inst = m.get("instruments", {})
    out = {k: m.get(k) for k in ("step", "complete", "mfu", "goodput")}
    speed = ("step_time", "examples_per_sec", "tflops_per_device", "compile_seconds")
    out.update({k: inst.get(k) for k in (*speed, "peak_memory_gib")})
    out["steps_per_s"] = 1.0 / inst["step_time"] if inst.get("step_time") else None
    out["eval"] = {k: m.get("eval", {}).get(k) for k in eval_keys}
    return out


def child_env(**extra) -> dict:
    """This environment, the hub offline (weights come from folders or the cache)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", **extra)


def stage_smoke(ctx, budget: float) -> dict:
    """`prepare` + `local` on the bundled sample (configs/realm.py:smoke) in a temp workdir."""
    t0, log, quick = time.monotonic(), ctx["log"]("smoke"), ctx["args"].quick
    wd, cfg = os.path.join(ctx["tmp"], "smoke"), "configs/realm.py:smoke"
    sh(realm("prepare", "--config", cfg, "--workdir", wd), left(t0, budget), log, child_env())
    over = ["--config.train.steps=6", "--config.train.eval_examples=16"] if quick else []
    plat, env, notes = platform(ctx), child_env(), []
    if plat == "cpu":
        over.append("--cpu_devices=2")
    elif plat == "gpu":  # trainer and refresher share the GPU: no preallocation
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        notes.append("XLA_PYTHON_CLIENT_PREALLOCATE=false (trainer and refresher share it)")
    else:  # one process owns a TPU: the refresh in the trainer's process
        over.append("--config.refresh.mode=inprocess")
        notes.append("refresh.mode=inprocess (a second process cannot open the TPU)")
    t1 = time.monotonic()
    sh(realm("local", "--config", cfg, "--workdir", wd, *over), left(t0, budget), log, env)
    out = {"wall_s": round(time.monotonic() - t1, 1), "overrides": over, "notes": notes}
    out.update(run_metrics(wd))
    return out


# ----------------------------------------------------------------------- 2. world REALM stage


def find_bert(given: str = "") -> tuple[str, str]:
    """(bert-tiny folder or hub id, where from), or ("", why not) for random weights."""
    if given:
        return given, "--bert"
    shared = os.path.join(os.path.dirname(REPO), "shared", "models", "bert-tiny-mlm")
    if os.path.exists(os.path.join(shared, "config.json")):
        return shared, "../shared/models/bert-tiny-mlm"
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    if os.path.isdir(os.path.join(hub, "models--" + BERT_TINY_ID.replace("/", "--"))):
        return BERT_TINY_ID, "the HuggingFace cache"
    return "", "bert-tiny not found (no --bert, ../shared, HF cache; offline): random weights"


def world_overrides(quick: bool, steps: int) -> list[str]:
    """The REALM stage's run length: the recipe's curriculum, or a tiny one with --quick."""
    if not quick:
        return [f"--config.train.steps={steps}"]
    tiny = "steps=6 own_block_steps=2 embedders_frozen_steps=4 embedders_warmup_steps=1 "
    tiny += "warmup_steps=2 eval_every=6 eval_examples=16 eval_batch_size=16 log_every=2 "
    tiny += "checkpoint_every=6"
    return [f"--config.train.{x}" for x in tiny.split()]


def stage_world(ctx, budget: float) -> dict:
    """A generated world, `prepare`, then the tutorial's REALM run (configs/realm.py:world)
    for a few hundred steps, from bert-tiny without the ICT warm start."""
    t0, log, a = time.monotonic(), ctx["log"]("world"), ctx["args"]
    root, cfg, env = os.path.join(ctx["tmp"], "world"), "configs/realm.py:world", child_env()
    w = os.path.join(root, "world")
    data = f"corpus={w}/corpus.jsonl sentences={w}/text data_dir={root}/data"
    paths = [f"--config.data.{x}" for x in data.split()]
    sh(realm("world", "--config", cfg, "--workdir", w), left(t0, budget), log, env)
    sh(realm("prepare", "--config", cfg, "--workdir", root, *paths), left(t0, budget), log, env)
    bert, source = find_bert(a.bert)
    init = [f"--config.model.init_embedder_from={bert}", f"--config.model.init_reader_from={bert}"]
    init.append("--config.model.init_embedders_from_ict=")  # no ICT stage: too long here
    over = world_overrides(a.quick, a.world_steps)
    t1 = time.monotonic()
    wd = os.path.join(root, "realm")
    train = realm("train", "--config", cfg, "--workdir", wd, *paths, *init, *over)
    sh(train, left(t0, budget), log, env)
    out = {"wall_s": round(time.monotonic() - t1, 1), "weights": source, "overrides": over}
    out["notes"] = ["no ICT warm start: the tutorial's ict stage is not run"]
    out.update(run_metrics(wd, ("title_recall@5", "accuracy")))
    return out


# ----------------------------------------------------------------------- 3. base step MFU


def is_oom(e: BaseException) -> bool:
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower()


def fit_batch(attempt, micro: int, floor: int = 8, oom=is_oom) -> tuple[dict, list]:
    """attempt(micro) at the given micro-batch, halved on each OOM down to `floor`: (its
    result, [the micro-batches that ran out of memory, with the error's first line])."""
    tried = []
    while True:
        try:
            return attempt(micro), tried
        except Exception as e:
            if not oom(e) or micro // 2 < floor:
                raise
            tried.append({"micro_batch": micro, "error": str(e).strip().split("\n")[0][:200]})
        micro //= 2
        gc.collect()  # the failed attempt's arrays, freed with its traceback


def synthetic(config, rows: int, rng):
    """A random index (rows blocks) and one batch of masked queries at config's shapes."""
    import numpy as np

    d, b = config.data, config.train.batch_size
    tokens = rng.integers(1000, 30000, (rows, d.block_len)).astype(np.int32)
    tokens[:, 0], tokens[:, 8], tokens[:, -1] = 101, 102, 102
    emb = rng.normal(size=(rows, config.model.proj_size)).astype(np.float32)
    q = rng.integers(1000, 30000, (b, d.query_len)).astype(np.int32)
    q[:, 0], q[:, -1] = 101, 102
    pos = np.tile(np.arange(1, d.max_predictions + 1, dtype=np.int32), (b, 1))
    tgt = np.take_along_axis(q, pos, 1)
    q[:, 1 : d.max_predictions + 1] = 103
    ones, none = np.ones(tgt.shape, np.float32), np.full((b,), -1, np.int32)
    batch = dict(query_ids=q, mlm_positions=pos, mlm_targets=tgt, mlm_weights=ones, block_id=none)
    return emb, tokens, batch


def base_attempt(spec: str, batch: int, micro: int, rows: int, steps: int) -> dict:
    """The REALM step of `spec` in bfloat16 at global `batch` (grad_accum = batch / micro),
    compiled, then `steps` timed: step time, examples/s, TFLOP/s per device, MFU."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.flops import realm_step_flops
    from realm_jax import sharding
    from realm_jax.config import load_config
    from realm_jax.index import embedding
    from realm_jax.pretrain import step as pretrain_step
    from realm_jax.train import instruments

    over = f"train.batch_size={batch} train.grad_accum={batch // micro} model.dtype=bfloat16"

    config = load_config(os.path.join(REPO, spec), over.split())
    mesh = sharding.make_mesh(config.mesh)
    model, opt, state, shard = pretrain_step.create_state(config, mesh, jax.random.key(0))
    emb, tokens, local = synthetic(config, rows, np.random.default_rng(0))
    e, t = embedding.pad_index(emb, tokens, mesh)
    e, t = sharding.put_rows(e, mesh), sharding.put_rows(t, mesh)
    gb = sharding.global_batch(local, mesh)
    fn = pretrain_step.compile_train_step(config, mesh, model, opt, shard, rows)
    meter = instruments.Meter(batch, start=0)
    t0 = time.perf_counter()
    state, m = meter.call_step(lambda s, b: fn(s, b, e, t, jnp.int32(0)), state, gb, local)
    jax.block_until_ready(m)
    out = {"compile_and_first_s": time.perf_counter() - t0, "times": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = fn(state, gb, e, t, jnp.int32(0))
        jax.block_until_ready(m)
        out["times"].append(time.perf_counter() - t0)
    step_time = sorted(out["times"])[len(out["times"]) // 2]
    # one device's FLOPs a step: counted from the config (benchmarks/flops.py), and XLA's cost
    # analysis as the loop's instruments read it (a lax.scan's body once: model.remat's layers)
    flops = realm_step_flops(config, rows)["total"] / jax.device_count()
    peak, xla = meter.peak, meter.flops
    out.update(batch=batch, micro_batch=micro, grad_accum=batch // micro, index_rows=rows)
    out.update(step_time=step_time, examples_per_sec=batch / step_time, flops=flops, peak=peak)
    out.update(
        tflops_per_device=flops / step_time / 1e12, mfu=instruments.mfu(flops, step_time, peak)
    )
    out.update(flops_cost_analysis=xla, mfu_cost_analysis=instruments.mfu(xla, step_time, peak))
    out.update(loss=float(m["loss"]), device_kind=jax.devices()[0].device_kind)
    return out


def base_child(a) -> None:
    """--base-child: the base stage in its own process; prints `RESULT {json}`."""
    from realm_jax.config import load_config

    batch = a.base_batch or int(load_config(os.path.join(REPO, a.base_config)).train.batch_size)
    res, tried = fit_batch(
        lambda micro: base_attempt(a.base_config, batch, micro, a.base_rows, a.base_steps), batch
    )
    res["out_of_memory"] = tried
    print("RESULT " + json.dumps(res, default=float), flush=True)


def stage_base_mfu(ctx, budget: float) -> dict:
    """The base step's bf16 MFU (--quick: the smoke model) in a child process."""
    a, log = ctx["args"], ctx["log"]("base_mfu")
    spec = "configs/realm.py:smoke" if a.quick else "configs/realm.py:base"
    rows = min(a.base_rows, 4096) if a.quick else a.base_rows
    child = f"--base-child --base-config {spec} --base-rows {rows} --base-steps {a.base_steps}"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        *child.split(),
        f"--base-batch={a.base_batch}",
    ]
    env = child_env()
    if platform(ctx) == "gpu":  # one process: let it use nearly all the memory
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.95"
    text = sh(cmd, budget, log, env)
    res = json.loads([x for x in text.splitlines() if x.startswith("RESULT ")][-1][7:])
    res["config"] = spec + " model.dtype=bfloat16"
    return res


# ----------------------------------------------------------------------- 4. peer benchmark

HAS_PEER = "import torch, transformers; print('PEER', torch.__version__, transformers.__version__)"


def peer_python(ctx) -> str:
    """The interpreter with torch and transformers: this one, or --peer-python; else Skip."""
    tried = []
    for py in dict.fromkeys([sys.executable, ctx["args"].peer_python]):
        if not py or not os.path.exists(py):
            tried.append(f"{py or '--peer-python'}: not there")
            continue
        p = subprocess.run([py, "-c", HAS_PEER], capture_output=True, text=True, timeout=120)
        if p.returncode == 0:
            return py
        tried.append(f"{py}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    raise Skip("torch + transformers import nowhere (" + "; ".join(tried) + ")")


def stage_peer(ctx, budget: float) -> dict:
    """benchmarks/peer_hf_realm.py, one round, no doc written: its table rows."""
    a, log = ctx["args"], ctx["log"]("peer")
    py = peer_python(ctx)
    size = ["--quick"] if a.quick else ["--rounds", "1", "--steps", "3", "--embed-reps", "2"]
    script = os.path.join(REPO, "benchmarks", "peer_hf_realm.py")
    cmd = [sys.executable, script, *size, "--remat-policies=", "--no-write", f"--peer-python={py}"]
    text = sh(cmd, budget, log, child_env())
    out = {"peer_python": py, "rows": [x for x in text.splitlines() if x.startswith("| ")][2:]}
    if platform(ctx) != "cpu":
        out["notes"] = ["HF's side on the CPU: peer_hf_side.py puts nothing on an accelerator"]
    return out


# ----------------------------------------------------------------------- results


def _fmt(v, spec=".3g") -> str:
    return "-" if v is None else f"{v:{spec}}"


def figures(rec: dict) -> str:
    """A stage's key figures, one cell."""
    r = rec.get("result", {})
    if rec["name"] == "environment":
        return f"JAX {r.get('jax', '?')}, {r.get('count', '?')} x {r.get('kind', '?')}"
    if rec["name"] == "peer":
        rates = [x.split("|") for x in r.get("rows", []) if "examples/s" in x or "blocks/s" in x]
        return "; ".join(f"{c[1].strip()} {c[4].strip()}" for c in rates)
    parts = [f"step {_fmt(r.get('step_time'))} s", f"{_fmt(r.get('examples_per_sec'))} ex/s"]
    parts += [f"MFU {_fmt(r.get('mfu'))}"]
    if "batch" in r:
        parts += [f"batch {r['batch']} (micro {r['micro_batch']})"]
        parts += [f"{_fmt(r.get('tflops_per_device'))} TFLOP/s"]
        parts += [f"MFU by XLA's cost analysis {_fmt(r.get('mfu_cost_analysis'))}"]
    if "goodput" in r:
        parts += [f"goodput {_fmt(r.get('goodput'))}"]
    parts += [f"{k} {_fmt(v)}" for k, v in r.get("eval", {}).items()]
    return ", ".join(parts) if r else ""


def summary_md(results: dict) -> str:
    """The short markdown summary: one row a stage."""
    rows = [
        f"| {s['name']} | {s['status']} | {s['seconds']} / {s['budget_s']} | "
        f"{figures(s)} | {s['reason']} |"
        for s in results["stages"]
    ]
    head = (
        f"# Device check\n\n{results['started']}, commit {results['commit']}, "
        f"{results['device']}; {results['wall_s']} s in all{' (--quick)' * results['quick']}.\n"
    )
    table = "| stage | status | s / budget | figures | reason |\n|---|---|---|---|---|"
    return "\n".join([head, table, *rows]) + "\n"


def write_results(results: dict, out: str) -> tuple[str, str]:
    os.makedirs(out, exist_ok=True)
    paths = os.path.join(out, "results.json"), os.path.join(out, "summary.md")
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(paths[1], "w") as f:
        f.write(summary_md(results))
    return paths


def commit() -> str:
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        return subprocess.check_output(git, cwd=REPO, text=True, timeout=10).strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "device-check"))
    p.add_argument("--install", action="store_true", help="pip-install the jax extra if needed")
    p.add_argument("--quick", action="store_true", help="tiny budgets and runs (a CPU check)")
    p.add_argument("--only", default=",".join(STAGES), help="comma list of stages to run")
    p.add_argument("--bert", default="", help="a bert-tiny folder for the world stage")
    p.add_argument("--world-steps", type=int, default=300, help="the world stage's REALM steps")
    p.add_argument("--base-rows", type=int, default=100_000, help="the base stage's index rows")
    p.add_argument("--base-steps", type=int, default=3, help="timed base steps after compile")
    p.add_argument("--base-batch", type=int, default=0, help="global batch; 0 = the config's")
    p.add_argument("--base-config", default="configs/realm.py:base", help=argparse.SUPPRESS)
    p.add_argument("--base-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-python", default=os.path.join(REPO, ".venv-peer", "bin", "python"))
    p.add_argument("--keep", action="store_true", help="keep the temp workdirs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.base_child:
        base_child(a)
        return 0
    start, t0 = datetime.datetime.now(datetime.UTC), time.monotonic()
    tmp = tempfile.mkdtemp(prefix="device_check_")
    ctx = {"args": a, "tmp": tmp, "log": lambda s: os.path.join(a.out, "logs", f"{s}.log")}
    chosen = [s for s in STAGES if s in a.only.split(",")]
    stages = [(s, lambda budget, s=s: globals()[f"stage_{s}"](ctx, budget)) for s in chosen]
    budgets = QUICK_BUDGETS if a.quick else BUDGETS
    if a.install:
        budgets = dict(budgets, environment=budgets["environment"] + INSTALL_S)
    first = stages[:1] if chosen[:1] == ["environment"] else []
    records = run_stages(first, budgets, time.monotonic() + budgets["environment"])
    rest = sum(budgets[s] for s in chosen if s != "environment")  # counted after an install
    records += run_stages(stages[len(first) :], budgets, time.monotonic() + rest)
    env = ctx.get("env", {})
    results = {
        "schema": SCHEMA,
        "started": start.strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(time.monotonic() - t0, 1),
        "commit": commit(),
        "quick": a.quick,
        "device": f"{env.get('count', '?')} x {env.get('kind', '?')}",
        "command": " ".join(sys.argv),
        "stages": records,
    }
    json_path, md_path = write_results(results, a.out)
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(open(md_path).read())
    print(f"results: {json_path}, {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
