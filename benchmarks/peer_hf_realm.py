"""Peer benchmark: realm-jax against HuggingFace transformers' REALM (PyTorch), same run.

    make peer-bench    # builds .venv-peer (torch CPU + transformers), then runs this
    .venv/bin/python benchmarks/peer_hf_realm.py [--rounds 3] [--steps 3] [--batch 8] [--quick]

Both sides at one configuration (4 layers x 256, 4 heads, intermediate 1024, vocab 30522,
8 candidates, query 64, block 192, batch 8, dropout 0.1) and one thread count, each
measurement in its own subprocess (peak RSS per side), the sides interleaved round by round
(jax, hf, jax, hf, ...) on identical synthetic inputs written here. realm-jax runs in this
venv (`--side jax`, this file); HF runs benchmarks/peer_hf_side.py in `.venv-peer`, which has no
JAX. Writes the "Peer benchmark: HuggingFace REALM" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402

# peer_hf_side imports no torch at module level
from benchmarks.peer_hf_side import peak_rss_gb, pin_threads, timed  # noqa: E402

SECTION = "Peer benchmark: HuggingFace REALM"
# The architecture both sides build: every network (query embedder, document embedder,
# reader) is a BERT of this size.
ARCH = dict(
    vocab_size=30522,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    intermediate_size=1024,
    proj_size=128,
    dropout=0.1,
)
QUERY_LEN, BLOCK_LEN, HF_JOINT_LEN = 64, 192, 256
NUM_CANDIDATES, MAX_PREDICTIONS = 8, 10
NUM_BLOCKS = 4096  # realm-jax's device index (random embeddings); HF draws its candidates here
EMBED_LEN, EMBED_BATCH, EMBED_BLOCKS = 288, 64, 256
CLS, SEP, MASK = 101, 102, 103
HF_SIDE = os.path.join(BENCH, "peer_hf_side.py")
# realm_jax/model/bert.py's REMAT_POLICIES, in report order; named here, not imported, so that
# a side pins its threads before anything imports JAX.
REMAT_POLICIES = ("nothing", "dots")


# ----------------------------------------------------------------------- inputs


def write_inputs(path: str, batch: int, seed: int = 0) -> None:
    """The synthetic inputs both sides read (.npz): a block table, queries with their first
    MAX_PREDICTIONS wordpieces masked, HF's given candidates, and blocks to embed."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def blocks(n: int, length: int):  # [CLS] title [SEP] body [SEP], no padding
        t = rng.integers(1000, 30000, (n, length)).astype(np.int32)
        t[:, 0], t[:, 8], t[:, -1] = CLS, SEP, SEP
        return t

    q = np.zeros((batch, QUERY_LEN), np.int32)
    q[:, 0], q[:, -1] = CLS, SEP
    q[:, 1:-1] = rng.integers(1000, 30000, (batch, QUERY_LEN - 2))
    pos = np.tile(np.arange(1, MAX_PREDICTIONS + 1, dtype=np.int32), (batch, 1))
    targets = np.take_along_axis(q, pos, 1)
    q[:, 1 : MAX_PREDICTIONS + 1] = MASK
    arch = dict(
        ARCH,
        num_candidates=NUM_CANDIDATES,
        joint_len=HF_JOINT_LEN,
        embed_batch=EMBED_BATCH,
    )
    np.savez(
        path,
        arch=json.dumps(arch),
        query_ids=q,
        mlm_positions=pos,
        mlm_targets=targets,
        blocks=blocks(NUM_BLOCKS, BLOCK_LEN),
        index_emb=rng.normal(size=(NUM_BLOCKS, ARCH["proj_size"])).astype(np.float32),
        hf_candidates=np.stack(
            [rng.choice(NUM_BLOCKS, NUM_CANDIDATES, replace=False) for _ in range(batch)]
        ),
        embed_blocks=blocks(EMBED_BLOCKS, EMBED_LEN),
    )


# ----------------------------------------------------------------------- the realm-jax side


def jax_config(block_len: int, batch: int, remat: str = ""):
    """configs/realm.py:small pinned to ARCH and the benchmark's lengths; remat: a
    model.remat_policy under which each network's layers are rematerialised in the backward
    pass (model.remat), or "" for none."""
    from realm_jax.config import load_config

    over = [
        f"train.batch_size={batch}",
        f"train.num_candidates={NUM_CANDIDATES}",
        f"data.query_len={QUERY_LEN}",
        f"data.block_len={block_len}",
        f"data.max_predictions={MAX_PREDICTIONS}",
        f"model.vocab_size={ARCH['vocab_size']}",
        f"model.proj_size={ARCH['proj_size']}",
        f"model.proj_dropout={ARCH['dropout']}",
        "model.share_embedders=False",
        "model.dtype=float32",
        f"model.remat={bool(remat)}",
        f"model.remat_policy={remat or 'nothing'}",
    ]
    for net in ("embedder", "reader"):
        for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "dropout"):
            over.append(f"model.{net}.{key}={ARCH[key]}")
    return load_config(os.path.join(REPO, "configs/realm.py:small"), over)


def jax_train(data: dict, reps: int, remat: str = "") -> dict:
    """realm-jax's jitted REALM step (realm_jax/pretrain/step.py): embed queries, exact MIPS
    over the device index, re-embed the hits and the null document, read, fused marginal
    MLM loss, backward, clipped AdamW; timed reps times after compile + first step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from realm_jax import sharding
    from realm_jax.index import embedding
    from realm_jax.pretrain import step as pretrain_step

    batch_size = data["query_ids"].shape[0]
    config = jax_config(BLOCK_LEN, batch_size, remat)
    mesh = sharding.make_mesh(config.mesh)
    model, opt, state, shard = pretrain_step.create_state(config, mesh, jax.random.key(0))
    emb, tokens = embedding.pad_index(data["index_emb"], data["blocks"], mesh)
    emb, tokens = sharding.put_rows(emb, mesh), sharding.put_rows(tokens, mesh)
    batch = dict(
        query_ids=data["query_ids"],
        mlm_positions=data["mlm_positions"],
        mlm_targets=data["mlm_targets"],
        mlm_weights=np.ones(data["mlm_targets"].shape, np.float32),
        block_id=np.full((batch_size,), -1, np.int32),
    )
    gb = sharding.global_batch(batch, mesh)
    fn = pretrain_step.compile_train_step(config, mesh, model, opt, shard, NUM_BLOCKS)
    carry = {"state": state}

    def step() -> float:
        carry["state"], m = fn(carry["state"], gb, emb, tokens, jnp.int32(0))
        return float(jax.block_until_ready(m)["loss"])

    t = timed(step, reps)
    return {"warmup_s": t["warmup_s"], "times": t["times"], "first_loss": t["first"]}


def jax_embed(data: dict, reps: int) -> dict:
    """The refresher's document embedding (embedding.embed_blocks_fn, EMBED_BATCH blocks per
    call of its scan), inference; timed reps times after compile + first pass."""
    import jax
    from flax import linen as nn

    from realm_jax import sharding
    from realm_jax.index import embedding
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name
    from realm_jax.pretrain import step as pretrain_step

    config = jax_config(EMBED_LEN, EMBED_BATCH)
    mesh = sharding.make_mesh(config.mesh)
    model, _, init_params = pretrain_step.state_parts(config)
    # Only the document embedder's params, as the refresher restores them (XLA drops the
    # other networks' initialisation), so the peak RSS is of what embedding needs.
    name = doc_embedder_name(ModelConfig.from_config(config.model, "embedder"))
    init = jax.jit(lambda r: nn.meta.unbox(init_params(r))[name])
    params = {name: init(jax.random.key(0))}
    _, tokens = embedding.pad_index(None, data["embed_blocks"], mesh)
    tokens = sharding.put_rows(tokens, mesh)
    fn = embedding.embed_blocks_fn(model, mesh, EMBED_BATCH)
    t = timed(lambda: jax.block_until_ready(fn(params, tokens)), reps)
    return {"warmup_s": t["warmup_s"], "times": t["times"]}


def jax_side(task: str, inputs: str, threads: int, reps: int, remat: str = "") -> None:
    """One realm-jax measurement in this process; prints `RESULT {json}`."""
    pin_threads(threads)
    import flax
    import jax
    import numpy as np

    data = {k: v for k, v in np.load(inputs).items() if k != "arch"}
    out = jax_train(data, reps, remat) if task == "train" else jax_embed(data, reps)
    out.update(
        peak_rss_gb=peak_rss_gb(),
        threads=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        versions={"jax": jax.__version__, "flax": flax.__version__},
    )
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------- the driver


def run_side(python: str, script: str, side_args: list[str], log) -> dict:
    """Run one side's measurement in a fresh process; its parsed RESULT line."""
    cmd = [python, script, *side_args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    log.flush()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{' '.join(cmd)} printed no RESULT line:\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def spread(values: list[float]) -> dict:
    """Median and range of per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: dict, batch: int, embed_blocks: int) -> dict:
    """runs[(side, task)] = the per-round RESULT dicts -> per side and task: throughput (per
    round, the median timed call), peak RSS, warm-up; and the ratios realm-jax / HF for speed,
    HF / realm-jax for memory, both of the medians and of each round's pair."""
    per = {"train": batch, "embed": embed_blocks}  # examples or blocks per timed call
    out: dict = {}
    for (side, task), results in runs.items():
        rate = [per[task] / statistics.median(r["times"]) for r in results]
        out[(side, task)] = {
            "rate": spread(rate),
            "rates": rate,
            "rss": spread([r["peak_rss_gb"] for r in results]),
            "rsss": [r["peak_rss_gb"] for r in results],
            "warmup": spread([r["warmup_s"] for r in results]),
        }
    jax_sides = sorted({side for side, _ in out if side.startswith("jax")})
    for side, task in [(s, t) for s in jax_sides for t in per]:
        j, h = out.get((side, task)), out.get(("hf", task))
        if j is None or h is None:
            continue
        out[("ratio" + side.removeprefix("jax"), task)] = {
            "speed": j["rate"]["median"] / h["rate"]["median"],
            "speed_pairs": spread([a / b for a, b in zip(j["rates"], h["rates"])]),
            "memory": h["rss"]["median"] / j["rss"]["median"],
            "memory_pairs": spread([b / a for a, b in zip(j["rsss"], h["rsss"])]),
        }
    return out


def _cell(s: dict, fmt: str) -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def _ratio(of_medians: float, pairs: dict) -> str:
    return f"{of_medians:.2f}x (rounds {pairs['min']:.2f}-{pairs['max']:.2f})"


def report_body(summary: dict, meta: dict) -> str:
    """The docs/benchmarks.md section: setup, the table, what each side computes."""
    rows = []
    for task, unit in (("train", "examples/s"), ("embed", "blocks/s")):
        j, h, r = (summary.get((s, task)) for s in ("jax", "hf", "ratio"))
        if j is None or h is None:
            continue
        name = "training step" if task == "train" else "document embedding"
        rows += [
            f"| {name}: {unit} | {_cell(j['rate'], '.2f')} | {_cell(h['rate'], '.2f')} | "
            f"{_ratio(r['speed'], r['speed_pairs'])} |",
            f"| {name}: peak RSS GB | {_cell(j['rss'], '.2f')} | {_cell(h['rss'], '.2f')} | "
            f"{_ratio(r['memory'], r['memory_pairs'])} |",
            f"| {name}: compile + first call s (realm-jax) / first call s (HF) | "
            f"{_cell(j['warmup'], '.1f')} | {_cell(h['warmup'], '.1f')} | |",
        ]
        for policy in REMAT_POLICIES:
            jr = summary.get((f"jax-remat-{policy}", task))
            rr = summary.get((f"ratio-remat-{policy}", task))
            if jr is None or rr is None:
                continue
            what = f"{name} with model.remat ({policy})"
            rows += [
                f"| {what}: {unit} | {_cell(jr['rate'], '.2f')} | "
                f"{_cell(h['rate'], '.2f')} | {_ratio(rr['speed'], rr['speed_pairs'])} |",
                f"| {what}: peak RSS GB | {_cell(jr['rss'], '.2f')} | "
                f"{_cell(h['rss'], '.2f')} | {_ratio(rr['memory'], rr['memory_pairs'])} |",
            ]
    v = meta["versions"]
    logits_gb = meta["batch"] * NUM_CANDIDATES * HF_JOINT_LEN * ARCH["vocab_size"] * 4 / 1e9
    return f"""`{meta["command"]}` ({meta["rounds"]} rounds; each round runs every measurement \
once per side in a fresh process, in the order realm-jax train, HF train, realm-jax embed, HF \
embed; {meta["steps"]} timed steps and {meta["embed_reps"]} timed embedding passes per \
process, after a warm-up call that is reported apart). Both sides pinned to the same \
{meta["threads"]} core(s) (`sched_setaffinity`; `torch.set_num_threads({meta["threads"]})`; \
XLA's CPU client sizes its pool from the cores it may use); the machine's 1-minute load \
average {meta["load"][0]:.1f} at the start and {meta["load"][1]:.1f} at the end (other jobs \
share it when above 0). Versions: realm-jax side JAX \
{v["jax"]}, Flax {v["flax"]}; HF side torch {v["torch"]}, transformers {v["transformers"]} \
(`transformers.models.deprecated.realm`, random weights from a `RealmConfig`).

Configuration, both sides: every network (query embedder, document embedder, reader) \
{ARCH["num_layers"]} layers x {ARCH["hidden_size"]}, {ARCH["num_heads"]} heads, intermediate \
{ARCH["intermediate_size"]}, vocab {ARCH["vocab_size"]}, projection {ARCH["proj_size"]}, \
dropout {ARCH["dropout"]} (training), gelu_new; batch {meta["batch"]}, {NUM_CANDIDATES} \
candidates, query {QUERY_LEN} tokens with {MAX_PREDICTIONS} masked, blocks {BLOCK_LEN} \
tokens, AdamW (lr 1e-4, weight decay 0.01 off LayerNorm and biases, eps 1e-6) after \
global-norm clipping at 1.0. Embedding: {EMBED_BLOCKS} blocks of {EMBED_LEN} tokens per \
timed pass, batch {EMBED_BATCH}, inference. Identical synthetic token ids on both sides.

The rows "with model.remat" are further sides, run in each round after HF's training step: \
realm-jax's same step with every network's layers rematerialised (one `lax.scan` per network \
under `jax.checkpoint`), trading recomputation for activation memory, under the \
`model.remat_policy` named: `nothing` keeps only each layer's input and recomputes the whole \
layer in the backward pass; `dots` also keeps the outputs of its weight matmuls and recomputes \
only attention, activations and LayerNorms. The other realm-jax rows run without remat (the \
`small` config's default).

Each cell: the median over rounds (range); a round's throughput is its process's median timed \
call. Ratios: realm-jax / HF for speed, HF / realm-jax for memory: one side's median against \
the other's, and in brackets the range of the ratios of each round's pair (measured minutes \
apart, so they share the machine's load of the moment).

| measure | realm-jax | HF transformers REALM | ratio |
|---|---|---|---|
{chr(10).join(rows)}

What one training step computes:

- realm-jax (`realm_jax/pretrain/step.py`, one jitted program): embeds the {meta["batch"]} \
queries; retrieves the top {NUM_CANDIDATES - 1} blocks by exact MIPS over a \
{NUM_BLOCKS}-block device index (random embeddings) and gathers their tokens on device; \
re-embeds those {NUM_CANDIDATES - 1} blocks ({BLOCK_LEN} tokens) and the null document \
(`[CLS] [SEP] [SEP]`, 3 tokens) with the live document embedder; reads the \
{NUM_CANDIDATES - 1} (query + block) joint inputs of {QUERY_LEN + BLOCK_LEN - 1} tokens and \
the null document's {QUERY_LEN + 1}; takes the reader's features at the {MAX_PREDICTIONS} \
masked positions only and computes the marginal MLM loss with a fused, vocabulary-chunked \
softmax (no [B, K, P, vocab] logits stored); backward, clipping, AdamW.
- HF (`RealmScorer` with a separate query `RealmEmbedder`, then \
`RealmKnowledgeAugEncoder` with `relevance_score`, `labels` and `mlm_mask`): gets \
{NUM_CANDIDATES} candidate block ids given (no search); embeds the query and all \
{NUM_CANDIDATES} candidate blocks at {BLOCK_LEN} tokens; reads {NUM_CANDIDATES} joint inputs \
of {HF_JOINT_LEN} tokens ([CLS] query [SEP] block without its [CLS], one pad); computes \
vocabulary logits at every joint position ([B x K x {HF_JOINT_LEN} x {ARCH["vocab_size"]}], \
as the model does) and the marginal log-likelihood over candidates at the masked positions \
(`mlm_mask`); backward, clipping, AdamW (`torch.optim.AdamW`).
- So the sides differ in: the search (realm-jax only); the null document (realm-jax reads \
a 3-token block in place of an eighth {BLOCK_LEN}-token one); joint length \
{QUERY_LEN + BLOCK_LEN - 1} against {HF_JOINT_LEN}; and the MLM head over {MAX_PREDICTIONS} \
positions against all {HF_JOINT_LEN} (HF's float32 logits alone are \
{logits_gb:.1f} GB at this batch, before their gradient). realm-jax's \
learning-rate schedule warms up from 0 at step 0, which changes no work.
- Embedding: realm-jax runs the refresher's `embedding.embed_blocks_fn` (a jitted scan over \
batches of {EMBED_BATCH}); HF runs `RealmEmbedder` under `torch.inference_mode()`, one call \
per batch of {EMBED_BATCH}. Both return the {ARCH["proj_size"]}-d projections.

Peak RSS is each measuring process's own `ru_maxrss` (the interpreter, the framework, the \
model, the optimizer state and the step's peak), read at its end. The embedding processes \
hold the document embedder alone on both sides."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--side", choices=("jax",), help=argparse.SUPPRESS)  # internal: one side
    ap.add_argument("--task", choices=("train", "embed"), help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--remat", default="", help=argparse.SUPPRESS)  # a remat policy
    ap.add_argument(
        "--remat-policies",
        default="nothing,dots",
        help="a realm-jax training side with model.remat per policy named (comma-separated; "
        "'' for none)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per process")
    ap.add_argument("--embed-reps", type=int, default=3, help="timed embedding passes")
    ap.add_argument("--batch", type=int, default=8, help="training batch (8: the issue's)")
    ap.add_argument("--threads", type=int, default=0, help="cores per side; 0 = all usable")
    ap.add_argument("--tasks", default="train,embed", help="comma-separated: train, embed")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="batch 2, 1 round, 2 steps, 1 embedding pass; prints, writes no doc section",
    )
    ap.add_argument("--no-write", action="store_true", help="print the section, write no doc")
    ap.add_argument(
        "--peer-python",
        default=os.path.join(REPO, ".venv-peer", "bin", "python"),
        help="the interpreter of the HF venv (make peer-bench builds .venv-peer)",
    )
    ap.add_argument("--log", default="", help="where both sides' output goes (default: temp)")
    args = ap.parse_args()
    if args.side == "jax":
        jax_side(args.task, args.inputs, args.threads, args.reps, args.remat)
        return
    if args.quick:
        args.batch, args.rounds, args.steps, args.embed_reps = 2, 1, 2, 1
    if not os.path.exists(args.peer_python):
        raise SystemExit(f"no {args.peer_python}: run `make peer-bench` (it builds .venv-peer)")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or usable
    tasks = args.tasks.split(",")
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable")) / 1e6
    print(f"memory available: {avail:.1f} GB; batch {args.batch}, {threads} thread(s)")
    tmp = tempfile.mkdtemp(prefix="peer_hf_realm_")
    inputs = os.path.join(tmp, "inputs.npz")
    write_inputs(inputs, args.batch)
    log_path = args.log or os.path.join(tmp, "sides.log")
    print(f"both sides' output: {log_path}")
    load_start = os.getloadavg()[0]
    runs: dict = {}
    sides = {
        "jax": (sys.executable, os.path.abspath(__file__), ["--side", "jax"]),
        "hf": (args.peer_python, HF_SIDE, []),
    }
    for policy in filter(None, args.remat_policies.split(",")):
        if policy not in REMAT_POLICIES:
            raise SystemExit(f"--remat-policies: {policy!r} is none of {', '.join(REMAT_POLICIES)}")
        extra = ["--side", "jax", "--remat", policy]
        sides[f"jax-remat-{policy}"] = (sys.executable, os.path.abspath(__file__), extra)
    with open(log_path, "a") as log:
        for r in range(args.rounds):
            for task in tasks:
                reps = args.steps if task == "train" else args.embed_reps
                for side, (python, script, extra) in sides.items():
                    if side.startswith("jax-remat") and task != "train":
                        continue  # inference keeps no activations: remat changes nothing
                    side_args = [*extra, "--task", task, "--inputs", inputs]
                    side_args += ["--threads", str(threads), "--reps", str(reps)]
                    t0 = time.perf_counter()
                    res = run_side(python, script, side_args, log)
                    runs.setdefault((side, task), []).append(res)
                    print(
                        f"round {r + 1}/{args.rounds} {side} {task}: timed "
                        f"{', '.join(f'{t:.2f}' for t in res['times'])} s, warm-up "
                        f"{res['warmup_s']:.1f} s, peak RSS {res['peak_rss_gb']:.2f} GB "
                        f"({time.perf_counter() - t0:.0f} s in all)",
                        flush=True,
                    )
    summary = summarise(runs, args.batch, EMBED_BLOCKS)
    versions = {}
    for results in runs.values():
        versions.update(results[0]["versions"])
    command = "python benchmarks/peer_hf_realm.py " + " ".join(sys.argv[1:])
    meta = dict(
        command=command.strip(),
        rounds=args.rounds,
        steps=args.steps,
        embed_reps=args.embed_reps,
        threads=threads,
        batch=args.batch,
        versions=versions,
        load=(load_start, os.getloadavg()[0]),
    )
    body = report_body(summary, meta)
    if args.quick or args.no_write:
        print(body)
    else:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
