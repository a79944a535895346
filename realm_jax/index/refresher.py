"""The refresh job: watches the trainer's document-embedder exports (<workdir>/embedder,
checkpoint.EmbedderExport) and its full checkpoints, restores only the document embedder from
the newest, embeds every block on its devices, and publishes an index version (embeddings + a
ScaNN searcher) atomically (index/store.py), keeping the last few (index/retention.py). The
version's step is the step of the export or checkpoint it came from."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from realm_jax import checkpoint, fs, runtime, sharding
from realm_jax import workdir as paths
from realm_jax.index import retention, store
from realm_jax.index.embedding import abstract_params, embed_blocks_fn, pad_index, slice_embed_fn
from realm_jax.lock import LEASE_SECONDS, workdir_lock
from realm_jax.model.bert import ModelConfig
from realm_jax.model.realm import doc_embedder_name

log = logging.getLogger("realm_jax.refresh")


def build_searcher(config, embeddings: np.ndarray):
    """A ScaNN searcher whose parameters come from config.refresh and the corpus size."""
    from realm_jax.index import scann as scann_index

    r = config.refresh
    params = scann_index.scann_params(
        len(embeddings),
        num_leaves=r.scann_num_leaves,
        leaves_to_search=r.scann_leaves_to_search,
        reorder=r.scann_reorder,
    )
    return scann_index.build_searcher(embeddings, k=10, **params)


class Refresher:
    """The refresh job: exports or checkpoints in, published index versions out."""

    def __init__(self, config, workdir: str, tokens, mesh=None, index_dir: str | None = None):
        """`tokens`: the host token table [N, Lb], or datasets.sharded_block_tokens(data_dir,
        mesh) on the `mesh` given (each host read only its own rows: `command`). index_dir:
        where versions are published (an updated workdir's corpus version's own index store,
        versions.View.index_dir; default the workdir's)."""
        self.config, self.workdir = config, workdir
        self.mesh = mesh or sharding.make_mesh(_all_devices_mesh(config))
        self.name = doc_embedder_name(ModelConfig.from_config(config.model, "embedder"))
        self.model, self.abstract = abstract_params(config, self.mesh, self.name)
        self.num_blocks = tokens.shape[0]
        if getattr(tokens, "rows", None) is None:  # the host table
            _, tok = pad_index(None, tokens, self.mesh)
            self.tokens = sharding.put_rows(tok, self.mesh)
        else:  # datasets.RowShardedTokens, already row-sharded on self.mesh
            self.tokens = tokens.rows
        self.embed = embed_blocks_fn(self.model, self.mesh, config.refresh.embed_batch_size)
        # a large corpus is embedded in parts, its progress written after each one (a trainer
        # waiting for its first index keeps waiting while it advances: index/feed.py)
        per_part = max(1, int(config.refresh.get("progress_every_blocks", 0) or self.num_blocks))
        self.parts = max(1, -(-self.num_blocks // per_part))
        if self.parts > 1:
            self.embed_part = slice_embed_fn(
                self.model, self.mesh, self.parts, config.refresh.embed_batch_size
            )
        self.dir = index_dir or paths.index_dir(workdir)
        fs.makedirs(self.dir)
        self._damaged: dict[tuple[str, int], tuple] = {}  # (kind, step) -> folder that failed

    def _progress(self, step: int, phase: str, since: float, done: int = 0) -> None:
        if jax.process_index() == 0:
            store.write_progress(
                self.dir,
                checkpoint=step,
                phase=phase,
                done=done,
                of=self.parts,
                blocks=self.num_blocks,
                since=since,
            )

    def refresh_once(self, mgr, step: int) -> str:
        """Embed the corpus with checkpoint `step`'s document embedder and publish it."""
        t0 = time.time()
        self._progress(step, "restore", t0)
        params = checkpoint.restore_params_subtree(mgr, step, self.name, self.abstract)
        return self._publish(step, params, t0, _step_dir(mgr, step), "checkpoint")

    def refresh_newest(self, mgr, last: int, exports=None) -> int | None:
        """Publish the newest export or checkpoint newer than `last` whose document embedder
        restores (an export first at equal steps: it is the smaller read). A damaged one is
        reported in one line, remembered (not retried, until the trainer replaces it) and
        passed over for the one before; an export that the trainer's retention deleted while
        it was read is passed over without that. The trainer owns both folders: nothing is
        moved. Returns the step embedded, None when none was."""
        sources = {"export": exports, "checkpoint": mgr}
        found = _candidates(last, sources)
        for i, (step, kind) in enumerate(found):
            source = sources[kind]
            folder = _folder_id(source, step)
            if not checkpoint.everywhere(
                folder is not None and self._damaged.get((kind, step)) != folder
            ):
                continue  # gone since the listing, or known damaged (on any process)
            t0 = time.time()
            self._progress(step, "restore", t0)
            params, reason = checkpoint.try_restore(
                checkpoint.restore_params_subtree, source, step, self.name, self.abstract
            )
            if reason is None:
                self._publish(step, params, t0, _step_dir(source, step), kind)
                return step
            then = "trying {1} {0}".format(*found[i + 1]) if i + 1 < len(found) else "skipping it"
            if kind == "export" and _folder_id(source, step) is None:
                log.info("refresh: export %d was deleted while read (retention); %s", step, then)
                continue
            self._damaged[(kind, step)] = folder
            log.error("refresh: %s %d cannot be restored (%s); %s", kind, step, reason, then)
        return None

    def _publish(self, step: int, params, t0: float, source: str, kind: str) -> str:
        """Embed and publish by row ranges: each process writes the rows its devices hold
        (store.publish_rows), so the matrix is never gathered on a device or a host; process
        0 alone reads it back when a ScaNN searcher is built. Returns the path on process 0."""
        t_restore = time.time() - t0
        emb = self._embed({self.name: params}, step, t0)
        parts = sharding.owned_row_shards(emb)  # this process's rows, device to host
        t_embed = time.time() - t0 - t_restore
        bad = store.non_finite_rows(parts, self.num_blocks)
        if bad:
            log.error(
                "refresh: %s %d (%s) gives non-finite embeddings for %d of %d blocks: "
                "not published; the trainer keeps its current index",
                kind,
                step,
                source,
                bad,
                self.num_blocks,
            )
            return ""
        self._progress(step, "publish", t0, self.parts)
        searcher_fn = None
        if self.config.refresh.build_scann:
            searcher_fn = lambda host: build_searcher(self.config, host)  # noqa: E731
        t1 = time.time()
        path = store.publish_rows(
            self.dir,
            step,
            parts,
            self.num_blocks,
            int(emb.shape[1]),
            searcher_fn=searcher_fn,
            extra={
                "source_checkpoint": source,  # the export's or the checkpoint's folder
                "source_kind": kind,  # "export" or "checkpoint"
                "embed_seconds": t_embed,
                "restore_seconds": t_restore,
            },
        )
        t_write = time.time() - t1
        if jax.process_index() != 0:
            return ""
        _cleanup(self.dir, self.config.refresh.keep)
        log.info(
            "refresh: published index %d from its %s (%d blocks, restore %.2fs, embed %.2fs "
            "= %.0f blocks/s, publish %.2fs, total %.2fs)",
            step,
            kind,
            self.num_blocks,
            t_restore,
            t_embed,
            self.num_blocks / max(t_embed, 1e-9),
            t_write,
            time.time() - t0,
        )
        return path

    def _embed(self, params, step: int, t0: float):
        """Every block's embedding [Npad, D] (row-sharded): one pass, or self.parts parts of
        every device's rows with the progress written after each."""
        if self.parts == 1:
            self._progress(step, "embed", t0)
            return self.embed(params, self.tokens)
        n, d = self.tokens.shape[0], self.config.model.proj_size
        zeros = jax.jit(
            lambda: jax.numpy.zeros((n, d), jax.numpy.float32),
            out_shardings=sharding.rows_sharding(self.mesh),
        )
        emb = zeros()
        for j in range(self.parts):
            self._progress(step, "embed", t0, j)
            emb = self.embed_part(params, self.tokens, emb, jax.numpy.int32(j))
            emb.block_until_ready()
        return emb

    def run(
        self, stop: threading.Event | None = None, max_versions: int | None = None, wd=None
    ) -> int:
        """Watch exports and checkpoints until `stop` is set (or max_versions published);
        returns the count.
        wd: the refresh job's progress watchdog (watchdog.py), beaten every poll; a
        refresh (embedding the corpus) is a slow stage, bounded by train.first_step_timeout_s."""
        stop = stop or threading.Event()

        def beat(name: str, slow: bool = False):
            return wd.stage(name, slow=slow) if wd is not None else contextlib.nullcontext()

        mgr = checkpoint.manager(self.workdir, with_data=False, read_only=True)
        # a workdir without exports (an older run, or refresh.export_every < 0): checkpoints
        exports = checkpoint.export_manager(self.workdir, read_only=True)
        versions = store.list_versions(self.dir)
        last = versions[-1] if versions else -1
        done = 0
        log.info(
            "refresh: watching %s and %s (last published index: %d)",
            paths.embedder_export_dir(self.workdir),
            paths.checkpoint_dir(self.workdir),
            last,
        )
        while not stop.is_set() and (max_versions is None or done < max_versions):
            with beat("checkpoint poll"):
                mgr.reload()
                exports.reload()
            with beat("refresh", slow=True):
                step = self.refresh_newest(mgr, last, exports)  # catch up: to the newest
            if step is not None:
                last = step
                done += 1
            else:
                stop.wait(self.config.refresh.poll_seconds)
            if wd is not None:
                wd.beat(last)
        return done


def _cleanup(index_dir: str, keep: int) -> None:
    """Retention on process 0, best effort: a storage error is logged, never raised (the
    other processes would wait for this one at their next collective)."""
    try:
        retention.cleanup(index_dir, keep)
    except OSError as e:
        log.warning("index: retention in %s failed (%s); old versions kept for now", index_dir, e)


def _candidates(last: int, sources: dict) -> list[tuple[int, str]]:
    """(step, kind) of every export and checkpoint newer than `last`, newest first, an export
    before a checkpoint of the same step; process 0's listing on every process (a step that
    one host lists and another does not yet must not split their collectives)."""
    kinds = list(sources)
    found = sorted(
        (
            (s, k)
            for k in kinds
            if sources[k] is not None
            for s in sources[k].all_steps()
            if s > last
        ),
        key=lambda sk: (-sk[0], kinds.index(sk[1])),
    )[:64]
    if jax.process_count() == 1:
        return found
    table = np.full((64, 2), -1, np.int64)
    for j, (s, k) in enumerate(found):
        table[j] = (s, kinds.index(k))
    table = multihost_utils.broadcast_one_to_all(table)
    return [(int(s), kinds[int(k)]) for s, k in table if s >= 0]


def _step_dir(mgr, step: int) -> str:
    return fs.join(os.fspath(mgr.directory), str(step))


def _folder_id(mgr, step: int) -> tuple[int, int] | None:
    """Which folder holds checkpoint `step` now (a damaged one the trainer moved aside and
    saved again is a new folder); None when it is gone. On an object store, where folders have
    no identity, the signature of the step's orbax metadata file (rewritten with the step)."""
    folder = _step_dir(mgr, step)
    try:
        if fs.is_remote(folder):
            return fs.signature(fs.join(folder, "_CHECKPOINT_METADATA"))
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _all_devices_mesh(config):
    """The refresh job shards blocks over all its devices along 'data'."""
    import ml_collections

    return ml_collections.ConfigDict({"axes": ("data", "model"), "shape": (-1, 1)})


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set `stop`, from a short-lived thread: Event.set takes the Event's lock,
    which this main thread may hold at that moment (inside Event.wait, between its steps), and
    a handler calling it directly then waits for itself forever. That hang left a refresher
    orphaned and deaf to SIGTERM when `local` was killed (acceptance/drills.py found it)."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: threading.Thread(target=stop.set, daemon=True).start())


def command(config, args) -> int:
    """`realm-jax refresh`: run the refresh job until SIGTERM/SIGINT (or --max_versions).

    Holds the workdir's refresher lock (LockError when another refresh job holds it); the
    trainer's in-process refresh mode builds a Refresher without it (it is the trainer)."""
    from realm_jax.data import datasets, versions

    stop = threading.Event()
    stop_on_signals(stop)
    with workdir_lock(args.workdir, "refresher", enabled=jax.process_index() == 0):
        runtime.barrier("refresher-lock", LEASE_SECONDS + 60)  # after process 0 holds it
        # the workdir's newest corpus version, as its trainer reads it (pretrain/commands.py):
        # an updated workdir's index versions go to that version's own store
        view = versions.open_view(config, args.workdir)
        if jax.process_index() == 0:  # a trainer waiting for its first index sees the job
            # alive while it loads the corpus (minutes at 13M blocks on a fresh slice)
            store.write_progress(
                view.index_dir, checkpoint=None, phase="loading the corpus", since=time.time(),
            )  # fmt: skip
        mesh = sharding.make_mesh(_all_devices_mesh(config))
        datasets.check_vocab(config, view.data_dir)
        tokens = view.device_tokens(mesh)  # the prepared data: each host its own rows
        log.info("refresh: %s", view)
        from realm_jax import watchdog

        # a job stuck while its JAX client keeps beating exits (75) for its supervisor to
        # restart; waiting for a checkpoint is not a stall (every poll beats)
        with watchdog.from_config(config.train, "refresh poll") as wd:
            Refresher(config, args.workdir, tokens, mesh, view.index_dir).run(
                stop, args.max_versions, wd
            )
    return 0
