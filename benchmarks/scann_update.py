"""ScaNN's native upsert/delete against a rebuild, by the share of rows changed: what
`update --scann_rebuild_share` (default update.SCANN_REBUILD_SHARE) trades. Part of the
"Updating a corpus (issue 61)" section of docs/benchmarks.md.

    python benchmarks/scann_update.py [--workdir runs/update_cost/qa] [--shares 1,5,10,25,50]

Real embeddings: a QA workdir's frozen index over SQuAD's paragraphs, by default the one
benchmarks/update_cost.py published (all-MiniLM-L6-v2's document embedder, unit vectors of 384
floats); any fine-tuning workdir on SQuAD's data serves (--workdir; the doc names its
embedder). Its rows are split by article: the base (the index a searcher is built on) and a
pool of other articles' rows, the documents an update adds, at least half the base's size.
Queries: --queries SQuAD questions (sampled with --seed) embedded with the same warm start's
query embedder.

For each share s of the base's rows and each way new vectors come:
  new    s of the base's rows deleted and as many rows of the pool's articles upserted (new
         documents on new topics: vectors the searcher's partitions and codebooks never saw);
  edit   s of the rows deleted and each upserted again as its vector moved: v + 0.3 |v| d / |d|
         (d a random pool row's component orthogonal to v), rescaled to |v|: cosine about 0.96
         to the old one (a document edited);
(i) the base's searcher, saved and changed by update.update_searcher (what `update` runs below
the threshold: ScaNN's load, its native delete of the dead rows' datapoints, then upsert of
the new rows, and the datapoint -> row map it keeps), against (ii) a searcher built on the
changed rows by index/refresher.build_searcher (what `update` runs above it: the config's
parameters for that size). recall@10 of each against numpy's exact top 10 over the live rows;
self@1: of --self_checks live rows searched with their own vector, the share whose top hit is
that row (or a row with the same score), a check of the datapoint -> row map. Also `steps`:
the same changes applied in successive updates of --step percent each, the searcher saved and
loaded between them as `update` does, to see the drift accumulate.

Query embeddings are cached in --cache (delete to recompute). Figures:
benchmarks/results/scann_update.json and the doc section (update_cost.py renders it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from benchmarks._report import machine  # noqa: E402

K = 10


def loadavg(a) -> str:
    return " / ".join(f"{x:.1f}" for x in a)


def load_config(workdir: str):
    """The workdir's recorded config, as every command on it loads it."""
    from realm_jax.api import _run_config
    from realm_jax.config import load_config as load
    from realm_jax.interop import sentence_embedder

    spec, overrides, _ = _run_config(workdir)
    config = load(spec, overrides)
    sentence_embedder.resolve(config, overrides)
    return config


def query_vectors(config, questions: str, n: int, seed: int, cache: str) -> np.ndarray:
    """n questions of the file embedded with the warm start's query embedder (cached)."""
    if os.path.exists(cache):
        return np.load(cache)
    import jax

    from realm_jax import sharding
    from realm_jax.index.embedding import embed_query_tokens
    from realm_jax.qa.commands import initial_params
    from realm_jax.tokenization import encode_query

    texts = [json.loads(line)["question"] for line in open(questions) if line.strip()]
    texts = random.Random(seed).sample(texts, min(n, len(texts)))
    mesh = sharding.inference_mesh(config.mesh, devices=jax.local_devices()[:1])
    model, params = initial_params(config, mesh)
    qp = {"query_embedder": sharding.to_host(params["query_embedder"])}
    fn = jax.jit(lambda p, ids: embed_query_tokens(model, p, ids))
    L = int(config.data.query_len)
    out = []
    for i in range(0, len(texts), 64):
        ids = np.stack([encode_query(t, L) for t in texts[i : i + 64]])
        pad = 64 - len(ids)
        if pad:
            ids = np.concatenate([ids, np.zeros((pad, L), ids.dtype)])
        out.append(np.asarray(fn(qp, ids), np.float32)[: 64 - pad])
    q = np.concatenate(out)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    np.save(cache, q)
    return q


def embedder_name(config) -> str:
    """What made the workdir's frozen index: its warm start's document embedder."""
    m = config.model
    if m.get("init_retriever_from", ""):
        return f"{m.init_retriever_from}'s vectors"
    if m.get("init_embedders_from_ict", ""):
        return f"the ICT run {m.init_embedders_from_ict}'s {int(m.proj_size)}-d vectors"
    return "its warm start's vectors"


def exact_top(q: np.ndarray, emb: np.ndarray, rows: np.ndarray) -> np.ndarray:
    s = q @ emb.T
    top = np.argpartition(-s, K, axis=1)[:, :K]
    return rows[top]


def recall(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(set(g) & set(w)) / K for g, w in zip(got, want, strict=True)]))


def searched_rows(searcher, q: np.ndarray, rows: np.ndarray) -> np.ndarray:
    from realm_jax.index import scann as scann_index

    ids, _ = scann_index.search(searcher, q, K)
    return np.where(ids >= 0, rows[np.clip(ids, 0, None)], -1)


def self_check(searcher, rows_map: np.ndarray, emb: np.ndarray, live: np.ndarray, n: int, seed):
    """Share of n live rows whose own vector finds them (or an equal-scoring row) first."""
    from realm_jax.index import scann as scann_index

    rng = np.random.default_rng(seed)
    pos = rng.choice(len(live), min(n, len(live)), replace=False)
    q = emb[pos]
    ids, _ = scann_index.search(searcher, q, 1)
    got = rows_map[ids[:, 0]]
    where = {int(r): i for i, r in enumerate(live)}
    ok = 0
    for p, g in zip(pos, got, strict=True):
        if int(g) == int(live[p]):
            ok += 1
        elif (
            int(g) in where
            and abs(float(emb[where[int(g)]] @ emb[p]) - float(emb[p] @ emb[p])) < 1e-4
        ):
            ok += 1
    return ok / len(pos)


def split(doc_ids: list[str], titles: list[str], share: float, seed: int):
    """Row positions of the base and of the pool: whole articles in the pool until it holds
    `share` x the base's rows."""
    by_title: dict[str, list[int]] = {}
    for i, t in enumerate(titles):
        by_title.setdefault(t, []).append(i)
    names = sorted(by_title)
    random.Random(seed).shuffle(names)
    pool, n = [], len(titles)
    for t in names:
        if len(pool) >= share * (n - len(pool)):
            break
        pool += by_title[t]
    pool_set = set(pool)
    base = [i for i in range(n) if i not in pool_set]
    return np.asarray(base), np.asarray(sorted(pool))


def edited(v: np.ndarray, rng, pool: np.ndarray) -> np.ndarray:
    """Each vector moved to cosine about 0.96 of itself (0.3 |v| along a direction
    orthogonal to it), its norm kept. The direction is a random pool row's component
    orthogonal to v: it stays in the span the embedder's vectors fill (a Gaussian direction
    leaves it, which an index of anisotropic vectors such as ICT's cannot quantise: not what an
    edited document's embedding does)."""
    u = pool[rng.integers(0, len(pool), len(v))].astype(np.float64)
    vh = v / np.linalg.norm(v, axis=1, keepdims=True)
    d = u - np.sum(u * vh, axis=1, keepdims=True) * vh
    norm = np.linalg.norm(v, axis=1, keepdims=True)
    w = v + 0.3 * norm * d / np.linalg.norm(d, axis=1, keepdims=True)
    return (w * norm / np.linalg.norm(w, axis=1, keepdims=True)).astype(np.float32)


def change(config, parent: str, parent_rows, live, emb, dead, new_emb, next_row):
    """update_searcher on the saved searcher at `parent` (datapoint d is row parent_rows[d];
    the index's position p is row live[p]): (searcher, rows map, new live, new emb, seconds)."""
    from realm_jax.index import update as upd

    keep = ~np.isin(live, dead)
    new_rows = next_row + np.arange(len(new_emb))
    new_live = np.concatenate([live[keep], new_rows]).astype(np.int64)
    new_index = np.concatenate([emb[keep], new_emb]).astype(np.float32)
    plan = SimpleNamespace(
        dead=[int(r) for r in dead], new_blocks=[SimpleNamespace(block_id=int(r)) for r in new_rows]
    )
    t0 = time.perf_counter()
    searcher, rows_map, mode, _ = upd.update_searcher(
        config, parent, parent_rows, plan, new_emb, new_index, new_live, 1.0, 0
    )
    seconds = time.perf_counter() - t0
    assert mode == "upsert", mode
    return searcher, np.asarray(rows_map), new_live, new_index, seconds


def save(searcher, folder: str) -> None:
    from realm_jax.index import scann as scann_index

    if os.path.exists(folder):
        shutil.rmtree(folder)
    scann_index.save_searcher(searcher, os.path.join(folder, "scann"))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workdir", default="runs/update_cost/qa", help="update_cost.py's QA workdir")
    ap.add_argument("--questions", default="", help="default: SQuAD's questions")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--shares", default="1,5,10,25,50", help="percent of the base's rows")
    ap.add_argument("--step", type=float, default=5, help="percent per update in `steps`")
    ap.add_argument("--self_checks", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="runs/update_cost/scann_queries.npy")
    ap.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "scann_update.json")
    )
    ap.add_argument("--no_doc", action="store_true", help="write the JSON only")
    args = ap.parse_args()

    from realm_jax import workdir as paths
    from realm_jax.config import squad_files
    from realm_jax.data import datasets
    from realm_jax.index import scann as scann_index
    from realm_jax.index import store
    from realm_jax.index.refresher import build_searcher

    load_start = os.getloadavg()
    config = load_config(args.workdir)
    found = store.latest_valid(paths.index_dir(args.workdir))
    if found is None:
        print(f"{args.workdir}: no index: run benchmarks/update_cost.py first", file=sys.stderr)
        return 1
    all_emb = np.asarray(store.load_embeddings(found[1]), np.float32)
    _, doc_ids, titles = datasets.load_blocks(paths.data_dir(config, args.workdir))
    shares = [float(s) / 100 for s in args.shares.split(",")]
    base_pos, pool_pos = split(doc_ids, titles, max(shares), args.seed)
    emb0 = all_emb[base_pos]
    pool = all_emb[pool_pos]
    n = len(emb0)
    live0 = np.arange(n, dtype=np.int64)  # rows of the base: 0..n-1
    q = query_vectors(
        config, args.questions or squad_files()[1], args.queries, args.seed, args.cache
    )
    params = scann_index.scann_params(
        n,
        num_leaves=config.refresh.scann_num_leaves,
        leaves_to_search=config.refresh.scann_leaves_to_search,
        reorder=config.refresh.scann_reorder,
    )
    work = tempfile.mkdtemp(prefix="scann_update_")
    res = {
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "argv": " ".join(sys.argv[1:]),
        "index": found[1],
        "embedder": embedder_name(config),
        "rows": len(all_emb),
        "dim": int(all_emb.shape[1]),
        "base_rows": n,
        "pool_rows": len(pool),
        "base_articles": len({titles[i] for i in base_pos}),
        "pool_articles": len({titles[i] for i in pool_pos}),
        "queries": len(q),
        "params": params,
        "rows_out": [],
    }
    try:
        t0 = time.perf_counter()
        base = build_searcher(config, emb0)
        res["base_build_s"] = round(time.perf_counter() - t0, 3)
        parent = os.path.join(work, "base")
        save(base, parent)
        t0 = time.perf_counter()
        scann_index.load_searcher(os.path.join(parent, "scann"))
        res["load_s"] = round(time.perf_counter() - t0, 3)
        res["base_recall"] = recall(searched_rows(base, q, live0), exact_top(q, emb0, live0))
        res["base_self"] = self_check(base, live0, emb0, live0, args.self_checks, args.seed)
        print(f"base: {n} rows, params {params}, recall@10 {res['base_recall']:.4f}", flush=True)
        rng = np.random.default_rng(args.seed)
        for mode in ("new", "edit"):
            for s in shares:
                m = round(s * n)
                dead = np.sort(rng.choice(n, m, replace=False))
                new_emb = pool[:m] if mode == "new" else edited(emb0[dead], rng, pool)
                searcher, rows_map, live, emb, up_s = change(
                    config, parent, live0, live0, emb0, dead, new_emb, n
                )
                exact = exact_top(q, emb, live)
                r_up = recall(searched_rows(searcher, q, rows_map), exact)
                self_up = self_check(searcher, rows_map, emb, live, args.self_checks, args.seed)
                t0 = time.perf_counter()
                rebuilt = build_searcher(config, emb)
                rb_s = time.perf_counter() - t0
                r_rb = recall(searched_rows(rebuilt, q, live), exact)
                row = {
                    "mode": mode,
                    "share": s,
                    "changed_rows": 2 * m,
                    "upsert_recall": r_up,
                    "upsert_self": self_up,
                    "upsert_s": round(up_s, 3),
                    "rebuild_recall": r_rb,
                    "rebuild_s": round(rb_s, 3),
                    "rebuild_params": scann_index.scann_params(len(emb)),
                }
                res["rows_out"].append(row)
                print(json.dumps(row), flush=True)
        # successive updates: the drift accumulates; the searcher saved and loaded between them
        steps, live, emb, next_row, folder, rows_map = [], live0, emb0, n, parent, live0
        per = round(args.step / 100 * n)
        used = 0
        for k in range(1, round(max(shares) * 100 / args.step) + 1):
            alive_base = live[live < n]  # base rows still live
            dead = np.sort(rng.choice(alive_base, per, replace=False))
            new_emb = pool[used : used + per]
            used += per
            searcher, rows_map, live, emb, up_s = change(
                config, folder, rows_map, live, emb, dead, new_emb, next_row
            )
            next_row += per
            folder = os.path.join(work, f"step{k}")
            t0 = time.perf_counter()
            save(searcher, folder)
            save_s = time.perf_counter() - t0
            exact = exact_top(q, emb, live)
            row = {
                "updates": k,
                "cumulative_share": k * per / n,
                "upsert_recall": recall(searched_rows(searcher, q, rows_map), exact),
                "upsert_self": self_check(searcher, rows_map, emb, live, args.self_checks, k),
                "upsert_s": round(up_s, 3),
                "save_s": round(save_s, 3),
            }
            steps.append(row)
            print(json.dumps(row), flush=True)
        res["steps"] = steps
        res["step_percent"] = args.step
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_start"] = loadavg(load_start)
    res["load_end"] = loadavg(os.getloadavg())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
    print(f"wrote {args.out}")
    if not args.no_doc:
        from benchmarks.update_cost import write_doc

        write_doc()
    return 0


def body(res: dict) -> str:
    """The ScaNN part of the doc section."""
    p = res["params"]
    index = os.path.relpath(res["index"], REPO)
    lines = [
        f"`python benchmarks/scann_update.py{(' ' + res['argv']) if res['argv'] else ''}`, "
        f"measured {res['measured']} (load average {res['load_start']} at the start, "
        f"{res['load_end']} at the end). The frozen index of {index} ({res['rows']:,} "
        f"rows x {res['dim']}, {res.get('embedder', 'all-MiniLM-L6-v2')}) split by article: a "
        f"base of {res['base_rows']:,} rows "
        f"({res['base_articles']} articles) the searcher is built on, and {res['pool_rows']:,} "
        f"rows of {res['pool_articles']} other articles that updates add. The searcher: the "
        f"config's parameters (index/refresher.build_searcher: {p['num_leaves']} leaves, "
        f"{p['leaves_to_search']} searched, reorder {p['reorder']}; built in "
        f"{res['base_build_s']:.1f} s, loaded in {res['load_s']:.2f} s). {res['queries']:,} "
        f"SQuAD questions embedded with the same warm start's query embedder; recall@10 against "
        f"numpy's exact top 10 over the live rows. Unchanged: recall@10 "
        f"{res['base_recall']:.4f}.",
        "",
        "A change of share s deletes s of the base's rows and adds as many: `new`, rows of the "
        "held-out articles (new documents on topics the searcher's partitions and codebooks "
        "never saw); `edit`, each deleted row again with its vector moved (v + 0.3 |v| d/|d|, "
        "d a random other row's component orthogonal to v, rescaled to |v|: cosine about "
        "0.96). Upsert: the base's searcher saved, then "
        "`update.update_searcher` (ScaNN's load, native delete, native upsert, batch 256: what "
        "`update` runs below `--scann_rebuild_share`); rebuild: `build_searcher` on the changed "
        "rows (what it runs above). self@1: the share of 500 live rows found first by their own "
        "vector (the datapoint -> row map checked). `update` counts changed rows as dropped + "
        "added (2 s here) against the index's size.",
        "",
        "| vectors | share s | rows changed (of the index) | upsert recall@10 | rebuild "
        "recall@10 | upsert self@1 | upsert s (load + delete + upsert) | rebuild s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows_out"]:
        lines.append(
            f"| {r['mode']} | {100 * r['share']:.0f}% | {r['changed_rows']:,} "
            f"({100 * r['changed_rows'] / res['base_rows']:.0f}%) | {r['upsert_recall']:.4f} | "
            f"{r['rebuild_recall']:.4f} | {r['upsert_self']:.3f} | {r['upsert_s']:.2f} | "
            f"{r['rebuild_s']:.2f} |"
        )
    if res.get("steps"):
        lines += [
            "",
            f"Successive updates of {res['step_percent']:g}% `new` rows each (the searcher "
            "saved and loaded between them, as `update` keeps it):",
            "",
            "| updates | base rows replaced | upsert recall@10 | self@1 | upsert s | save s |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["steps"]:
            lines.append(
                f"| {r['updates']} | {100 * r['cumulative_share']:.0f}% | "
                f"{r['upsert_recall']:.4f} | {r['upsert_self']:.3f} | {r['upsert_s']:.2f} | "
                f"{r['save_s']:.2f} |"
            )
    lines += ["", verdict(res)]
    return "\n".join(lines)


TOLERANCE = 0.01  # recall@10 an upserted searcher may lose against a rebuild


def verdict(res: dict) -> str:
    """What the table says of update.SCANN_REBUILD_SHARE, by a rule fixed before the data:
    the largest drift (rows changed / index, as `update` counts it) at which the upserted
    searcher stays within TOLERANCE of the rebuilt one's recall@10 and finds 99% of rows by
    their own vector."""
    from realm_jax.index.update import SCANN_REBUILD_SHARE

    def ok(r) -> bool:
        return r["upsert_recall"] >= r["rebuild_recall"] - TOLERANCE and r["upsert_self"] >= 0.99

    n = res["base_rows"]
    out = []
    for mode in ("new", "edit"):
        rows = sorted((r for r in res["rows_out"] if r["mode"] == mode), key=lambda r: r["share"])
        good = [r["changed_rows"] / n for r in rows if ok(r)]
        bad = [r["changed_rows"] / n for r in rows if not ok(r)]
        first_bad = min(bad) if bad else None
        safe = max((g for g in good if first_bad is None or g < first_bad), default=0.0)
        out.append((mode, safe, first_bad))
    steps = res.get("steps", [])
    step_bad = [
        2 * r["cumulative_share"]
        for r in steps
        if r["upsert_recall"] < res["base_recall"] - TOLERANCE or r["upsert_self"] < 0.99
    ]
    text = (
        f"By the rule fixed before measuring (upsert within {TOLERANCE} of the rebuild's "
        "recall@10 and self@1 >= 0.99), the upserted searcher holds up to a drift (rows "
        "changed / index, as `update` counts it) of "
        + "; ".join(
            f"{100 * safe:.0f}% with `{mode}` vectors"
            + (f" (not at {100 * bad:.0f}%)" if bad is not None else " (every share tested)")
            for mode, safe, bad in out
        )
    )
    if steps:
        text += (
            f"; in successive updates, recall stays within {TOLERANCE} of the unchanged "
            "searcher's "
            + (
                f"up to a drift of {100 * min(step_bad):.0f}% (exclusive)"
                if step_bad
                else f"through a drift of {100 * 2 * steps[-1]['cumulative_share']:.0f}%"
            )
        )
    limit = min(safe for _, safe, _ in out)
    d = SCANN_REBUILD_SHARE
    if d > limit:
        text += f". The default --scann_rebuild_share {d} is above that: lower it to {limit:g}."
    elif limit >= 2 * d:
        text += (
            f". The default --scann_rebuild_share {d} is conservative on this data: a default "
            f"up to {limit:g} kept the recall, and would spare rebuilds (which cost "
            "what the table's rebuild column shows at this size, growing with the index)."
        )
    else:
        text += f". The default --scann_rebuild_share {d} is at or under that: the data fits it."
    return text


if __name__ == "__main__":
    raise SystemExit(main())
