"""Both sides of the index refresh.

`Refresher` is the refresh job: it watches the trainer's checkpoints, restores only the
document embedder, embeds every block on its devices, and publishes an index version
(embeddings + a ScaNN searcher) atomically (index.py).

`IndexFeed` is the trainer's side: it holds the row-sharded device matrix of block
embeddings, and every `refresh.every` steps swaps in the newest published version (external
mode) or re-embeds the corpus on the trainer's own devices (inprocess mode). The swap replaces
the array's contents with one of the same shape and sharding, so nothing recompiles.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from realm_jax import checkpoint, index, sharding
from realm_jax.models import ModelConfig, RealmModel, doc_embedder_name
from realm_jax.train_step import abstract_params, embed_blocks_fn, pad_index

log = logging.getLogger("realm_jax.refresh")


def index_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "index")


def _host_embeddings(emb: jax.Array, num_blocks: int) -> np.ndarray:
    """Sharded [Npad, D] device array -> host [N, D] (gathered across processes)."""
    if jax.process_count() > 1:
        emb = multihost_utils.process_allgather(emb, tiled=True)
    return np.asarray(jax.device_get(emb))[:num_blocks]


def build_searcher(config, embeddings: np.ndarray):
    """A ScaNN searcher whose parameters come from config.refresh and the corpus size."""
    from realm_jax import scann_index

    r = config.refresh
    params = scann_index.scann_params(
        len(embeddings),
        num_leaves=r.scann_num_leaves,
        leaves_to_search=r.scann_leaves_to_search,
        reorder=r.scann_reorder,
    )
    return scann_index.build_searcher(embeddings, k=10, **params)


class IndexFeed:
    """The trainer's document index on device: embeddings + tokens, row-sharded."""

    def __init__(
        self,
        config,
        workdir: str,
        mesh,
        model: RealmModel,
        tokens: np.ndarray,
        owner: str = "trainer",
    ):
        self.config, self.mesh, self.mode = config, mesh, config.refresh.mode
        if self.mode not in ("external", "inprocess"):
            raise ValueError(f"refresh.mode must be external or inprocess, got {self.mode!r}")
        self.dir, self.owner = index_dir(workdir), owner
        self.num_blocks = tokens.shape[0]
        _, tok = pad_index(None, tokens, mesh)
        self.tokens = sharding.put_rows(tok, mesh)  # [Npad, Lb]
        self.embed = embed_blocks_fn(model, mesh, config.refresh.embed_batch_size)
        self.emb = None  # [Npad, D]
        self.step = -1  # the checkpoint step the current embeddings came from
        self.last_swap_seconds = 0.0
        self._warned = -1

    def _load_published(self, step: int, path: str) -> None:
        t0 = time.time()
        host = index.load_embeddings(path)
        new = sharding.put_rows(sharding.pad_rows(host.astype(np.float32), self.mesh), self.mesh)
        new.block_until_ready()
        self.emb, self.step = new, step
        self.last_swap_seconds = time.time() - t0
        if jax.process_index() == 0:
            index.mark_in_use(self.dir, step, self.owner)
        log.info(
            "index: now using version %d (%s), swap took %.2fs", step, path, self.last_swap_seconds
        )

    def _newest(self, newer_than: int):
        return index.latest_valid(
            self.dir,
            newer_than=newer_than,
            expected_num_blocks=self.num_blocks,
            expected_dim=self.config.model.proj_size,
        )

    def start(self, params, step: int) -> None:
        """Get the index for `step` (the initial parameters at step 0, or a resume point)."""
        if self.mode == "inprocess":
            self.reembed(params, step)
            return
        found = self._newest(-1)
        deadline = time.time() + self.config.refresh.wait_seconds
        while found is None or found[0] < min(step, 0):
            if time.time() > deadline:
                raise TimeoutError(
                    f"no valid index in {self.dir} after {self.config.refresh.wait_seconds:.0f}s: "
                    "start the refresh job (`realm-jax refresh`), use `realm-jax local`, or set "
                    "--config.refresh.mode=inprocess"
                )
            log.info("waiting for the refresh job to publish an index in %s ...", self.dir)
            time.sleep(self.config.refresh.poll_seconds)
            found = self._newest(-1)
        self._load_published(*found)

    def reembed(self, params, step: int) -> None:
        """In-process refresh: embed every block with the trainer's current parameters."""
        t0 = time.time()
        self.emb = self.embed(params, self.tokens)
        self.emb.block_until_ready()
        self.step, self.last_swap_seconds = step, time.time() - t0
        log.info(
            "index: re-embedded %d blocks in-process at step %d (%.2fs)",
            self.num_blocks,
            step,
            self.last_swap_seconds,
        )

    def due(self, step: int) -> bool:
        """Whether to look for a new index before `step`: every refresh.every steps in
        inprocess mode (it re-embeds), every refresh.check_every steps in external mode, so a
        published version is taken up within check_every steps (looking only every
        refresh.every steps let staleness run to about twice that)."""
        r = self.config.refresh
        return step % (r.every if self.mode == "inprocess" else max(1, r.check_every)) == 0

    def close(self) -> None:
        """Release the trainer's lease on its index version (the refresher may delete it)."""
        if self.mode == "external" and self.step >= 0 and jax.process_index() == 0:
            index.release(self.dir, self.owner)

    def _agreed_newest(self):
        """The newest valid version newer than ours, the same on every process: process 0
        looks, the others follow (a version published between two processes' looks must not
        split them)."""
        found = self._newest(self.step) if jax.process_index() == 0 else None
        if jax.process_count() == 1:
            return found
        chosen = int(
            multihost_utils.broadcast_one_to_all(np.int64(-1 if found is None else found[0]))
        )
        if chosen < 0:
            return None
        return chosen, os.path.join(self.dir, index.version_name(chosen))

    def maybe_refresh(self, params, step: int) -> bool:
        """Swap in a newer index if one is published (re-embed in inprocess mode); True when
        the index changed."""
        if self.mode == "inprocess":
            self.reembed(params, step)
            return True
        found = self._agreed_newest()
        if found is not None:
            self._load_published(*found)
            return True
        stale = step - self.step
        if stale > self.config.refresh.max_staleness and self._warned != self.step:
            log.warning(
                "index staleness %d steps exceeds refresh.max_staleness %d: is the "
                "refresh job running and keeping up?",
                stale,
                self.config.refresh.max_staleness,
            )
            self._warned = self.step
        return False


class Refresher:
    """The refresh job: checkpoints in, published index versions out."""

    def __init__(self, config, workdir: str, tokens: np.ndarray, mesh=None):
        self.config, self.workdir = config, workdir
        self.mesh = mesh or sharding.make_mesh(_all_devices_mesh(config))
        self.name = doc_embedder_name(ModelConfig.from_config(config.model, "embedder"))
        self.model, self.abstract = abstract_params(config, self.mesh, self.name)
        self.num_blocks = tokens.shape[0]
        _, tok = pad_index(None, tokens, self.mesh)
        self.tokens = sharding.put_rows(tok, self.mesh)
        self.embed = embed_blocks_fn(self.model, self.mesh, config.refresh.embed_batch_size)
        self.dir = index_dir(workdir)
        os.makedirs(self.dir, exist_ok=True)

    def refresh_once(self, mgr, step: int) -> str:
        """Embed the corpus with checkpoint `step`'s document embedder and publish it."""
        t0 = time.time()
        params = checkpoint.restore_params_subtree(mgr, step, self.name, self.abstract)
        t_restore = time.time() - t0
        emb = self.embed({self.name: params}, self.tokens)
        host = _host_embeddings(emb, self.num_blocks)
        t_embed = time.time() - t0 - t_restore
        if jax.process_index() != 0:
            return ""
        searcher = build_searcher(self.config, host) if self.config.refresh.build_scann else None
        path = index.publish_index(
            self.dir,
            step,
            host,
            searcher=searcher,
            keep=self.config.refresh.keep,
            extra={
                "source_checkpoint": os.path.join(
                    checkpoint.checkpoint_dir(self.workdir), str(step)
                ),
                "embed_seconds": t_embed,
                "restore_seconds": t_restore,
            },
        )
        log.info(
            "refresh: published index %d (%d blocks, restore %.2fs, embed %.2fs = %.0f "
            "blocks/s, total %.2fs)",
            step,
            self.num_blocks,
            t_restore,
            t_embed,
            self.num_blocks / max(t_embed, 1e-9),
            time.time() - t0,
        )
        return path

    def run(self, stop: threading.Event | None = None, max_versions: int | None = None) -> int:
        """Watch checkpoints until `stop` is set (or max_versions published); returns count."""
        stop = stop or threading.Event()
        mgr = checkpoint.manager(self.workdir, with_data=False, read_only=True)
        versions = index.list_versions(self.dir)
        last = versions[-1] if versions else -1
        done = 0
        log.info(
            "refresh: watching %s (last published index: %d)",
            checkpoint.checkpoint_dir(self.workdir),
            last,
        )
        while not stop.is_set() and (max_versions is None or done < max_versions):
            mgr.reload()
            steps = mgr.all_steps()
            if steps and max(steps) > last:
                last = max(steps)  # catch up: skip straight to the newest checkpoint
                self.refresh_once(mgr, last)
                done += 1
            else:
                stop.wait(self.config.refresh.poll_seconds)
        return done


def _all_devices_mesh(config):
    """The refresh job shards blocks over all its devices along 'data'."""
    import ml_collections

    return ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (-1, 1)})
