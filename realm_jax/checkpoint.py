"""Orbax checkpoints: async saves of the train state (+ the data iterator), resume, partial
restore of one params subtree (the refresh job's document embedder)."""

from __future__ import annotations

import logging

import jax
import orbax.checkpoint as ocp

from realm_jax import workdir as paths

log = logging.getLogger(__name__)


def manager(workdir: str, *, keep: int = 3, with_data: bool = True, read_only: bool = False):
    """A CheckpointManager over <workdir>/checkpoints with items 'state' (+ 'data_iter')."""
    items = ("state", "data_iter") if with_data else ("state",)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=not read_only,
        enable_async_checkpointing=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(paths.checkpoint_dir(workdir), item_names=items, options=options)


def save(mgr, step: int, state, data_save_args=None, *, force: bool = False) -> bool:
    """Start an async save of `state` (and the data iterator) at `step`."""
    args = {"state": ocp.args.PyTreeSave(state)}
    if data_save_args is not None:
        args["data_iter"] = data_save_args
    saved = mgr.save(step, args=ocp.args.Composite(**args), force=force)
    if saved:
        log.info("checkpoint %d: save started", step)
    return saved


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (restore onto any mesh)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def restore(mgr, step: int, abstract_state, data_restore_args=None):
    """Restore the full state (onto the shardings in abstract_state) and the data iterator."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
    args = {"state": ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)}
    if data_restore_args is not None:
        args["data_iter"] = data_restore_args
    out = mgr.restore(step, args=ocp.args.Composite(**args))
    return out["state"]


def restore_latest(mgr, abstract_state, data_restore_args_fn=None):
    """(step, state) from the newest checkpoint that restores; None when there is none.

    A damaged checkpoint (truncated or missing files) is reported and the next older one is
    tried, so a crash that corrupted the last save loses only the steps since the one before.
    """
    steps = sorted(mgr.all_steps(), reverse=True)
    for i, step in enumerate(steps):
        try:
            data_args = data_restore_args_fn() if data_restore_args_fn else None
            return step, restore(mgr, step, abstract_state, data_args)
        except Exception as e:  # orbax/tensorstore raise various types for damaged files
            older = f"; trying checkpoint {steps[i + 1]}" if i + 1 < len(steps) else ""
            log.error(
                "checkpoint %d in %s cannot be restored (%s: %s)%s",
                step,
                mgr.directory,
                type(e).__name__,
                str(e)[:300],
                older,
            )
    if steps:
        raise RuntimeError(f"no checkpoint in {mgr.directory} could be restored (tried {steps})")
    return None


def restore_params_subtree(mgr, step: int, name: str, abstract_subtree):
    """Only params[name] (no optimizer state) from checkpoint `step`: a partial restore."""
    target = {"params": {name: abstract_subtree}}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    out = mgr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            )
        ),
    )
    return out["state"]["params"][name]
