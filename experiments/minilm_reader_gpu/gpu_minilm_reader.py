"""REALM with a stronger reader, on a GPU: all-MiniLM-L6-v2 (6 x 384, a new tied MLM head)
reads, the ICT-trained bert-tiny retriever retrieves, at the paper's batch of 512.

On the 2-core CPU this run would take about a day (benchmarks/flops.py: 11.9x the bert-tiny
step's FLOPs); the `device` tool's GPU runs it in minutes. That machine has no ../shared, no
readers for the prepared TFDS records and takes 64 MiB a call, so the work is in three parts:

  pack    (here) the run's inputs as compact numpy in --pack (default .dev/pack, relative to
          the folder it runs in: the repository root): the training batches exactly as
          `realm-jax train` reads them (pipeline.train_loader, the same seed as the CPU
          batch-512 run: batches 1-60 feed the reader-only steps), the held-out evaluation
          batches, the block table and titles, the ICT embedders (float32), and MiniLM's
          encoder as bfloat16 in --minilm_out (default .dev/minilm; a call's transfer of its
          own).
  run     (on the device) the product's own pieces over those inputs: train_step's state,
          weight merge and jitted step, IndexFeed's in-process refresh, RealmEvaluator's
          held-out metrics. `train.embedders_frozen_steps` first trains the reader alone
          (the new MLM head's adaptation, on the corpus's masked sentences), then REALM
          trains all three networks. Writes metrics.json and the final embedders to $OUT.
  unpack  (here) those embedders as a checkpoint workdir, which `realm-jax evaluate` reads
          with model.init_embedders_from_ict (zero-shot retrieval, docs/results.md).

    python experiments/minilm_reader_gpu/gpu_minilm_reader.py pack --data_dir DATA_DIR \
        --ict ICT_WORKDIR --minilm PATH/TO/all-MiniLM-L6-v2
    python experiments/minilm_reader_gpu/gpu_minilm_reader.py run --out $OUT   # on the device
    python experiments/minilm_reader_gpu/gpu_minilm_reader.py unpack --returned DIR \
        --workdir runs/exp/gpu-minilm

DATA_DIR is the prepared squad data (the recorded run: runs/squad-data), ICT_WORKDIR the ICT
stage of the ablation suite (runs/ablations/ict), both under the repository root; --pack and
--minilm_out (pack) and --pack and --minilm (run) default to .dev/pack and .dev/minilm, and
run's --workdir (the index versions) to /tmp/gpu-minilm-run.

On the device (2026-11-26): its image's JAX 0.11.2 with CUDA, and this project's pinned
flax, optax, orbax-checkpoint and ml_collections carried as wheels (.whl, installed with
`pip install --no-deps --target /root/site` and put first on PYTHONPATH). .dev/pack (43 MiB)
and .dev/minilm (44 MiB) do not fit one call's 64 MiB, so a first call carries the pack and
copies it out of the working tree (/root/stash), and a second call on the still-warm machine
carries MiniLM and runs; a call whose `carry` leaves out an ignored folder may find it gone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

PACK = ".dev/pack"  # default --pack: the inputs (ignored by git: .git/info/exclude)
MINILM = ".dev/minilm"  # default --minilm_out / run --minilm: MiniLM's encoder, bfloat16
WORD = "bert/embeddings/word_embeddings/embedding"  # the largest leaf: a file of its own
MAX_FILE = 16 * 2**20  # the device tool returns files up to 16 MiB

# The reader: all-MiniLM-L6-v2's architecture (its config.json).
MINILM_READER = [
    "model.reader.hidden_size=384",
    "model.reader.num_layers=6",
    "model.reader.num_heads=12",
    "model.reader.intermediate_size=1536",
    "model.reader.hidden_act=gelu",
    "model.reader.max_position_embeddings=512",
]


def overrides(warmup: int, steps: int) -> list[str]:
    """The CPU batch-512 run's settings (docs/results.md, 'REALM with 32 candidates, and with
    a batch of 64 or 512'), the MiniLM reader, and `warmup` reader-only steps before
    `steps` REALM steps. Weights come from the packed files, not from folders."""
    return [
        "train.batch_size=512",
        "train.grad_accum=8",
        f"train.steps={warmup + steps}",
        "train.warmup_steps=10",
        f"train.embedders_frozen_steps={warmup}",
        "refresh.every=25",
        "data.mask_mode=salient",
        "model.init_reader_from=",
        "model.init_embedder_from=",
        "model.init_embedders_from_ict=",
        *MINILM_READER,
    ]


def _config(warmup: int, steps: int, extra: list[str] = ()):
    from realm_jax.config import load_config

    return load_config("configs/realm.py:squad", [*overrides(warmup, steps), *extra])


def _flat(tree, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


def _tree(flat: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def _shrink(a: np.ndarray) -> np.ndarray:
    """The smallest unsigned integer type that holds `a` exactly (token ids, positions, 0/1
    weights), else `a` itself; checked by a round trip."""
    if a.size and np.all(a >= 0) and np.all(a == np.round(a)):
        for t in (np.uint8, np.uint16):
            if a.max() <= np.iinfo(t).max:
                small = a.astype(t)
                if np.array_equal(small.astype(a.dtype), a):
                    return small
    return a


def _save_batches(path: str, batches: list[dict]) -> None:
    keys = [k for k in batches[0] if k not in ("example_id", "title")]  # host-side only
    arrays, dtypes = {}, {}
    for k in keys:
        full = np.stack([np.asarray(b[k]) for b in batches])
        arrays[k], dtypes[k] = _shrink(full), str(full.dtype)
    np.savez_compressed(path, dtypes=json.dumps(dtypes), **arrays)


def _load_batches(path: str) -> list[dict]:
    z = np.load(path)
    dtypes = json.loads(str(z["dtypes"]))
    arrays = {k: z[k].astype(t) for k, t in dtypes.items()}
    n = len(next(iter(arrays.values())))
    return [{k: v[i] for k, v in arrays.items()} for i in range(n)]


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _from_bf16_bits(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def pack(args) -> None:
    from realm_jax.data import datasets, pipeline
    from realm_jax.interop import hf_import as weights
    from realm_jax.model.bert import ModelConfig
    from realm_jax.train.warm_start import ict_embedder_params

    config = _config(args.warmup, args.steps, [f"data.data_dir={args.data_dir}"])
    datasets.check_prepared(config, args.data_dir)
    os.makedirs(args.pack, exist_ok=True)
    os.makedirs(args.minilm_out, exist_ok=True)
    tc = config.train
    t0 = time.time()
    it = iter(
        pipeline.train_loader(
            config, args.data_dir, global_batch_size=tc.batch_size, seed=config.data.seed
        )
    )
    batches = [next(it) for _ in range(tc.steps)]
    _save_batches(f"{args.pack}/train.npz", batches)
    evals = pipeline.eval_batches(
        config, args.data_dir, batch_size=tc.eval_batch_size, max_examples=tc.eval_examples
    )
    _save_batches(f"{args.pack}/eval.npz", evals)
    print(f"batches: {len(batches)} train, {len(evals)} held-out ({time.time() - t0:.0f}s)")
    tokens, _, titles = datasets.load_blocks(args.data_dir)
    np.savez_compressed(
        f"{args.pack}/blocks.npz", tokens=_shrink(tokens), titles=json.dumps(titles)
    )
    ecfg = ModelConfig.from_config(config.model, "embedder")
    ict = ict_embedder_params(args.ict, ecfg)
    np.savez(
        f"{args.pack}/ict.npz",
        **{f"{n}/{k}": v for n, t in ict.items() for k, v in _flat(t).items()},
    )
    loaded, fields = weights.embedder_params(args.minilm)
    bert = _flat(loaded["bert"])
    np.savez(f"{args.minilm_out}/bert_bf16.npz", **{k: _bf16_bits(v) for k, v in bert.items()})
    with open(f"{args.minilm_out}/fields.json", "w") as f:
        json.dump({**fields, "source": os.path.abspath(args.minilm)}, f)
    with open(f"{args.pack}/args.json", "w") as f:
        json.dump(
            {
                "warmup": args.warmup,
                "steps": args.steps,
                "data_dir": args.data_dir,
                "ict": args.ict,
                "minilm": args.minilm,
            },
            f,
        )
    for d in (args.pack, args.minilm_out):
        for name in sorted(os.listdir(d)):
            print(f"{d}/{name}: {os.path.getsize(f'{d}/{name}') / 2**20:.1f} MiB")


def _minilm_reader(path: str) -> dict:
    """MiniLM's encoder as the reader's `bert` subtree (float32 from bfloat16): the MLM head
    (transform, LayerNorm, output bias; the decoder is tied to the word embeddings) stays at
    its fresh initialisation, since all-MiniLM-L6-v2 ships none."""
    z = np.load(f"{path}/bert_bf16.npz")
    with open(f"{path}/fields.json") as f:
        fields = json.load(f)
    if fields["hidden_size"] != 384 or fields["num_layers"] != 6:
        raise ValueError(f"{path}: not all-MiniLM-L6-v2's shape: {fields}")
    # BertModel's pooler is the embedders' ([CLS] -> tanh); the reader has none
    return _tree({k: _from_bf16_bits(z[k]) for k in z.files if not k.startswith("pooler/")})


def run(args) -> None:
    t_start = time.time()
    import jax
    import jax.numpy as jnp

    from realm_jax import sharding
    from realm_jax.index.feed import IndexFeed
    from realm_jax.interop import hf_import as weights
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name
    from realm_jax.pretrain import step as pretrain_step
    from realm_jax.pretrain.evaluation import RealmEvaluator

    with open(f"{args.pack}/args.json") as f:
        packed = json.load(f)
    warmup, steps = packed["warmup"], packed["steps"]
    extra = [f"train.grad_accum={args.grad_accum}"] + list(args.override)
    config = _config(warmup, steps, extra)
    if args.limit_steps:  # a CPU rehearsal: the same program, fewer and smaller steps
        config.unlock()
        config.train.steps = min(config.train.steps, args.limit_steps)
    tc = config.train
    out = args.out
    os.makedirs(out, exist_ok=True)
    logf = open(f"{out}/log.txt", "a")

    def say(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    dev = jax.devices()[0]
    say(f"jax {jax.__version__} on {jax.device_count()} x {dev.device_kind} ({dev.platform})")
    train_batches = _load_batches(f"{args.pack}/train.npz")
    eval_batches = _load_batches(f"{args.pack}/eval.npz")[: args.eval_batches or None]
    b = tc.batch_size  # a rehearsal's --override train.batch_size=16 reads part of each batch
    train_batches = [{k: v[:b] for k, v in t.items()} for t in train_batches]
    z = np.load(f"{args.pack}/blocks.npz")
    tokens, titles = z["tokens"].astype(np.int32), json.loads(str(z["titles"]))
    ict_flat = np.load(f"{args.pack}/ict.npz")
    ict: dict = {}
    for key in ict_flat.files:
        name, rest = key.split("/", 1)
        ict.setdefault(name, {})[rest] = ict_flat[key]
    ict = {n: _tree(v) for n, v in ict.items()}
    reader_bert = _minilm_reader(args.minilm)
    say(
        f"inputs: {len(train_batches)} batches of {len(train_batches[0]['query_ids'])}, "
        f"{len(eval_batches)} held-out batches, {len(tokens)} blocks"
    )
    ecfg = ModelConfig.from_config(config.model, "embedder")

    def hook(params):
        params = dict(params)
        for name in {"query_embedder", doc_embedder_name(ecfg)}:
            src = ict.get(name, ict["query_embedder"])
            params[name] = weights.merge_params(params[name], src, name)
        params["reader"] = weights.merge_params(params["reader"], {"bert": reader_bert}, "reader")
        return params

    mesh = sharding.make_mesh(config.mesh)
    model, optimizer, state, shardings = pretrain_step.create_state(
        config, mesh, jax.random.key(tc.seed), hook
    )
    workdir = args.workdir
    feed = IndexFeed(config, workdir, mesh, model, tokens)
    feed.start(state.params, 0)
    say(f"state created, index embedded ({feed.last_swap_seconds:.1f}s)")
    t0 = time.time()
    step_fn = pretrain_step.compile_train_step(
        config, mesh, model, optimizer, shardings, feed.num_blocks
    )
    evaluator = RealmEvaluator(config, mesh, model, feed, eval_batches, titles)
    history, evals, step_times, refreshes = [], {}, [], []

    def evaluate(step: int) -> None:
        e0 = time.time()
        evals[step] = {k: float(v) for k, v in evaluator(state, step).items()}
        m = evals[step]
        say(
            f"eval step {step} ({time.time() - e0:.1f}s): accuracy {m['accuracy']:.4f} "
            f"null-only {m['null_only_accuracy']:.4f} utility {m['retrieval_utility']:.4f} "
            f"same-title {m['same_title_fraction']:.4f} block-holds "
            f"{m.get('accuracy_block_holds', float('nan')):.4f} "
            f"copy_gain {m.get('copy_gain', float('nan')):.4f}"
        )

    evaluate(0)
    eval_at = {warmup, warmup + steps // 2, tc.steps}
    step = 0
    stopped = None
    while step < tc.steps:
        if step > 0 and feed.due(step) and feed.maybe_refresh(state.params, step):
            refreshes.append({"step": step, "seconds": feed.last_swap_seconds})
        batch = sharding.global_batch(dict(train_batches[step]), mesh)
        s0 = time.time()
        state, metrics = step_fn(state, batch, feed.emb, feed.tokens, jnp.int32(feed.step))
        last = {k: float(v) for k, v in sharding.to_host(metrics).items()}
        step += 1
        step_times.append(time.time() - s0)
        last["step"] = step
        history.append(last)
        if step == 1:
            say(f"step 1 (compiles): {step_times[0]:.1f}s (jit setup {s0 - t0:.1f}s)")
        if step % 10 == 0 or step == tc.steps:
            rest = float(np.median(step_times[1:])) if step > 1 else step_times[0]
            say(
                f"step {step}/{tc.steps}: loss {last['loss']:.3f} accuracy "
                f"{last['accuracy']:.3f} utility {last['retrieval_utility']:.3f} "
                f"{rest:.2f}s/step, ETA {rest * (tc.steps - step):.0f}s"
            )
        if step in eval_at:
            evaluate(step)
        if time.time() - t_start > args.budget_s and step < tc.steps:
            stopped = f"time budget {args.budget_s}s reached at step {step}"
            say(stopped)
            evaluate(step)
            break
    names = {"query_embedder", doc_embedder_name(ecfg)}
    host = {n: _flat(sharding.to_host(state.params[n])) for n in names}
    files = []
    for n, flat in host.items():
        np.save(f"{out}/{n}.word.npy", flat.pop(WORD).astype(np.float32))
        np.savez(f"{out}/{n}.rest.npz", **{k: v.astype(np.float32) for k, v in flat.items()})
        files += [f"{n}.word.npy", f"{n}.rest.npz"]
    for f in files:
        if os.path.getsize(f"{out}/{f}") > MAX_FILE:
            say(f"WARNING: {f} is over 16 MiB and will not come back")
    timings = {
        "compile_and_first_step_s": step_times[0] if step_times else None,
        "median_step_s": float(np.median(step_times[1:])) if len(step_times) > 1 else None,
        "refreshes": refreshes,
        "total_s": time.time() - t_start,
    }
    result = {
        "device": f"{jax.device_count()} x {dev.device_kind}",
        "jax": jax.__version__,
        "warmup_steps": warmup,
        "realm_steps": steps,
        "steps_done": step,
        "stopped": stopped,
        "config_overrides": overrides(warmup, steps) + extra,
        "timings": timings,
        "evals": evals,
        "history": history,
        "embedders": sorted(names),
    }
    with open(f"{out}/metrics.json", "w") as f:
        json.dump(result, f, indent=1)
    say(f"done: {step} steps, metrics.json and {len(files)} embedder files in {out}")


def unpack(args) -> None:
    """The returned embedders as a checkpoint workdir (its state holds the embedders' params
    only): `realm-jax evaluate --config.model.init_embedders_from_ict=<workdir>` reads it."""
    from realm_jax import checkpoint

    with open(f"{args.returned}/metrics.json") as f:
        result = json.load(f)
    params = {}
    for n in result["embedders"]:
        flat = dict(np.load(f"{args.returned}/{n}.rest.npz"))
        flat[WORD] = np.load(f"{args.returned}/{n}.word.npy")
        params[n] = _tree(flat)
    mgr = checkpoint.manager(args.workdir, with_data=False)
    if mgr.all_steps():
        raise SystemExit(f"{args.workdir} already has checkpoints {mgr.all_steps()}")
    checkpoint.save(mgr, int(result["steps_done"]), {"params": params})
    mgr.wait_until_finished()
    with open(os.path.join(args.workdir, "gpu_metrics.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.workdir}: checkpoint {result['steps_done']} with {sorted(params)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="write the run's inputs to --pack and --minilm_out (here)")
    a.add_argument("--data_dir", required=True, help="the prepared squad data")
    a.add_argument("--ict", required=True, help="the ICT workdir the embedders start from")
    a.add_argument("--minilm", required=True, help="all-MiniLM-L6-v2's HuggingFace folder")
    a.add_argument("--warmup", type=int, default=60, help="reader-only steps first")
    a.add_argument("--steps", type=int, default=100, help="REALM steps after them")
    a.add_argument("--pack", default=PACK, help="where the inputs go")
    a.add_argument("--minilm_out", default=MINILM, help="where the bfloat16 encoder goes")
    r = sub.add_parser("run", help="train on the packed inputs (on the device)")
    r.add_argument("--out", required=True, help="where metrics and embedders go")
    r.add_argument("--pack", default=PACK, help="pack's inputs")
    r.add_argument("--minilm", default=MINILM, help="the bfloat16 encoder's folder")
    r.add_argument("--workdir", default="/tmp/gpu-minilm-run", help="the index versions")
    r.add_argument("--grad_accum", type=int, default=8, help="micro-batches a step")
    r.add_argument("--budget_s", type=float, default=420, help="stop training after this")
    r.add_argument("--limit_steps", type=int, default=0, help="rehearsal: stop after N steps")
    r.add_argument("--eval_batches", type=int, default=0, help="rehearsal: held-out batches")
    r.add_argument("--override", action="append", default=[], help="extra a.b=value")
    u = sub.add_parser("unpack", help="returned embedders -> a checkpoint workdir (here)")
    u.add_argument("--returned", required=True, help="the folder the device's files are in")
    u.add_argument("--workdir", required=True, help="a new workdir")
    args = p.parse_args(argv)
    {"pack": pack, "run": run, "unpack": unpack}[args.cmd](args)


if __name__ == "__main__":
    main()
