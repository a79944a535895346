"""`realm-jax import` and `realm-jax export`: REALM models of other toolkits into and out of a
workdir.

import: one or more --source -> a workdir holding checkpoint 0 with params only ({"params":
{query_embedder, [doc_embedder], reader}}; networks no source holds keep the config's fresh
initialisation from train.seed). A source is a HuggingFace folder (any class hf_import reads),
or the release's TF1 checkpoint or TF-Hub module (release_checkpoint: cc_news_pretrained/
embedder is a RealmEmbedder, cc_news_pretrained/bert a RealmKnowledgeAugEncoder,
orqa_{nq,wq}_model_from_realm a RealmForOpenQA: the fine-tuned query embedder and the reader
with its span head). Sources combine when each brings other networks (embedder + bert:
REALM's three); beside a RealmForOpenQA an embedder is the document embedder (ORQA's retriever
module, whose outputs block_emb holds).

The index: --block_emb (the release's encoded/encoded.ckpt, or the embedder module holding
encoded/), or a HF RealmForOpenQA's block_emb, is published as frozen index version 0 AS IS,
no re-embedding: row i is block i of the release's blocks.tfr, which `prepare
--config.data.corpus=.../blocks.tfr` keeps as block id i, so `evaluate` and `ask` (which name
blocks by their row) answer with the release's block ids. When the workdir's data are prepared
already, they must be release block records with exactly block_emb's rows; a QA config needs
the open-QA reader (span head) beside an index, as `evaluate` and `ask` read with it.

`evaluate` and `ask` read the workdir as a fine-tuned one; `train` and `finetune` start from it
in a new workdir with --config.model.init_from_realm=W (+ init_span_head_from_realm=true to
keep a span head). Everything is read and checked first: a bad input writes nothing.

export: a workdir's checkpoint (latest, best or step N) -> HF folders (hf_export), written
into a temporary folder and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import tempfile

import jax
import numpy as np
from flax import linen as nn

from realm_jax import checkpoint, fs, sharding
from realm_jax import workdir as paths
from realm_jax.interop import hf_export, hf_import, hub, release_checkpoint, tf_checkpoint
from realm_jax.model.bert import ModelConfig
from realm_jax.model.inputs import init_inputs
from realm_jax.model.realm import realm_model

log = logging.getLogger("realm_jax.hf")

NETWORKS = ("query_embedder", "doc_embedder", "reader")
WeightImportError = hf_import.WeightImportError  # the refusals below: one line, exit 2


def _fresh_params(config) -> dict:
    """Host params of every network, freshly initialised from train.seed (shapes do not depend
    on the input length, so short dummy inputs do)."""
    model = realm_model(config.model)
    boxed = jax.jit(lambda r: model.init(r, *init_inputs(8, 8, 8))["params"])(
        jax.random.key(config.train.seed)
    )
    return jax.tree.map(np.asarray, nn.meta.unbox(boxed))


def _has_versions(index_dir: str) -> bool:
    from realm_jax.index import store

    return fs.isdir(index_dir) and bool(store.list_versions(index_dir))


# ------------------------------------------------------------------------------------ sources


@dataclasses.dataclass
class Source:
    """One --source read into realm-jax params."""

    path: str
    got: hf_import.ImportedRealm
    form: str  # "HuggingFace folder" or "TF checkpoint <prefix>"
    run: dict  # an ORQA model_dir's params.json ({} for others)

    @property
    def has_span_head(self) -> bool:
        return self.got.reader is not None and "span" in self.got.reader


def _is_hf_folder(path: str) -> bool:
    names = ["config.json"]
    for name in hf_import.WEIGHT_FILES:
        names += [name, name + ".index.json"]
    return fs.isdir(path) and any(fs.isfile(fs.join(path, n)) for n in names)


def read_source(path: str, config) -> Source:
    """A HuggingFace folder or a release TF checkpoint / TF-Hub module, read and mapped."""
    from realm_jax import tokenization

    fs.check_buckets([path])
    if hub.looks_like_id(path):  # a HuggingFace hub id: its snapshot folder
        path = hf_import.resolve(path)
    if _is_hf_folder(path):
        hf_import.check_folder(path)
        got = hf_import.import_folder(path)
        hf_import.check_vocab(path, tokenization.VOCAB_PATH)
        return Source(path, got, "HuggingFace folder", {})
    if not (fs.exists(path) or fs.isfile(path + ".index")):
        where = "" if fs.is_remote(path) or os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise WeightImportError(
            f"{path}: no such file or folder{where} (give a HuggingFace folder, or the "
            "release's TF checkpoint or TF-Hub module)"
        )
    prefix = tf_checkpoint.resolve_prefix(path)
    kind, state, _ = release_checkpoint.read_release_checkpoint(path, with_block_emb=False)
    if vocab := release_checkpoint.module_vocab(path):
        hf_import.check_vocab(fs.dirname(vocab), tokenization.VOCAB_PATH)
    run = release_checkpoint.run_params(path)
    part = "embedder" if kind == "RealmEmbedder" else "reader"
    heads = ModelConfig.from_config(config.model, part).num_heads  # where the width cannot tell
    hf = release_checkpoint.hf_config(kind, state, fallback_heads=heads, run=run)
    return Source(path, hf_import.import_tensors(hf, state, path), f"TF checkpoint {prefix}", run)


def combine(sources: list[Source], share: bool) -> tuple[dict, dict]:
    """({network: params}, {network: the source it came from}) of several sources: a reader
    from at most one, an embedder from at most one, except that beside a RealmForOpenQA (the
    query embedder) an embedder is the document embedder."""

    def name(s: Source) -> str:
        return f"{s.path} ({s.got.cls})"

    readers = [s for s in sources if s.got.reader is not None]
    if len(readers) > 1:
        raise WeightImportError(
            f"{name(readers[0])} and {name(readers[1])} both hold a reader: give one of them"
        )
    embedders = [s for s in sources if s.got.query_embedder is not None]
    qa = [s for s in embedders if s.got.cls == "RealmForOpenQA"]
    nets, origin = {}, {}
    if len(embedders) == 2 and len(qa) == 1 and not share:
        doc = embedders[1 - embedders.index(qa[0])]
        if doc.got.doc_embedder is not None:
            raise WeightImportError(f"{name(doc)} holds two embedders: which embeds the documents?")
        nets["query_embedder"], origin["query_embedder"] = qa[0].got.query_embedder, qa[0]
        nets["doc_embedder"], origin["doc_embedder"] = doc.got.query_embedder, doc
    elif len(embedders) > 1:
        raise WeightImportError(
            f"{name(embedders[0])} and {name(embedders[1])} both hold an embedder: give one "
            "(or an open-QA model and the embedder of its documents, with separate embedders)"
        )
    elif embedders:
        e = embedders[0]
        nets["query_embedder"], origin["query_embedder"] = e.got.query_embedder, e
        if e.got.doc_embedder is not None and share:
            raise WeightImportError(
                f"{e.path}: a {e.got.cls} with separate query and document embedders, but "
                "config.model.share_embedders=true would keep one: set it false"
            )
        if not share:
            nets["doc_embedder"] = e.got.doc_embedder or e.got.query_embedder
            origin["doc_embedder"] = e
    if readers:
        nets["reader"], origin["reader"] = readers[0].got.reader, readers[0]
    return nets, origin


def check_sources(config, sources: list[Source]) -> None:
    """Each source's architecture against the config's (the activation and epsilons too, and
    a span head's width: a silent mismatch would change every output)."""
    ecfg = ModelConfig.from_config(config.model, "embedder")
    rcfg = ModelConfig.from_config(config.model, "reader")
    for s in sources:
        if s.got.query_embedder is not None:
            hf_import.check_fields(ecfg, s.got.fields, s.path, "config.model.embedder")
        if s.got.reader is not None:
            hf_import.check_fields(rcfg, s.got.fields, s.path, "config.model.reader")
        width = s.got.fields.get("max_span_width")
        if s.has_span_head and width is not None and width != config.model.max_span_width:
            raise WeightImportError(
                f"{s.path}: its span head reads spans of up to {width} wordpieces, "
                f"config.model.max_span_width is {config.model.max_span_width}: set it to {width}"
            )


# -------------------------------------------------------------------------------------- index


def read_index(sources: list[Source], block_emb_path: str) -> tuple[np.ndarray | None, str]:
    """(block_emb [num_blocks, proj], where it came from): --block_emb, else a source's own
    (a HF RealmForOpenQA's); (None, "") when there is none."""
    if block_emb_path:
        fs.check_buckets([block_emb_path])
        return release_checkpoint.read_block_emb(block_emb_path), block_emb_path
    holders = [s for s in sources if s.got.block_emb is not None]
    if len(holders) > 1:
        raise WeightImportError(f"{holders[0].path} and {holders[1].path} both hold a block_emb")
    return (holders[0].got.block_emb, holders[0].path) if holders else (None, "")


def check_index(config, workdir: str, emb: np.ndarray, where: str, sources, nets) -> str:
    """Refuse an index that `evaluate` and `ask` could not use as it is; returns a note on
    the blocks it indexes."""
    from realm_jax.data import datasets
    from realm_jax.interop import block_records

    proj = config.model.proj_size
    if emb.ndim != 2 or emb.shape[1] != proj:
        raise WeightImportError(
            f"{where}: block_emb has shape {tuple(emb.shape)}, config.model.proj_size is {proj}"
        )
    classes = ", ".join(f"{s.path} ({s.got.cls})" for s in sources)
    if "query_embedder" not in nets:
        raise WeightImportError(
            f"{classes}: no query embedder for block_emb's index to serve: give an embedder or "
            "an open-QA model (RealmForOpenQA) with it"
        )
    if config.get("task") == "qa" and not any(s.has_span_head for s in sources):
        raise WeightImportError(
            f"{classes}: no open-QA reader (span head), which `evaluate` and `ask` with a QA "
            "config answer with: import the open-QA model (RealmForOpenQA, e.g. the release's "
            "orqa_nq_model_from_realm) with the index, or retrieve only with configs/realm.py"
        )
    for s in sources:
        want = s.run.get("num_block_records")
        if want is not None and int(want) != len(emb):
            raise WeightImportError(
                f"{where}: block_emb has {len(emb)} rows, {s.path}'s params.json says "
                f"num_block_records={want}: not the index it was trained with"
            )
    ddir = paths.data_dir(config, workdir)
    summary = datasets.read_summary(ddir)
    if summary is None or not summary.get("complete"):
        return (
            f"prepare the release's {len(emb)} blocks before evaluate/ask: realm-jax prepare "
            f"--workdir {workdir} --config.data.corpus=.../blocks.tfr (row i = block i)"
        )
    corpus, count = summary.get("corpus", ""), summary["counts"]["blocks"]
    exported = [_export_index_record(s.path) for s in sources]
    if any(r and r.get("data_fingerprint") == summary.get("fingerprint") for r in exported):
        if count != len(emb):  # (a fingerprint match implies it; checked all the same)
            raise WeightImportError(f"{where}: {len(emb)} rows for {count} prepared blocks")
        return f"row i = block i of {ddir} (the export's data fingerprint matches)"
    if not block_records.is_release_corpus(corpus):
        raise WeightImportError(
            f"{ddir} was prepared from {corpus}, not the release's block records "
            "(blocks.tfr, block_records.npy): block_emb's rows would name other blocks"
        )
    if count != len(emb):
        raise WeightImportError(
            f"{where}: block_emb has {len(emb)} rows, the prepared corpus {corpus} "
            f"{count} blocks: they must be the same blocks, in the same order"
        )
    return f"row i = block i of {corpus}"


# ------------------------------------------------------------------------------------- import


def import_command(config, args) -> int:
    workdir = args.workdir
    given = [args.source] if isinstance(args.source, str) else list(args.source)
    sources = [read_source(path, config) for path in given]
    check_sources(config, sources)
    share = ModelConfig.from_config(config.model, "embedder").share_embedders
    nets, origin = combine(sources, share)
    if fs.isdir(paths.checkpoint_dir(workdir)) and fs.listdir(paths.checkpoint_dir(workdir)):
        raise ValueError(
            f"{paths.checkpoint_dir(workdir)} already holds checkpoints: import into a new "
            "--workdir (nothing was written)"
        )
    block_emb, where = read_index(sources, getattr(args, "block_emb", "") or "")
    note = ""
    if block_emb is not None:
        note = check_index(config, workdir, block_emb, where, sources, nets)
        if _has_versions(paths.index_dir(workdir)):
            raise ValueError(
                f"{paths.index_dir(workdir)} already holds an index: import into a new "
                "--workdir (nothing was written)"
            )

    params = _fresh_params(config)
    for name, loaded in nets.items():
        params[name] = hf_import.merge_params(params[name], loaded, name)
    mgr = checkpoint.manager(workdir, with_data=False)
    checkpoint.save(mgr, 0, {"params": params}, force=True)
    mgr.wait_until_finished()
    index_path = ""
    if block_emb is not None and jax.process_index() == 0:
        from realm_jax.index import store

        extra = {"frozen": True, "imported_from": where}
        index_path = store.publish_index(paths.index_dir(workdir), 0, block_emb, extra=extra)
    if jax.process_index() == 0:
        print(_summary(config, workdir, sources, nets, origin, params, (block_emb, index_path)))
        if note:
            print(f"  {note}")
        for s in sources:
            if block_emb is None and s.got.cls == "RealmForOpenQA" and s.run:
                module = s.run.get("retriever_module_path", "the retriever module")
                print(f"  no index: pass --block_emb {module} (its encoded/encoded.ckpt)")
    return 0


def _summary(config, workdir, sources, nets, origin, params, index) -> str:
    """What was imported from where, and what stays fresh (the command's printout)."""
    clss = " + ".join(s.got.cls for s in sources)
    lines = [
        f"imported {clss} from {', '.join(s.path for s in sources)} into "
        f"{paths.checkpoint_dir(workdir)} (step 0)"
    ]
    for s in sources:
        got = []
        for name in nets:
            if origin.get(name) is not s:
                continue
            have, net = params[name], nets[name]
            missing = [k for k in ("projection", "span") if k in have and k not in net]
            if "pooler" in have.get("bert", {}) and "pooler" not in net["bert"]:
                missing.append("pooler")
            got.append(name + (f" (fresh {', '.join(missing)})" if missing else ""))
        lines.append(f"  from {s.path} ({s.form}): {', '.join(got) or 'nothing'}")
    fresh = [n for n in NETWORKS if n in params and n not in nets]
    if fresh:
        lines.append(f"  freshly initialised (train.seed={config.train.seed}): {', '.join(fresh)}")
    block_emb, index_path = index
    if index_path:
        lines.append(f"  block_emb [{block_emb.shape[0]} x {block_emb.shape[1]}] -> {index_path}")
    lines.append(
        f"  use: evaluate/ask --workdir {workdir}; train/finetune --workdir NEW "
        f"--config.model.init_from_realm={workdir}"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ export


def _checkpoint(config, workdir: str, which: str):
    """(manager, step, description) of the checkpoint `which` names: latest, best or a step."""
    if which == "best":
        if not fs.isdir(paths.best_dir(workdir)) or "qa" not in config:
            raise FileNotFoundError(
                f"{workdir}: no best/ checkpoint (kept by `finetune` with a QA config); "
                "use --checkpoint latest or a step"
            )
        mgr = checkpoint.best_manager(
            paths.best_dir(workdir), config.qa.best_metric, read_only=True
        )
        step = mgr.best_step()
    else:
        if not fs.isdir(paths.checkpoint_dir(workdir)):
            raise FileNotFoundError(f"{workdir}: no checkpoints folder")
        mgr = checkpoint.manager(workdir, with_data=False, read_only=True)
        steps = sorted(mgr.all_steps())
        if which == "latest":
            step = steps[-1] if steps else None
        elif which.isdigit() and int(which) in steps:
            step = int(which)
        else:
            raise ValueError(
                f"--checkpoint {which!r}: give latest, best or one of the steps {steps}"
            )
    if step is None:
        raise FileNotFoundError(f"{workdir}: no {which} checkpoint yet")
    return mgr, step, f"{which} checkpoint {step}"


def _saved_tree(mgr, step: int) -> dict:
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(fs.join(str(mgr.directory), str(step), "state"))
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None) or {}
    return tree.get("params", {})


def _restore(config, mgr, step: int) -> dict:
    """{network: host params} of the networks checkpoint `step` holds; the config's shapes
    must match the saved ones (a clear error names the first that does not)."""
    saved = _saved_tree(mgr, step)
    model = realm_model(config.model)
    shapes = nn.meta.unbox(
        jax.eval_shape(lambda r: model.init(r, *init_inputs(8, 8, 8))["params"], jax.random.key(0))
    )
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    out = {}
    for name in NETWORKS:
        if name not in saved or name not in shapes:
            continue
        flat_saved = dict(jax.tree_util.tree_leaves_with_path(saved[name]))
        for path, want in jax.tree_util.tree_leaves_with_path(shapes[name]):
            have = flat_saved.get(path)
            if have is None or tuple(have.shape) != tuple(want.shape):
                where = name + jax.tree_util.keystr(path)
                raise ValueError(
                    f"checkpoint {step} does not match --config at {where}: saved "
                    f"{None if have is None else tuple(have.shape)}, config {tuple(want.shape)} "
                    "(pass the config the run was trained with)"
                )
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes[name]
        )
        out[name] = sharding.to_host(checkpoint.restore_params_subtree(mgr, step, name, target))
    return out


def run_fields(config) -> dict:
    """RealmConfig fields of the run beyond the architecture: candidates per query, and for a
    QA config the beams and the reader's input length."""
    from realm_jax.model.inputs import joint_len

    out = {"num_candidates": int(config.train.num_candidates)}
    if "qa" in config:
        from realm_jax.qa.evaluation import eval_reader_beam

        q = config.qa
        out.update(
            reader_beam_size=eval_reader_beam(q),  # HF's reader reads at inference
            searcher_beam_size=int(q.retriever_beam_size),
            reader_seq_len=int(q.reader_len or joint_len(config)),
        )
    return out


def _block_emb(workdir: str, dim: int) -> tuple[np.ndarray | None, str]:
    from realm_jax.index import store

    found = store.latest_valid(paths.index_dir(workdir), expected_dim=dim)
    if found is None:
        return None, ""
    return np.asarray(store.load_embeddings(found[1])), found[1]


def export_command(config, args) -> int:
    workdir, out = args.workdir, args.out
    from realm_jax.data import versions

    found = versions.latest(workdir)
    if found is not None:  # HF's block_emb row i is block_records row i: no tombstones there
        raise versions.CorpusError(
            f"{workdir}: its corpus was updated (corpus version {found[0]}); `export` writes "
            "a prepared corpus's index and blocks row for row, which an updated corpus no "
            "longer is: export the workdir before updating it, or re-prepare the edited corpus"
        )
    if fs.is_remote(out):
        raise ValueError(f"--out {out}: give a local folder (copy it to gs:// afterwards)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out} exists: give a new folder (nothing was written)")
    ecfg = ModelConfig.from_config(config.model, "embedder")
    rcfg = ModelConfig.from_config(config.model, "reader")
    mgr, step, what = _checkpoint(config, workdir, args.checkpoint)
    params = _restore(config, mgr, step)
    if not params:
        raise ValueError(f"{workdir}: {what} holds none of the networks {NETWORKS}")
    block_emb, index_path = (
        _block_emb(workdir, ecfg.proj_size) if "reader" in params else (None, "")
    )
    folders, notes = hf_export.export_folders(params, ecfg, rcfg, block_emb, run_fields(config))
    from realm_jax import tokenization

    vocab = tokenization.VOCAB_PATH if ecfg.vocab_size == tokenization.vocab_size() else ""
    if jax.process_index() != 0:
        return 0
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(
        prefix=f".{os.path.basename(out)}.tmp-{secrets.token_hex(3)}", dir=parent
    )
    records = _block_records(config, workdir, block_emb) if "openqa" in folders else None
    try:
        for name, (cfg, tensors) in folders.items():
            hf_export.write_folder(os.path.join(tmp, name), cfg, tensors, vocab)
        if records is not None:  # HF's RealmRetriever.from_pretrained(openqa/) reads it
            np.save(os.path.join(tmp, "openqa", BLOCK_RECORDS), records, allow_pickle=True)
            from realm_jax.data import datasets

            summary = datasets.read_summary(paths.data_dir(config, workdir))
            record = {"data_fingerprint": summary["fingerprint"], "num_blocks": len(records)}
            with open(os.path.join(tmp, "openqa", EXPORT_INDEX), "w") as f:
                json.dump(record, f)
        _open_permissions(tmp)  # mkdtemp and safetensors make owner-only files
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {what} of {workdir} to {out}: {', '.join(f + '/' for f in folders)}")
    if index_path and "openqa" in folders:
        print(f"  openqa/block_emb: {block_emb.shape[0]} x {block_emb.shape[1]} from {index_path}")
    if records is not None:
        print(f"  openqa/{BLOCK_RECORDS}: the {len(records)} blocks' texts (HF's RealmRetriever)")
    elif "openqa" in folders:
        print(
            f"  no openqa/{BLOCK_RECORDS}: the index's rows are not the blocks of "
            f"{paths.data_dir(config, workdir)} (not prepared there, or another count); "
            "HuggingFace's RealmRetriever needs them"
        )
    for note in notes:
        print(f"  {note}")
    return 0


BLOCK_RECORDS = "block_records.npy"
# beside an export's block_emb: which prepared data its rows are the blocks of, so that
# `import` (and realm_jax.load) of the export accepts that data dir and no other
EXPORT_INDEX = "realm_jax_index.json"


def _export_index_record(folder: str) -> dict | None:
    path = fs.join(folder, EXPORT_INDEX)
    if not fs.isfile(path):
        return None
    try:
        got = json.loads(fs.read_text(path))
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def _block_records(config, workdir: str, block_emb) -> np.ndarray | None:
    """HuggingFace's block_records.npy for the exported index: each block's text as bytes, row
    i = block i = row i of block_emb (a numpy object array; np.save stores it as a pickle, as
    HF's own file is). The text without its title, as the release's blocks.tfr and HF's file
    hold it (the index rows embed [CLS] title [SEP] text [SEP]). None when the prepared data is
    not there or does not match the index row for row."""
    from realm_jax.data import datasets

    ddir = paths.data_dir(config, workdir)
    if block_emb is None or datasets.read_summary(ddir) is None:
        return None
    src = datasets.blocks_source(ddir)
    if len(src) != block_emb.shape[0]:
        return None
    recs = src.__getitems__(range(len(src)))
    out = np.empty(len(recs), dtype=object)
    out[:] = [bytes(r["text"]) for r in recs]
    return out


def _open_permissions(root: str) -> None:
    """The umask's usual modes (0o755 folders, 0o644 files under umask 022) for a tree."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(folder, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(folder, f), 0o666 & ~umask)
