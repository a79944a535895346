"""The answers follow an `update`, shown in the generated world (issue 61, deliverable 4) ->
this study's README.md.

    python experiments/update_world/study.py [--root runs/update-world] [--seeds 0,1,2]

Runs, as a user would (`python -m realm_jax ...`), into --root; every stage is skipped when
its output exists (delete it to redo):
  qa/               ORQA fine-tuning on the world's questions (configs/orqa.py:world) from the
                    ICT warm start alone (runs/world-ict: the tutorial's "ICT alone" start;
                    runs/world-realm, the config's default start, is not made here), then
                    `evaluate` on the held-out people's questions: the trained exact match.
  seed<S>/          one edit of the world per seed S, drawn with the world's own generator
                    (realm_jax/data/world.py):
    changes.jsonl   10% of the people's documents replaced by one with a changed fact (another
                    city or another year, the world's unique-pair rule kept, the same id), 10%
                    more people added (fresh names, documents rendered as the world renders
                    them, new ids), 5% of the people deleted ({"id", "delete": true})
    questions/      the question files `evaluate --questions` reads (SQuAD-style JSONL), one a
                    group: changed (the changed attribute, the NEW value as gold),
                    changed_other (the changed people's two other attributes), new, deleted
                    (their old facts), unchanged (every other person's three questions);
                    meta.json: each question's group, population and old value
    before/         `evaluate` of the trained workdir on changed and deleted (the control)
    qa/             a copy of ../qa (`cp -r`: updates are cumulative), then
                    `update --workdir seed<S>/qa --corpus changes.jsonl` (timed)
    after/          `evaluate` of the updated workdir on every group
    corpus.jsonl, fresh-data/
                    the edited corpus written whole and `prepare`d into a fresh data dir
    check.json      with numpy: the dense top-k documents of every question over the freshly
                    prepared blocks (embedded by the index's document embedder, via
                    realm_jax.load) against the updated workdir's (its published index, every
                    live block ranked) and against evaluate's top blocks; the deleted documents
                    looked for at the full depth of both retrievers (dense, BM25)
Then the README's results: each seed, the mean, and the pass/fail of the thresholds (THRESHOLDS).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # run as a script: the repo root, so the sibling packages import
    sys.path.insert(0, REPO)

from benchmarks._report import write_section  # noqa: E402
from experiments.tools.cli_runs import done, run  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
QA_CONFIG = "configs/orqa.py:world"
PREP_CONFIG = "configs/realm.py:world"
WORLD, DATA, ICT = "runs/world", "runs/world-data", "runs/world-ict"
BERT = "google/bert_uncased_L-2_H-128_A-2"  # configs/realm.py:world's model.init_reader_from
# ORQA's start from ICT alone (configs/orqa.py's note; experiments/world/world_study.py --qa)
ICT_START = [
    "--config.model.init_from_realm=",
    f"--config.model.init_embedders_from_ict={ICT}",
    f"--config.model.init_reader_from={BERT}",
]
CHANGE, ADD, DELETE = 0.10, 0.10, 0.05  # shares of the world's people
GROUPS = ("changed", "changed_other", "new", "deleted", "unchanged")
KS = (1, 5, 20)
TIE = 1e-4  # two scores this close are a float tie (the fresh/updated scores differ by ~3e-5)
THRESHOLDS = (
    "changed-fact EM >= 0.9 x unchanged EM",
    "old value predicted <= 2% of changed-fact questions",
    "new people's EM within 5 points of the trained EM",
    "deleted documents never retrieved (any question, full depth)",
    "fresh prepare + re-embed: same top-20 documents up to float ties",
)


def jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ the edit
class Pairs:
    """The world's rule: no two people share a (city, profession), (profession, year) or
    (city, year) pair. Every pair ever used stays taken (a deleted or changed person's too)."""

    def __init__(self, people):
        self.cp, self.py, self.cy = set(), set(), set()
        for p in people:
            self.take(p.city, p.year, p.profession)

    def free(self, city: str, year: int, profession: str) -> bool:
        return (
            (city, profession) not in self.cp
            and (profession, year) not in self.py
            and (city, year) not in self.cy
        )

    def take(self, city: str, year: int, profession: str) -> None:
        self.cp.add((city, profession))
        self.py.add((profession, year))
        self.cy.add((city, year))


def draw_attributes(rng: random.Random, pairs: Pairs) -> tuple[str, int, str]:
    """A free (city, year, profession), drawn as world._attributes draws: a few random tries,
    then uniformly among every free triple."""
    from realm_jax.data import world as w

    for _ in range(64):
        c, y, p = rng.choice(w.CITIES), rng.choice(w.YEARS), rng.choice(w.PROFESSIONS)
        if pairs.free(c, y, p):
            return c, y, p
    free = [
        (c, y, p) for c in w.CITIES for y in w.YEARS for p in w.PROFESSIONS if pairs.free(c, y, p)
    ]
    if not free:
        raise RuntimeError("no free (city, year, profession) left")
    return rng.choice(free)


def new_names(rng: random.Random, kind: str, people, n: int) -> list[str]:
    """n fresh names of the world's kind, sharing no name word (words) / no name or prefix
    (made_up) with anyone in it."""
    from realm_jax.data import world as w

    if kind == "words":  # world._word_names: every vocab word in at most one name
        used = {part.lower() for p in people for part in p.name.split()}
        words = [x for x in w._name_words() if x not in used]
        drawn = rng.sample(words, 2 * n)
        return [f"{a.capitalize()} {b.capitalize()}" for a, b in zip(drawn[::2], drawn[1::2])]
    names, taken = [], [p.name for p in people]  # world._names's parts and prefix rule
    while len(names) < n:
        first = w._part(rng, 2, False)
        last = w._part(rng, rng.choice((2, 3)), rng.random() < 0.5)
        name = f"{first} {last}"
        if not (w._good_part(first) and w._good_part(last)):
            continue
        if any(o.startswith(name) or name.startswith(o) for o in taken):
            continue
        taken.append(name)
        names.append(name)
    return names


def build_edit(seed: int, out: str) -> dict:
    """changes.jsonl, the edited corpus, the question files and meta.json for one seed."""
    from realm_jax.data import world as w
    from realm_jax.qa.data import held_out_titles

    manifest = json.load(open(os.path.join(REPO, WORLD, "world.json")))
    settings = w.Settings(**manifest["world"])
    people = [w.Person(**r) for r in jsonl(os.path.join(REPO, WORLD, "people.jsonl"))]
    if people != w.make_people(settings):  # the files are the generator's
        raise RuntimeError(f"{WORLD}/people.jsonl is not config.world's world")
    corpus = jsonl(os.path.join(REPO, WORLD, "corpus.jsonl"))
    qa = {q["id"]: q for q in jsonl(os.path.join(REPO, WORLD, "qa.jsonl"))}
    held = held_out_titles(os.path.join(REPO, DATA))

    def population(p) -> str:
        if p.distractor:
            return "distractor"
        return "heldout" if held(p.name) else "qa_train"

    # every existing person's three questions: the world's own for the people of its text
    # (qa.jsonl), the generator's (world._questions, one fixed stream) for the distractors
    qrng = random.Random(f"update-world:questions:{settings.seed}")
    questions = {}
    for p in people:
        got = w._questions(qrng, p)
        for q in got:
            questions[q["id"]] = q if p.distractor else qa[q["id"]]

    rng = random.Random(f"update-world:edit:{seed}")
    n = len(people)
    n_change, n_add, n_delete = round(CHANGE * n), round(ADD * n), round(DELETE * n)
    picked = rng.sample(range(n), n_change + n_delete)
    changed = sorted(picked[:n_change])
    deleted = sorted(picked[n_change:])
    pairs = Pairs(people)
    by_id = {d["id"]: d for d in corpus}
    replace, meta = {}, {}
    final = {p.id: p for i, p in enumerate(people) if i not in set(deleted)}  # the edited world
    for i in changed:
        p = people[i]
        attribute = rng.choice(("city", "year"))
        if attribute == "city":
            options = [
                c
                for c in w.CITIES
                if (c, p.profession) not in pairs.cp and (c, p.year) not in pairs.cy
            ]
        else:
            options = [
                y
                for y in w.YEARS
                if (p.profession, y) not in pairs.py and (p.city, y) not in pairs.cy
            ]
        new = dataclasses.replace(p, **{attribute: rng.choice(options)})
        pairs.take(new.city, new.year, new.profession)
        doc = w._knowledge_document(random.Random(f"update-world:doc:{seed}:{p.id}"), new)
        assert doc["id"] == p.id and doc["title"] == by_id[p.id]["title"]
        replace[p.id] = doc
        final[p.id] = new
        for a in w.ATTRIBUTES:
            q = dict(questions[f"{p.id}/{a}"])
            if a == attribute:
                q["answers"] = [new.value(a)]
                meta[q["id"]] = {"group": "changed", "old": p.value(a), "attribute": a}
            else:
                meta[q["id"]] = {"group": "changed_other", "attribute": a}
            meta[q["id"]].update(population=population(p), question=q)
    width = max(5, len(str(n + n_add - 1)))
    added = []
    for k, name in enumerate(new_names(rng, settings.names, people, n_add)):
        city, year, profession = draw_attributes(rng, pairs)
        pairs.take(city, year, profession)
        p = w.Person(f"person-{n + k:0{width}d}", name, city, year, profession, True)
        final[p.id] = p
        added.append(w._knowledge_document(random.Random(f"update-world:doc:{seed}:{p.id}"), p))
        for q in w._questions(rng, p):
            meta[q["id"]] = {"group": "new", "population": "new", "question": q}
    for i in deleted:
        p = people[i]
        for a in w.ATTRIBUTES:
            q = questions[f"{p.id}/{a}"]
            meta[q["id"]] = {"group": "deleted", "population": population(p), "question": q}
    edited_or_gone = set(changed) | set(deleted)
    for i, p in enumerate(people):
        if i in edited_or_gone:
            continue
        for a in w.ATTRIBUTES:
            q = questions[f"{p.id}/{a}"]
            meta[q["id"]] = {"group": "unchanged", "population": population(p), "question": q}
    for m in meta.values():
        m.setdefault("attribute", m["question"]["id"].split("/")[1])

    changes = [replace[people[i].id] for i in changed]
    changes += added
    changes += [{"id": people[i].id, "delete": True} for i in deleted]
    gone = {people[i].id for i in deleted}
    for kind in (("city", "profession"), ("profession", "year"), ("city", "year")):
        seen = [tuple(getattr(p, a) for a in kind) for p in final.values()]
        assert len(set(seen)) == len(seen), f"two people share a {kind} pair"
    assert len({p.name for p in final.values()}) == len(final)
    edited = [replace.get(d["id"], d) for d in corpus if d["id"] not in gone] + added
    write_jsonl(os.path.join(out, "changes.jsonl"), changes)
    write_jsonl(os.path.join(out, "corpus.jsonl"), edited)
    for g in GROUPS:
        rows = [m["question"] for m in meta.values() if m["group"] == g]
        write_jsonl(os.path.join(out, "questions", f"{g}.jsonl"), rows)
    info = {
        "seed": seed,
        "changed": [people[i].id for i in changed],
        "deleted": sorted(gone),
        "added": [d["id"] for d in added],
        "deleted_titles": [people[i].name for i in deleted],
        "meta": {k: {x: v for x, v in m.items() if x != "question"} for k, m in meta.items()},
    }
    write_json(os.path.join(out, "questions", "meta.json"), info)
    return info


# ------------------------------------------------------------------------------ evaluate
def evaluate(workdir: str, out: str, questions: str = "") -> dict:
    """`evaluate` (its predictions and metrics files at `out`), skipped when done."""
    if not os.path.exists(out + ".metrics.json"):
        args = ["evaluate", "--workdir", workdir, "--output", out]
        args += ["--questions", questions] if questions else []
        run(args, out + ".log")
    return {
        "metrics": json.load(open(out + ".metrics.json")),
        "records": jsonl(out + ".predictions.jsonl"),
    }


def score_group(records: list[dict], questions: list[dict], meta: dict) -> dict:
    """EM (the file's gold), the old value's share (changed facts), own-document recall in
    evaluate's top blocks (by title), EM by population."""
    from realm_jax.qa.answers import is_correct

    if len(records) != len(questions):
        raise RuntimeError(f"{len(records)} predictions for {len(questions)} questions")
    em, old, own, pops = [], [], [], {}
    for r, q in zip(records, questions, strict=True):
        if r["question"] != q["question"]:
            raise RuntimeError(f"predictions out of order: {r['question']!r} / {q['question']!r}")
        m = meta[q["id"]]
        em.append(bool(r["correct"]))
        pops.setdefault(m["population"], []).append(bool(r["correct"]))
        if "old" in m:
            old.append(is_correct([m["old"]], r["prediction"], False))
        own.append(q["title"] in [b["title"] for b in r["top_blocks"]])
    out = {
        "questions": len(em),
        "em": float(np.mean(em)),
        "own_recall@5": float(np.mean(own)),
        "em_by_population": {k: [float(np.mean(v)), len(v)] for k, v in sorted(pops.items())},
    }
    if old:
        out["old_value"] = float(np.mean(old))
    return out


# ------------------------------------------------------------------------------ the checks
def check(seed_dir: str, info: dict, after: dict, chunk: int = 128) -> dict:
    """Fresh prepare + re-embed against the updated workdir; the deleted documents at full
    depth. In-process, through the Python API (realm_jax.load), the index files and numpy."""
    import realm_jax
    from realm_jax.data import datasets, versions
    from realm_jax.index import store
    from realm_jax.tokenization import encode_block

    workdir = os.path.join(seed_dir, "qa")
    model = realm_jax.load(workdir)
    view = versions.open_view(model.config, workdir)
    n_live = len(view)
    recs = view.__getitems__(range(n_live))
    live_doc = [r["doc_id"].decode() for r in recs]
    row_doc = {view.row(i): live_doc[i] for i in range(n_live)}
    upd_content = {r["doc_id"].decode(): (r["title"].decode(), r["text"].decode()) for r in recs}
    deleted = set(info["deleted"])
    deleted_titles = set(info["deleted_titles"])
    base = datasets.load_blocks(os.path.join(REPO, DATA))[1]
    deleted_rows = {i for i, d in enumerate(base) if d in deleted}
    out = {"corpus_version": view.version, "live_blocks": n_live}
    out["deleted_rows"] = len(deleted_rows)
    out["deleted_in_live_docs"] = sorted(deleted & set(view.docs()))

    # every question of every group, in a fixed order (evaluate's files, concatenated)
    qs = []
    for g in GROUPS:
        qs += jsonl(os.path.join(seed_dir, "questions", f"{g}.jsonl"))
    texts = [q["question"] for q in qs]
    is_deleted_q = [q["id"].split("/")[0] in deleted for q in qs]

    # the embedder: embed_blocks reproduces the trained workdir's index (version 0) and the
    # updated one's (every live block, the update's new ones included)
    def index_of(v) -> np.ndarray:
        return np.asarray(store.load_embeddings(store.latest_valid(v.index_dir)[1]), np.float32)

    trained = realm_jax.load(os.path.join(os.path.dirname(seed_dir), "qa"))
    t_view = versions.open_view(trained.config, trained.workdir)
    t_recs = t_view.__getitems__(range(len(t_view)))
    e0 = trained.embed_blocks(
        [r["text"].decode() for r in t_recs], titles=[r["title"].decode() for r in t_recs]
    )
    out["embed_blocks_vs_trained_index_max_abs"] = float(np.abs(e0 - index_of(t_view)).max())
    e_upd = model.embed_blocks(
        [r["text"].decode() for r in recs], titles=[r["title"].decode() for r in recs]
    )
    out["embed_blocks_vs_updated_index_max_abs"] = float(np.abs(e_upd - index_of(view)).max())

    # the fresh prepare: its blocks, embedded by the same document embedder
    fresh = os.path.join(seed_dir, "fresh-data")
    src = datasets.blocks_source(fresh)
    frecs = src.__getitems__(range(len(src)))
    f_tokens, f_docs, _ = datasets.load_blocks(fresh)
    f_title = [r["title"].decode() for r in frecs]
    f_text = [r["text"].decode() for r in frecs]
    block_len = int(model.config.data.block_len)
    out["fresh_blocks"] = len(f_docs)
    out["fresh_tokens_are_embed_blocks_input"] = all(
        np.array_equal(encode_block(t, x, block_len)[0], tok)
        for t, x, tok in zip(f_title, f_text, f_tokens, strict=True)
    )
    out["same_documents"] = upd_content == dict(
        zip(f_docs, zip(f_title, f_text, strict=True), strict=True)
    )
    e_fresh = model.embed_blocks(f_text, titles=f_title)
    f_pos = {d: j for j, d in enumerate(f_docs)}

    # every question, every live block ranked: dense (the updated workdir's published index
    # file, exact inner products: what realm_jax.load(W).retrieve computes, without building a
    # Hit per block) and BM25 (model.bm25(), over the same live blocks); positions -> rows
    e_index = index_of(view)
    rows = np.asarray(view.rows)
    pos_title = [r["title"].decode() for r in recs]
    found = {r: {"deleted_rows": 0, "deleted_titles": 0, "ranked": 0} for r in ("dense", "bm25")}
    own_deleted = 0  # a deleted person's question whose own document shows at any depth
    agree = {k: [] for k in (*KS, "all")}
    agree_set = {k: [] for k in KS}
    diffs, fresh_top, api_same, ties = [], [], [], []
    doc_pos = {d: j for j, d in enumerate(live_doc)}
    full_gaps = []  # per question whose full ranking differs: the largest score gap moved
    bad_rows = np.array(sorted(deleted_rows), np.int64)
    t0 = time.time()
    for a in range(0, len(texts), chunk):
        part = texts[a : a + chunk]
        q = model.embed_queries(part)
        dense = q @ e_index.T
        d_order = np.argsort(-dense, axis=1, kind="stable")
        b_order = model.bm25().search(part, n_live)[0]
        for name, order in (("dense", d_order), ("bm25", b_order)):
            found[name]["ranked"] += int(order.size)
            found[name]["deleted_rows"] += int(np.isin(rows[order], bad_rows).sum())
            for b in range(len(part)):
                titles = {pos_title[j] for j in order[b]}
                found[name]["deleted_titles"] += len(titles & deleted_titles)
                if is_deleted_q[a + b]:
                    own_deleted += qs[a + b]["title"] in titles
        # the API's own top 20 (realm_jax.load(W).retrieve) is the index file's
        top = model.retrieve(part, k=20, retriever="dense")
        api_same += [
            [h.block_id for h in hl] == rows[d_order[b, :20]].tolist() for b, hl in enumerate(top)
        ]
        scores = q @ e_fresh.T
        f_order = np.argsort(-scores, axis=1, kind="stable")
        for b in range(len(part)):
            u = [live_doc[j] for j in d_order[b]]
            f = [f_docs[j] for j in f_order[b]]
            fresh_top.append(f[:20])
            for k in KS:
                agree[k].append(u[:k] == f[:k])
                agree_set[k].append(set(u[:k]) == set(f[:k]))
            agree["all"].append(u == f)
            if u != f:  # the whole ranking: each rank's two documents' scores (updated side)
                su = dense[b, [doc_pos[d] for d in u]]
                sf = dense[b, [doc_pos[d] for d in f]]
                full_gaps.append(float(np.abs(su - sf).max()))
            if u[:20] != f[:20]:  # which documents moved, and how close their scores are
                moved = [j for j in range(20) if u[j] != f[j]]
                gap = max(abs(dense[b, doc_pos[u[j]]] - dense[b, doc_pos[f[j]]]) for j in moved)
                ties.append({"question": qs[a + b]["id"], "ranks": moved, "gap": float(gap)})
            fj = [f_pos[d] for d in u[:20]]
            diffs.append(float(np.abs(dense[b, d_order[b, :20]] - scores[b, fj]).max()))
    out["rank_s"] = round(time.time() - t0, 1)
    # evaluate's own top blocks (the predictions files of after/)
    ev_rows = [b["id"] for g in GROUPS for r in after[g]["records"] for b in r["top_blocks"]]
    ev_titles = [b["title"] for g in GROUPS for r in after[g]["records"] for b in r["top_blocks"]]
    found["evaluate_top_blocks"] = {
        "deleted_rows": sum(x in deleted_rows for x in ev_rows),
        "deleted_titles": sum(x in deleted_titles for x in ev_titles),
        "ranked": len(ev_rows),
    }
    out["deleted_found"] = found
    out["deleted_questions"] = int(sum(is_deleted_q))
    out["deleted_own_doc_found_at_any_depth"] = int(own_deleted)
    out["questions"] = len(qs)
    out["same_ranked_list"] = {str(k): float(np.mean(v)) for k, v in agree.items()}
    out["same_top_set"] = {str(k): float(np.mean(v)) for k, v in agree_set.items()}
    # the top-20 lists that differ: each a reordering of documents whose scores (the updated
    # index's) are within TIE of each other, i.e. a float tie
    out["top20_differences"] = ties
    out["same_top20_up_to_ties"] = 1.0 - sum(t["gap"] >= TIE for t in ties) / len(qs)
    out["full_ranking_max_gap"] = max(full_gaps or [0.0])
    out["same_full_ranking_up_to_ties"] = 1.0 - sum(g >= TIE for g in full_gaps) / len(qs)
    out["api_retrieve_top20_same_as_index_file"] = float(np.mean(api_same))
    out["max_score_diff_top20"] = float(np.max(diffs))
    # evaluate's top blocks (its dense search, the reader's beam) against the fresh ranking
    ev, i = [], 0
    for g in GROUPS:
        for r in after[g]["records"]:
            got = [row_doc.get(b["id"], "?") for b in r["top_blocks"]]
            ev.append(got == fresh_top[i][: len(got)])
            i += 1
    out["evaluate_top5_same_as_fresh"] = float(np.mean(ev))
    return out


# ------------------------------------------------------------------------------ a seed
def one_seed(root: str, seed: int) -> dict:
    sd = os.path.join(root, f"seed{seed}")
    os.makedirs(sd, exist_ok=True)
    meta_path = os.path.join(sd, "questions", "meta.json")
    if not os.path.exists(meta_path):
        build_edit(seed, sd)
    info = json.load(open(meta_path))
    meta = info["meta"]
    qa = os.path.join(root, "qa")
    res = {"seed": seed}

    before = {}
    for g in ("changed", "deleted"):
        f = os.path.join(sd, "questions", f"{g}.jsonl")
        before[g] = score_group(
            evaluate(qa, os.path.join(sd, "before", g), f)["records"], jsonl(f), meta
        )
    res["before"] = before

    wd = os.path.join(sd, "qa")
    upd = os.path.join(sd, "update.json")
    if not os.path.exists(upd):
        if os.path.exists(wd):  # a copy whose update did not finish: start it again
            shutil.rmtree(wd)
        subprocess.run(["cp", "-r", qa, wd], check=True)
        seconds = run(
            ["update", "--workdir", wd, "--corpus", os.path.join(sd, "changes.jsonl")],
            os.path.join(sd, "update.log"),
        )
        line = [x for x in open(os.path.join(sd, "update.log")) if "corpus version" in x]
        write_json(upd, {"wall_s": round(seconds, 1), "line": line[-1].strip() if line else ""})
    res["update"] = json.load(open(upd))
    from realm_jax.data import versions

    got = versions.latest(wd)
    res["update"]["manifest_seconds"] = got[1]["seconds"]
    res["update"]["counts"] = got[1]["counts"]

    after = {}
    for g in GROUPS:
        f = os.path.join(sd, "questions", f"{g}.jsonl")
        after[g] = evaluate(wd, os.path.join(sd, "after", g), f)
        res[g] = score_group(after[g]["records"], jsonl(f), meta)
        res[g]["recall@5_answer"] = after[g]["metrics"].get("recall@5")

    fresh = os.path.join(sd, "fresh-data")
    if not os.path.exists(os.path.join(fresh, "summary.json")):
        args = ["prepare", "--config", PREP_CONFIG, "--workdir", os.path.join(sd, "prepare")]
        args += [
            f"--config.data.corpus={os.path.join(sd, 'corpus.jsonl')}",
            f"--config.data.data_dir={fresh}",
        ]
        seconds = run(args, os.path.join(sd, "prepare.log"))
        write_json(os.path.join(sd, "prepare.json"), {"wall_s": round(seconds, 1)})
    res["prepare_s"] = json.load(open(os.path.join(sd, "prepare.json")))["wall_s"]
    chk = os.path.join(sd, "check.json")
    if not os.path.exists(chk):
        write_json(chk, check(sd, info, after))
    res["check"] = json.load(open(chk))
    return res


# ------------------------------------------------------------------------------ the table
def deleted_hits(r: dict) -> int:
    """Deleted blocks (by row or title) among every ranked list, plus deleted documents still
    live, plus deleted people's own documents found at any depth: 0 when never retrieved."""
    c = r["check"]
    n = sum(v["deleted_rows"] + v["deleted_titles"] for v in c["deleted_found"].values())
    return n + len(c["deleted_in_live_docs"]) + c["deleted_own_doc_found_at_any_depth"]


def verdicts(s: dict) -> list[bool]:
    """The thresholds (THRESHOLDS) of one seed's (or the mean's) summary numbers."""
    return [
        s["changed"] >= 0.9 * s["unchanged"],
        s["old"] <= 0.02,
        abs(s["new_gap"]) <= 0.05,
        s["deleted_hits"] == 0,
        s["same20"] == 1.0,
    ]


UNSEEN = ("distractor", "heldout")  # people whose questions fine-tuning never saw


def pop_em(r: dict, group: str, pops=UNSEEN) -> float:
    """A group's EM over the questions of some populations only."""
    got = [r[group]["em_by_population"].get(p, [0.0, 0]) for p in pops]
    return sum(em * n for em, n in got) / max(sum(n for _, n in got), 1)


def table(results: list[dict], em0: float) -> str:
    rows = [
        ("unchanged people EM (%)", lambda r: r["unchanged"]["em"], "pct"),
        ("changed fact EM, new value (%)", lambda r: r["changed"]["em"], "pct"),
        ("changed / unchanged EM", lambda r: r["changed"]["em"] / r["unchanged"]["em"], "f3"),
        ("... not fine-tuned on: unchanged EM (%)", lambda r: pop_em(r, "unchanged"), "pct"),
        ("... not fine-tuned on: changed fact EM (%)", lambda r: pop_em(r, "changed"), "pct"),
        (
            "... not fine-tuned on: changed / unchanged",
            lambda r: pop_em(r, "changed") / pop_em(r, "unchanged"),
            "f3",
        ),
        (
            "... fine-tuned on: unchanged EM (%)",
            lambda r: pop_em(r, "unchanged", ("qa_train",)),
            "pct",
        ),
        (
            "... fine-tuned on: changed fact EM (%)",
            lambda r: pop_em(r, "changed", ("qa_train",)),
            "pct",
        ),
        ("changed fact questions", lambda r: r["changed"]["questions"], "int"),
        ("changed fact: old value predicted (%)", lambda r: r["changed"]["old_value"], "pct"),
        ("before update: old value (%)", lambda r: r["before"]["changed"]["old_value"], "pct"),
        ("before update: new value (%)", lambda r: r["before"]["changed"]["em"], "pct"),
        ("changed people, other facts EM (%)", lambda r: r["changed_other"]["em"], "pct"),
        ("new people EM (%)", lambda r: r["new"]["em"], "pct"),
        ("new people EM - trained EM (points)", lambda r: r["new"]["em"] - em0, "pts"),
        ("new people own-doc recall@5 (%)", lambda r: r["new"]["own_recall@5"], "pct"),
        ("unchanged own-doc recall@5 (%)", lambda r: r["unchanged"]["own_recall@5"], "pct"),
        ("unchanged held-out people EM (%)", lambda r: pop_em(r, "unchanged", ("heldout",)), "pct"),
        ("unchanged distractors EM (%)", lambda r: pop_em(r, "unchanged", ("distractor",)), "pct"),
        ("deleted people EM before update (%)", lambda r: r["before"]["deleted"]["em"], "pct"),
        ("deleted people EM after update (%)", lambda r: r["deleted"]["em"], "pct"),
        ("deleted documents retrieved (full depth)", deleted_hits, "int"),
        (
            "fresh prepare: same top-1 document (%)",
            lambda r: r["check"]["same_ranked_list"]["1"],
            "pct",
        ),
        (
            "fresh prepare: same top-5 list (%)",
            lambda r: r["check"]["same_ranked_list"]["5"],
            "pct",
        ),
        (
            "fresh prepare: same top-20 list (%)",
            lambda r: r["check"]["same_ranked_list"]["20"],
            "pct",
        ),
        (
            "fresh prepare: questions whose top-20 order differs",
            lambda r: len(r["check"]["top20_differences"]),
            "int",
        ),
        (
            "... largest score gap of the documents they swap",
            lambda r: max([t["gap"] for t in r["check"]["top20_differences"]] or [0.0]),
            "e",
        ),
        (
            "fresh prepare: same top-20 list up to float ties (%)",
            lambda r: r["check"]["same_top20_up_to_ties"],
            "pct",
        ),
        (
            "fresh prepare: same full ranking (%)",
            lambda r: r["check"]["same_ranked_list"]["all"],
            "pct",
        ),
        (
            "... largest score gap of the documents they swap",
            lambda r: r["check"]["full_ranking_max_gap"],
            "e",
        ),
        (
            "fresh prepare: same full ranking up to float ties (%)",
            lambda r: r["check"]["same_full_ranking_up_to_ties"],
            "pct",
        ),
        (
            "fresh prepare: evaluate's top 5 the same (%)",
            lambda r: r["check"]["evaluate_top5_same_as_fresh"],
            "pct",
        ),
        (
            "fresh prepare: max score difference, top 20",
            lambda r: r["check"]["max_score_diff_top20"],
            "e",
        ),
        ("update wall time (s)", lambda r: r["update"]["wall_s"], "f1"),
        ("prepare wall time (s)", lambda r: r["prepare_s"], "f1"),
    ]
    fmt = {
        "pct": lambda x: f"{100 * x:.1f}",
        "pts": lambda x: f"{100 * x:+.1f}",
        "f3": lambda x: f"{x:.3f}",
        "f1": lambda x: f"{x:.1f}",
        "int": lambda x: f"{int(x)}",
        "e": lambda x: f"{x:.1e}",
    }
    cols = [f"seed {r['seed']}" for r in results] + ["mean"]
    out = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, f, kind in rows:
        vals = [f(r) for r in results]
        agg = float(np.sum(vals)) if kind == "int" else float(np.mean(vals))
        agg = float(np.max(vals)) if kind == "e" else agg
        cells = [fmt[kind](v) for v in vals] + [fmt[kind](agg) + (" (max)" if kind == "e" else "")]
        out.append(f"| {name} | " + " | ".join(cells) + (" (sum)" if kind == "int" else "") + " |")
    summaries = [
        {
            "changed": r["changed"]["em"],
            "unchanged": r["unchanged"]["em"],
            "old": r["changed"]["old_value"],
            "new_gap": r["new"]["em"] - em0,
            "deleted_hits": deleted_hits(r),
            "same20": r["check"]["same_top20_up_to_ties"],
        }
        for r in results
    ]
    summaries.append(
        {
            k: (sum if k == "deleted_hits" else np.mean)([s[k] for s in summaries])
            for k in summaries[0]
        }
    )
    out += ["", "| threshold | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    checks = [verdicts(s) for s in summaries]
    for j, name in enumerate(THRESHOLDS):
        out.append(f"| {name} | " + " | ".join("pass" if c[j] else "FAIL" for c in checks) + " |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/update-world")
    p.add_argument("--seeds", default="0,1,2")
    a = p.parse_args()
    root = a.root if os.path.isabs(a.root) else os.path.join(REPO, a.root)
    if re.search(r"runs/(world|sweep-world)", os.path.relpath(root, REPO)):
        p.error("--root must not be under runs/world* or runs/sweep-world*")
    os.makedirs(root, exist_ok=True)
    qa = os.path.join(root, "qa")
    if not done(qa):
        if os.path.exists(qa):
            shutil.rmtree(qa)
        t = run(["finetune", "--config", QA_CONFIG, "--workdir", qa, *ICT_START], f"{qa}.log")
        write_json(os.path.join(root, "finetune.json"), {"wall_s": round(t, 1)})
    trained = evaluate(qa, os.path.join(root, "eval", "heldout"))
    trained = {"em": trained["metrics"]["exact_match"], **trained["metrics"]}
    print(f"trained: held-out EM {trained['em']:.3f} ({int(trained['questions'])} questions)")
    results = []
    for s in [int(x) for x in a.seeds.split(",") if x]:
        r = one_seed(root, s)
        write_json(os.path.join(root, f"seed{s}", "results.json"), r)
        results.append(r)
        print(json.dumps({g: r[g]["em"] for g in GROUPS}), flush=True)
    body = table(results, trained["em"])
    head = (
        f"Trained exact match (held-out people of the world, `evaluate --workdir {a.root}/qa`): "
        f"{100 * trained['em']:.1f}% of {int(trained['questions'])} questions.\n\n"
    )
    write_section(f"Results: seeds {a.seeds}", head + body, doc=RESULTS)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
