"""`update`: change a trained workdir's corpus, not its model (issue 61).

    python -m realm_jax update --workdir W --corpus CHANGES.jsonl
    python -m realm_jax update --workdir W --corpus NEW_CORPUS --replace_all

CHANGES is JSONL: {"id", "title", "text"} adds a document or replaces the one with that id;
{"id", "delete": true} deletes one. --replace_all takes a whole corpus (any format `prepare`
reads) and diffs it against the workdir's by id and content. Every line is checked before
anything is written (one error line naming the file and line, exit 2, nothing changed).

Then only what changed is done: the changed documents are cut into blocks as `prepare` cuts
them (local_prepare.blocks_of), only their blocks are embedded, with the document embedder that
made the served index (checked by re-embedding a few served blocks), the index is the parent's
rows minus the deleted ones plus the new ones, ScaNN is updated in place (its native upsert and
delete) until the rows changed since it was built pass --scann_rebuild_share of the index, then
rebuilt, and a new corpus version is published atomically (data/versions.py). BM25 has no
stored state: every reader builds it over its version's live blocks.

Differences from a fresh `prepare` of the edited corpus, on purpose: block ids are stable (new
blocks get new ids, never reused), so an edited corpus's blocks are numbered differently from a
fresh prepare's, with the same contents and rankings; pre-training examples are not made for the
new documents: REALM pre-training on an updated workdir retrieves from, embeds and refreshes its
newest version's blocks (new ones included) with the prepared sentences as its examples, and
ICT there is refused (versions.refuse_ict).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import logging
import os
import secrets
import time
import unicodedata

import numpy as np

from realm_jax import fs
from realm_jax.corpus_errors import CorpusError
from realm_jax.data import versions

log = logging.getLogger("realm_jax.update")

SCANN_REBUILD_SHARE = 0.1  # default of --scann_rebuild_share (docs/benchmarks.md measures it)
CHECK_ROWS = 4  # served blocks re-embedded to check the embedder is the index's
MAX_SHOWN = 5  # bad lines named in the one error line


DRILL_ENV = "REALM_JAX_DRILL_UPDATE"  # "<stage>:<mark file>": acceptance/update_drills.py


def _stage(name: str) -> None:
    """A named point of an update. Under the drill's variable naming this stage, it notes
    the pid in the mark file and waits there to be killed (kill -9 at a chosen point)."""
    want = os.environ.get(DRILL_ENV, "")
    if want.split(":", 1)[0] == name:
        with open(want.split(":", 1)[1], "a") as f:
            f.write(f"{os.getpid()} {name}\n")
        time.sleep(600)


@dataclasses.dataclass
class Change:
    where: str  # file:line, or add[i] / delete[i] from the Python API
    doc_id: str
    title: str = ""
    text: str = ""
    delete: bool = False


@dataclasses.dataclass
class Result:
    version: int  # the published corpus version (the parent's when nothing changed)
    added: int
    replaced: int
    deleted: int
    unchanged: int
    new_blocks: int
    dropped_blocks: int
    num_live: int
    scann: str  # "upsert", "rebuild" or "" (no searcher)
    seconds: dict

    def line(self) -> str:
        return (
            f"corpus version {self.version}: {self.added} added, {self.replaced} replaced, "
            f"{self.deleted} deleted, {self.unchanged} unchanged; {self.new_blocks} blocks "
            f"embedded, {self.dropped_blocks} dropped, {self.num_live} live"
            + (f"; ScaNN {self.scann}" if self.scann else "")
        )


# ----------------------------------------------------------------------------- validation
def _binary(text: str) -> bool:
    """NUL, or more than 10% control characters (not tab or newline): not text."""
    if "\0" in text:
        return True
    ctrl = sum(1 for c in text if unicodedata.category(c) == "Cc" and c not in "\t\n\r")
    return ctrl > 0.1 * max(len(text), 1)


def _check(where: str, obj, seen: dict[str, str]) -> tuple[Change | None, str | None]:
    """(change, None) or (None, the problem)."""
    if not isinstance(obj, dict):
        return None, f"{where}: not a JSON object"
    doc_id = obj.get("id")
    if not isinstance(doc_id, str) or not doc_id.strip():
        return None, f"{where}: missing or empty 'id' (a string)"
    if doc_id in seen:
        return None, f"{where}: duplicate id {doc_id!r} (first at {seen[doc_id]})"
    seen[doc_id] = where
    if obj.get("delete", False) is not False:
        if obj["delete"] is not True:
            return None, f"{where}: 'delete' must be true, got {obj['delete']!r}"
        if "text" in obj or "title" in obj:
            return None, f"{where}: a delete line with 'title' or 'text' (delete OR replace)"
        return Change(where, doc_id, delete=True), None
    title, text = obj.get("title"), obj.get("text")
    if not isinstance(title, str) or not isinstance(text, str):
        return None, f"{where}: missing or non-string 'title'/'text' (or give \"delete\": true)"
    if _binary(title) or _binary(text):
        return None, f"{where}: binary text (NUL or control bytes), not a document"
    if not title.strip():
        return None, f"{where}: empty title"
    if not text.strip() or not any(c.isalnum() for c in text):
        return None, f"{where}: empty text (no letters or digits)"
    return Change(where, doc_id, title.strip(), text.strip()), None


def _raise_bad(bad: list[str], what: str) -> None:
    if bad:
        more = f" (and {len(bad) - 1} more: {'; '.join(bad[1:MAX_SHOWN])})" if len(bad) > 1 else ""
        raise CorpusError(f"{bad[0]}{more}; nothing was changed{what}")


def read_changes(path: str) -> list[Change]:
    """Every line of a CHANGES file checked: CorpusError naming the bad lines, else the
    changes in order."""
    if not fs.exists(path):
        raise CorpusError(f"{path}: no such file")
    raw = fs.read_bytes(path)
    if path.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise CorpusError(f"{path}: not gzip data ({e})") from None
    changes, bad, seen = [], [], {}
    for n, line in enumerate(raw.split(b"\n"), 1):
        where = f"{path}:{n}"
        if not line.strip():
            continue
        if b"\0" in line:
            bad.append(f"{where}: binary data (NUL bytes), not a JSON line")
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})")
            continue
        except ValueError as e:
            bad.append(f"{where}: malformed JSON ({str(e).split(':')[0]})")
            continue
        change, problem = _check(where, obj, seen)
        (bad.append(problem) if problem else changes.append(change))
    _raise_bad(bad, "")
    if not changes:
        raise CorpusError(f"{path}: no changes in it (an empty file)")
    return changes


def api_changes(add=None, delete=None) -> list[Change]:
    """realm_jax.load(W).update(add=[{"id", "title", "text"}], delete=["id", ...])."""
    changes, bad, seen = [], [], {}
    for i, obj in enumerate(list(add or [])):
        change, problem = _check(f"add[{i}]", obj, seen)
        if change is not None and change.delete:
            problem, change = f"add[{i}]: a delete in add= (give its id in delete=)", None
        (bad.append(problem) if problem else changes.append(change))
    dels = [delete] if isinstance(delete, str) else list(delete or [])
    for i, doc_id in enumerate(dels):
        change, problem = _check(f"delete[{i}]", {"id": doc_id, "delete": True}, seen)
        (bad.append(problem) if problem else changes.append(change))
    _raise_bad(bad, "")
    if not changes:
        raise CorpusError("update(): no changes given (add= and delete= are empty)")
    return changes


def whole_corpus(path: str, old_ids) -> tuple[list[Change], bool]:
    """--replace_all: the new corpus's documents (prepare's reader and checks) as changes,
    and a delete for every old id it no longer has; (changes, by_line)."""
    from realm_jax.data import corpus as corpus_lib

    changes = [
        Change(f"{path} ({doc_id})", doc_id, title, text)
        for doc_id, title, text in corpus_lib.read_documents(path)
    ]
    have = {c.doc_id for c in changes}
    changes += [Change(f"{path} (gone)", d, delete=True) for d in old_ids if d not in have]
    return changes, corpus_lib.is_plain_text(path)


# ----------------------------------------------------------------------------- the diff
def _raw_sha(title: str, text: str) -> str:
    return hashlib.sha256(f"{title}\0{text}".encode()).hexdigest()


def _blocks_sha(blocks) -> str:
    h = hashlib.sha256()
    for b in blocks:
        h.update(versions.block_key(b.title, b.token_ids))
    return h.hexdigest()


@dataclasses.dataclass
class Plan:
    docs: dict  # the new version's {id: [raw sha, blocks sha, rows]}
    dead: list[int]  # rows dropped
    new_blocks: list  # corpus.Block, ids = rows from the parent's num_rows on
    added: int = 0
    replaced: int = 0
    deleted: int = 0
    unchanged: int = 0


def diff(view: versions.View, changes: list[Change], by_line: bool = False) -> Plan:
    """What the changes do to the view's corpus; CorpusError for an unknown id to delete or a
    document that cuts into no block."""
    from realm_jax.data.local_prepare import blocks_of

    docs = {k: list(v) for k, v in view.docs().items()}
    plan = Plan(docs, [], [])
    bad = [
        f"{c.where}: unknown id {c.doc_id!r} to delete (not in {view!r})"
        for c in changes
        if c.delete and c.doc_id not in docs
    ]
    _raise_bad(bad, "")
    todo = []
    for c in changes:
        if c.delete:
            continue
        raw = _raw_sha(c.title, c.text)
        if c.doc_id in docs and docs[c.doc_id][0] == raw:
            plan.unchanged += 1
        else:
            todo.append((c, raw))
    cut = blocks_of([(c.doc_id, c.title, c.text) for c, _ in todo], view.block_len, 0, by_line)
    empty = [
        f"{c.where}: no usable text (cuts into no block)" for (c, _), b in zip(todo, cut) if not b
    ]
    _raise_bad(empty, "")
    row = view.num_rows
    for c in changes:  # deletes first, in order: rows of a deleted document are dropped
        if c.delete:
            plan.dead += docs.pop(c.doc_id)[2]
            plan.deleted += 1
    for (c, raw), blocks in zip(todo, cut, strict=True):
        key = _blocks_sha(blocks)
        old = docs.get(c.doc_id)
        if old is not None and old[1] == key:  # the same blocks (e.g. a prepared document)
            old[0] = raw
            plan.unchanged += 1
            continue
        if old is not None:
            plan.dead += old[2]
            plan.replaced += 1
        else:
            plan.added += 1
        for b in blocks:
            b.block_id = row
            row += 1
        plan.new_blocks += blocks
        docs[c.doc_id] = [raw, key, [b.block_id for b in blocks]]
    return plan


# ----------------------------------------------------------------------------- the embedder
def _index_manifest(index_path: str) -> dict:
    return json.loads(fs.read_bytes(fs.join(index_path, "manifest.json")))


def _refuse_while_pretraining(config, workdir: str) -> None:
    """A pre-training run (its trainer or refresh job) reads one corpus version from its start
    to its end, the block count compiled into its step: a version published under it would
    not reach it, and a restarted refresh job would embed the new one for a trainer still on
    the old. A fine-tuning run pins its version too, and may go on (a frozen index)."""
    from realm_jax.lock import held_elsewhere

    if config.get("task", "") != "realm":
        return
    for role in ("trainer", "refresher"):
        if held_elsewhere(workdir, role):
            raise CorpusError(
                f"{workdir}: a pre-training {role} is running here: stop it (its checkpoint is "
                "kept), run `update`, then resume; the resumed run reads the new version"
            )


def served_embedder(view: versions.View, index_manifest: dict) -> dict:
    """Which document embedder made the view's index: {"kind": "initial"} (a fine-tuning
    run's frozen index: the config's warm start) or {"kind": "checkpoint", "step": N}. A
    version's own index (its step the manifest's index_step) was made by the manifest's
    embedder; a later one in its store by the checkpoint of its step (pre-training's refresh
    job, a refreshing fine-tuning)."""
    if view.manifest is not None and int(index_manifest["step"]) == int(
        view.manifest.get("index_step", -1)
    ):
        return dict(view.manifest["embedder"])
    if index_manifest.get("frozen") and not index_manifest.get("imported_from"):
        return {"kind": "initial"}
    return {"kind": "checkpoint", "step": int(index_manifest["step"])}


def embedder_fn(config, workdir: str, embedder: dict, initial=None):
    """tokens [n, block_len] -> float32 [n, D] with that document embedder, on one device.
    initial(config, mesh) -> (model, params of every network): the config's warm start (a
    fine-tuning run's frozen index was embedded with it: qa.commands.initial_params, which the
    entry points pass; this room is below the tasks')."""
    import jax

    from realm_jax import checkpoint, sharding
    from realm_jax.index.embedding import abstract_params, embed_block_tokens
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name

    mesh = sharding.inference_mesh(config.mesh, devices=jax.local_devices()[:1])
    name = doc_embedder_name(ModelConfig.from_config(config.model, "embedder"))
    if embedder["kind"] == "initial":
        if initial is None:
            raise ValueError(
                "a frozen fine-tuning index: pass initial= (qa.commands.initial_params)"
            )
        model, params = initial(config, mesh)
        params = params[name]
    else:
        step = int(embedder["step"])
        mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
        if step not in set(mgr.all_steps()):
            raise CorpusError(
                f"{workdir}: checkpoint {step}, whose document embedder made the served index, "
                f"is gone (kept: {sorted(mgr.all_steps())}); new blocks embedded with another "
                "would not match the index: publish an index from a kept checkpoint first "
                "(`realm-jax refresh --max_versions 1`)"
            )
        model, abstract = abstract_params(config, mesh, name)
        params = checkpoint.restore_params_subtree(mgr, step, name, abstract)
    params = sharding.to_host(params)
    fn = jax.jit(lambda p, t: embed_block_tokens(model, {name: p}, t))
    batch = max(1, int(config.refresh.get("embed_batch_size", 64)))

    def embed(tokens: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(tokens), batch):
            piece = tokens[i : i + batch]
            pad = batch - len(piece)  # one compiled shape
            if pad:
                piece = np.concatenate([piece, np.zeros((pad, piece.shape[1]), piece.dtype)])
            out.append(np.asarray(fn(params, piece), np.float32)[: batch - pad])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    return embed


def check_embedder(embed, view: versions.View, emb: np.ndarray, embedder: dict) -> None:
    """Re-embed a few served blocks: they must come out as the index holds them, else new
    blocks would be embedded in another space than the old ones."""
    n = len(view)
    pos = sorted({0, n - 1, n // 2, n // 3})[:CHECK_ROWS]
    tokens = np.stack(
        [
            np.pad(t := view[p]["token_ids"][: view.block_len], (0, view.block_len - len(t)))
            for p in pos
        ]
    ).astype(np.int32)
    got, want = embed(tokens), emb[pos]
    cos = (got * want).sum(1) / np.maximum(
        np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1), 1e-12
    )
    ratio = np.linalg.norm(got, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-12)
    if not (np.all(cos > 0.999) and np.all(np.abs(ratio - 1) < 0.01)):
        raise CorpusError(
            f"{view.workdir}: the document embedder {embedder} does not reproduce the served "
            f"index (cosine {float(cos.min()):.4f} on {len(pos)} re-embedded blocks): the "
            "workdir's checkpoints or warm start changed since it was published; publish an "
            "index from the current embedder first"
        )


# ----------------------------------------------------------------------------- ScaNN
def update_searcher(
    config,
    parent_index: str,
    parent_rows,
    plan: Plan,
    new_emb,
    emb,
    live,
    share: float,
    parent_drift: int,
):
    """(searcher or None, datapoint -> row, mode, rows changed since the searcher's build)."""
    from realm_jax.index import scann as scann_index
    from realm_jax.index.refresher import build_searcher

    sdir = fs.join(parent_index, "scann")
    if not fs.isdir(sdir):
        return None, None, "", 0
    changed = len(plan.dead) + len(plan.new_blocks)
    drift = parent_drift + changed
    if drift > share * len(live):
        return build_searcher(config, emb), live.copy(), "rebuild", 0
    searcher = scann_index.load_searcher(sdir)
    rows = [int(r) for r in parent_rows]
    where = {r: i for i, r in enumerate(rows)}
    indices = []
    for r in sorted(plan.dead):  # ScaNN's delete: the last datapoint moves into the hole
        i = where.pop(r)
        indices.append(i)
        last = len(rows) - 1
        if i != last:
            rows[i] = rows[last]
            where[rows[i]] = i
        rows.pop()
    if indices:
        searcher.searcher.delete(indices)
    if len(new_emb):
        searcher.searcher.upsert([None] * len(new_emb), np.ascontiguousarray(new_emb), 256)
        rows += [b.block_id for b in plan.new_blocks]
    return searcher, np.asarray(rows, np.int64), "upsert", drift


# ----------------------------------------------------------------------------- publish
def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def apply(
    config,
    workdir: str,
    changes: list[Change],
    *,
    initial=None,
    source: str = "",
    by_line=False,
    scann_rebuild_share: float = SCANN_REBUILD_SHARE,
    say=print,
) -> Result:
    """Apply the changes to the workdir's newest corpus version and publish the next one."""
    from realm_jax.index import store
    from realm_jax.lock import workdir_lock

    t = {}
    t0 = time.perf_counter()
    with workdir_lock(workdir, "update"):
        _refuse_while_pretraining(config, workdir)
        view = versions.open_view(config, workdir)
        found = store.latest_valid(view.index_dir)
        if found is None:
            raise CorpusError(
                f"{workdir}: no published index to update (`finetune` publishes its frozen "
                "index, `local` or `refresh` a pre-training workdir's)"
            )
        index_path = found[1]
        imani = _index_manifest(index_path)
        emb = np.asarray(store.load_embeddings(index_path), np.float32)
        if len(emb) != len(view):
            raise CorpusError(
                f"{index_path}: {len(emb)} rows for {len(view)} live blocks of {view!r}"
            )
        sha = hashlib.sha256(
            json.dumps([dataclasses.astuple(c)[1:] for c in changes]).encode()
        ).hexdigest()
        if view.manifest is not None and view.manifest.get("changes_sha256") == sha:
            say(f"update: these changes are corpus version {view.version} already")
            return _result(view.version, Plan({}, [], []), len(view), "", {})
        plan = diff(view, changes, by_line)
        t["diff"] = time.perf_counter() - t0
        say(
            f"update: {len(changes)} changes to {view!r}: {plan.added} added, {plan.replaced} "
            f"replaced, {plan.deleted} deleted, {plan.unchanged} unchanged "
            f"({len(plan.new_blocks)} new blocks; {t['diff']:.1f} s)"
        )
        if not plan.new_blocks and not plan.dead:
            say("update: nothing to change")
            return _result(view.version, plan, len(view), "", t)
        _stage("diffed")
        embedder = served_embedder(view, imani)
        t1 = time.perf_counter()
        new_emb = np.zeros((0, emb.shape[1]), np.float32)
        if plan.new_blocks:  # deletes alone embed nothing
            embed = embedder_fn(config, workdir, embedder, initial)
            check_embedder(embed, view, emb, embedder)
            L = view.block_len
            tokens = np.zeros((len(plan.new_blocks), L), np.int32)
            for i, b in enumerate(plan.new_blocks):
                tokens[i, : len(b.token_ids[:L])] = b.token_ids[:L]
            _stage("embedding")
            new_emb = embed(tokens)
            t["embed"] = time.perf_counter() - t1
            say(f"update: embedded {len(tokens)} blocks with {embedder} ({t['embed']:.1f} s)")
        t2 = time.perf_counter()
        dead = np.asarray(sorted(plan.dead), np.int64)
        keep = ~np.isin(view.rows, dead)
        live = np.concatenate([view.rows[keep], [b.block_id for b in plan.new_blocks]])
        live = live.astype(np.int64)
        new_index = np.concatenate([emb[keep], new_emb])
        if not len(live):
            raise CorpusError(f"{workdir}: the changes delete every document; nothing would serve")
        parent_rows = view.scann_rows if view.scann_rows is not None else view.rows
        drift0 = int((view.manifest or {}).get("scann_drift", 0))
        searcher, scann_rows, mode, drift = update_searcher(
            config,
            index_path,
            parent_rows,
            plan,
            new_emb,
            new_index,
            live,
            scann_rebuild_share,
            drift0,
        )
        t["index"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        k = _publish(
            view,
            plan,
            live,
            new_index,
            searcher,
            scann_rows,
            drift,
            embedder,
            imani,
            sha,
            source,
            t,
        )
        t["publish"] = time.perf_counter() - t3
        removed = versions.cleanup(workdir)
        if removed:
            log.info("removed %s", removed)
        t["total"] = time.perf_counter() - t0
        r = _result(k, plan, len(live), mode, t)
        say(f"update: published {r.line()} ({t['total']:.1f} s)")
        return r


def _result(version: int, plan: Plan, live: int, mode: str, t: dict) -> Result:
    return Result(
        version,
        plan.added,
        plan.replaced,
        plan.deleted,
        plan.unchanged,
        len(plan.new_blocks),
        len(plan.dead),
        live,
        mode,
        {k: round(v, 3) for k, v in t.items()},
    )


def _publish(
    view, plan, live, new_index, searcher, scann_rows, drift, embedder, imani, sha, source, t
) -> int:
    from realm_jax.index import store

    root = versions.corpus_dir(view.workdir)
    k = max([view.version, *versions.list_versions(view.workdir)]) + 1
    final = fs.join(root, versions.version_name(k))
    remote = fs.is_remote(root)
    if remote:
        folder = final
        if fs.exists(fs.join(final, versions.MANIFEST)):
            raise CorpusError(f"{final}: another update published it first; run again")
    else:
        os.makedirs(root, exist_ok=True)
        folder = os.path.join(
            root, f".tmp-{versions.version_name(k)}-{os.getpid()}-{secrets.token_hex(4)}"
        )
        os.mkdir(folder)
    files = {}

    def put(rel: str, data: bytes) -> None:
        fs.write_bytes(fs.join(folder, *rel.split("/")), data)
        files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    segments = list((view.manifest or {}).get("segments", []))
    if plan.new_blocks:
        first = plan.new_blocks[0].block_id
        L = view.block_len
        tok = np.zeros((len(plan.new_blocks), L), np.int32)
        lines = []
        for i, b in enumerate(plan.new_blocks):
            tok[i, : len(b.token_ids[:L])] = b.token_ids[:L]
            lines.append(
                json.dumps(
                    {
                        "row": b.block_id,
                        "doc_id": b.doc_id,
                        "title": b.title,
                        "text": b.text,
                        "sentence_starts": [int(s) for s in b.sentence_starts],
                    }
                )
            )
        fs.makedirs(fs.join(folder, versions.SEGMENT))
        put(f"{versions.SEGMENT}/{versions.SEG_TOKENS}", _npy(tok))
        put(
            f"{versions.SEGMENT}/{versions.SEG_BLOCKS}",
            gzip.compress("\n".join(lines).encode(), 6, mtime=0),
        )
        segments.append({"version": k, "first_row": first, "rows": len(plan.new_blocks)})
    put(versions.LIVE, _npy(live))
    put(versions.DOCS, gzip.compress(json.dumps(plan.docs).encode(), 6, mtime=0))
    if scann_rows is not None:
        put(versions.SCANN_ROWS, _npy(np.asarray(scann_rows, np.int64)))
    _stage("segment")  # the blocks, live rows and documents written, no index yet
    extra = {"corpus_version": k, "frozen": bool(imani.get("frozen", False))}
    store.publish_index(
        fs.join(folder, versions.INDEX),
        int(imani["step"]),
        new_index,
        searcher=searcher,
        extra=extra,
    )
    num_rows = view.num_rows + len(plan.new_blocks)
    manifest = {
        "format": versions.FORMAT,
        "version": k,
        "parent": view.version,
        "base": versions.base_fingerprint(view.data_dir) | {"data_dir": view.data_dir},
        "segments": segments,
        "num_rows": num_rows,
        "num_live": len(live),
        "embedder": embedder,
        "index_step": int(imani["step"]),
        "scann_drift": int(drift),
        "changes_sha256": sha,
        "source": source,
        "counts": {
            "added": plan.added,
            "replaced": plan.replaced,
            "deleted": plan.deleted,
            "unchanged": plan.unchanged,
            "new_blocks": len(plan.new_blocks),
            "dropped_blocks": len(plan.dead),
        },
        "seconds": {k2: round(v, 3) for k2, v in t.items()},
        "created": time.time(),
        "files": files,
    }
    _stage("index")  # the version's index published inside it, no manifest yet
    if not remote:
        store._fsync_tree(folder)
    fs.write_bytes(fs.join(folder, versions.MANIFEST), json.dumps(manifest, indent=1).encode())
    _stage("manifest")  # committed in the temp folder, not yet renamed into place
    if not remote:
        if os.path.exists(final):
            fs.rmtree(folder)
            raise CorpusError(f"{final}: another update published it first; run again")
        os.rename(folder, final)
        fs.fsync_dir(root)
    return k
