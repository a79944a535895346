"""`realm-jax import` and `realm-jax export`: HuggingFace REALM folders into and out of a
workdir.

import: a HuggingFace folder (any class hf_import reads) -> a workdir holding checkpoint 0 with
params only ({"params": {query_embedder, [doc_embedder], reader}}; networks the folder lacks
keep the config's fresh initialisation from train.seed) and, from a RealmForOpenQA, its
block_emb published as frozen index version 0. `evaluate` and `ask` read that workdir as a
fine-tuned one (with its corpus prepared there); `train` and `finetune` start from it in a new
workdir with --config.model.init_from_realm=W (+ init_span_head_from_realm=true to keep a
RealmReader's span head), as from any REALM workdir. Everything is read and checked first: a
bad input writes nothing.

export: a workdir's checkpoint (latest, best or step N) -> HF folders (hf_export), written
into a temporary folder and renamed into place.
"""

from __future__ import annotations

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
from realm_jax.model import hf_export, hf_import
from realm_jax.model.bert import ModelConfig
from realm_jax.model.inputs import init_inputs
from realm_jax.model.realm import realm_model

log = logging.getLogger("realm_jax.hf")

NETWORKS = ("query_embedder", "doc_embedder", "reader")


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


def import_command(config, args) -> int:
    source, workdir = args.source, args.workdir
    from realm_jax import tokenization

    hf_import.check_folder(source)
    got = hf_import.import_folder(source)
    hf_import.check_vocab(source, tokenization.VOCAB_PATH)
    ecfg = ModelConfig.from_config(config.model, "embedder")
    rcfg = ModelConfig.from_config(config.model, "reader")
    if got.query_embedder is not None:
        hf_import.check_fields(ecfg, got.fields, source, "config.model.embedder")
    if got.reader is not None:
        hf_import.check_fields(rcfg, got.fields, source, "config.model.reader")
    if got.doc_embedder is not None and ecfg.share_embedders:
        raise hf_import.WeightImportError(
            f"{source}: a {got.cls} with separate query and document embedders, but "
            "config.model.share_embedders=true would keep one: set it false"
        )
    if got.block_emb is not None and got.block_emb.shape[1] != ecfg.proj_size:
        raise hf_import.WeightImportError(
            f"{source}: block_emb has {got.block_emb.shape[1]} columns, config.model.proj_size "
            f"is {ecfg.proj_size}"
        )
    if fs.isdir(paths.checkpoint_dir(workdir)) and fs.listdir(paths.checkpoint_dir(workdir)):
        raise ValueError(
            f"{paths.checkpoint_dir(workdir)} already holds checkpoints: import into a new "
            "--workdir (nothing was written)"
        )
    if got.block_emb is not None and _has_versions(paths.index_dir(workdir)):
        raise ValueError(
            f"{paths.index_dir(workdir)} already holds an index: import into a new --workdir "
            "(nothing was written)"
        )

    params = _fresh_params(config)
    imported, fresh = [], []
    doc_name = "query_embedder" if ecfg.share_embedders else "doc_embedder"
    pairs = {
        "query_embedder": got.query_embedder,
        doc_name: got.doc_embedder or got.query_embedder,
        "reader": got.reader,
    }
    for name, loaded in pairs.items():
        if loaded is None:
            fresh.append(name)
            continue
        params[name] = hf_import.merge_params(params[name], loaded, name)
        missing = [k for k in ("projection", "span") if k in params[name] and k not in loaded]
        if "pooler" in params[name].get("bert", {}) and "pooler" not in loaded["bert"]:
            missing.append("pooler")
        imported.append(name + (f" (fresh {', '.join(missing)})" if missing else ""))

    mgr = checkpoint.manager(workdir, with_data=False)
    checkpoint.save(mgr, 0, {"params": params}, force=True)
    mgr.wait_until_finished()
    lines = [f"imported {got.cls} from {source} into {paths.checkpoint_dir(workdir)} (step 0)"]
    lines.append(f"  from the folder: {', '.join(imported) or 'nothing'}")
    if fresh:
        lines.append(f"  freshly initialised (train.seed={config.train.seed}): {', '.join(fresh)}")
    if got.block_emb is not None and jax.process_index() == 0:
        from realm_jax.index import store

        path = store.publish_index(
            paths.index_dir(workdir), 0, got.block_emb, extra={"frozen": True}
        )
        lines.append(f"  block_emb [{got.block_emb.shape[0]} x {got.block_emb.shape[1]}] -> {path}")
    lines.append(
        f"  use: evaluate/ask --workdir {workdir}; train/finetune --workdir NEW "
        f"--config.model.init_from_realm={workdir}"
    )
    if jax.process_index() == 0:
        print("\n".join(lines))
    return 0


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
        q = config.qa
        out.update(
            reader_beam_size=int(q.reader_beam_size),
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

    vocab = tokenization.VOCAB_PATH if ecfg.vocab_size == _vocab_lines() else ""
    if jax.process_index() != 0:
        return 0
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(
        prefix=f".{os.path.basename(out)}.tmp-{secrets.token_hex(3)}", dir=parent
    )
    try:
        for name, (cfg, tensors) in folders.items():
            hf_export.write_folder(os.path.join(tmp, name), cfg, tensors, vocab)
        _open_permissions(tmp)  # mkdtemp and safetensors make owner-only files
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {what} of {workdir} to {out}: {', '.join(f + '/' for f in folders)}")
    if index_path and "openqa" in folders:
        print(f"  openqa/block_emb: {block_emb.shape[0]} x {block_emb.shape[1]} from {index_path}")
    for note in notes:
        print(f"  {note}")
    return 0


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


def _vocab_lines() -> int:
    from realm_jax import tokenization

    with open(tokenization.VOCAB_PATH, encoding="utf-8") as f:
        return sum(1 for _ in f)
