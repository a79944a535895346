"""The trainer's side of the index: the row-sharded device matrix of block embeddings, swapped
for a newer published version (external mode), re-embedded on the trainer's own devices
(inprocess mode: the whole corpus between two steps), or re-embedded a slice a step (amortized
mode). A swap keeps the array's shape and sharding, so nothing recompiles.

refresh.mode=amortized is for a pod without a second slice for the refresh job. The paper
(Guu et al. 2020, section 3.4) refreshes asynchronously: a separate set of TPUs re-embeds the
13M blocks from the newest checkpoint about every 500 steps while the trainer never waits. Here
the trainer's own devices do it instead, spread over refresh.every steps: before every step,
each device re-embeds 1/refresh.every of its own rows (index/embedding.py slice_embed_fn, no
cross-device traffic) into a building matrix with the current parameters; after refresh.every
steps every row is new and the building matrix becomes the served index. The trainer never
stops for a whole pass (only for the first index, and once on a resume); each step costs
1/refresh.every of a pass more. The served index is made of slices embedded with the
parameters of the refresh.every steps before it was completed, so a row is 1 to
2*refresh.every - 1 steps old (the paper's asynchronous refresh: about 500 to 1000 at its
pace); the staleness the trainer reports is that of its oldest slice. A resume re-embeds the
whole corpus once with the restored parameters (the uninterrupted run's slices, made with
parameters of several older steps, are not in the checkpoint), so an amortized run's resume is
not bit-exact with the uninterrupted run; the other modes' resumes are (inprocess mode keeps
each index it embeds on disk for a resume between two refreshes)."""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from realm_jax import fs, sharding
from realm_jax import workdir as paths
from realm_jax.config import ConfigError
from realm_jax.index import retention, store
from realm_jax.index.embedding import (
    Progress,
    embed_blocks_fn,
    embed_blocks_in_parts_fn,
    index_dtype,
    pad_index,
    slice_embed_fn,
)
from realm_jax.model.realm import RealmModel

log = logging.getLogger("realm_jax.refresh")

MODES = ("external", "inprocess", "amortized")


class NoRefreshJob(ConfigError):
    """`train` with refresh.mode=external and no refresh job: nothing would ever publish."""

    def __init__(self, workdir: str, grace: float):
        super().__init__(
            f"no refresh job for {workdir}: refresh.mode=external and in {grace:.0f} s none "
            "published an index, reported progress or held the workdir's refresher lock. "
            f"Start one beside `train` (python -m realm_jax refresh --workdir {workdir}), run "
            f"trainer and refresh job together (python -m realm_jax local --workdir {workdir}), "
            "or refresh in this process (--config.refresh.mode=inprocess). Nothing is lost: the "
            "next run resumes from checkpoint 0"
        )


def refresh_job_running(workdir: str) -> bool:
    """Whether a refresh job holds the workdir's refresher lock (a local workdir; on an object
    store its progress reports are the sign)."""
    from realm_jax.lock import held_elsewhere

    return held_elsewhere(workdir, "refresher")


class IndexFeed:
    """The trainer's document index on device: embeddings + tokens, row-sharded."""

    def __init__(
        self,
        config,
        workdir: str,
        mesh,
        model: RealmModel,
        tokens,
        owner: str = "trainer",
        index_dir: str | None = None,
    ):
        """`tokens`: the block token table, the host array [N, Lb] (padded and put on the
        mesh here) or datasets.sharded_block_tokens(data_dir, mesh) (already row-sharded on
        `mesh`, each host having read only its own rows). index_dir: the index store read
        and written (an updated workdir's corpus version's own: versions.View.index_dir;
        default the workdir's)."""
        self.config, self.mesh, self.mode = config, mesh, config.refresh.mode
        if self.mode not in MODES:
            raise ValueError(f"refresh.mode must be one of {MODES}, got {self.mode!r}")
        self.workdir, self.owner = workdir, owner
        self.dir = index_dir or paths.index_dir(workdir)
        self.num_blocks = tokens.shape[0]
        if getattr(tokens, "rows", None) is None:  # the host table: padded, put on the mesh
            _, tok = pad_index(None, tokens, mesh)
            self.tokens = sharding.put_rows(tok, mesh)  # [Npad, Lb]
        else:  # datasets.RowShardedTokens: already padded and row-sharded on this mesh
            self.tokens = tokens.rows
        # mesh.index_dtype: the embeddings on device (bfloat16 halves them); published and
        # read as float32 rows, so a version serves either setting.
        self.dtype = index_dtype(config)
        self.embed = embed_blocks_fn(model, mesh, config.refresh.embed_batch_size, self.dtype)
        # the same pass in parts, with a progress line on a long one (reembed)
        self.embed_parts = embed_blocks_in_parts_fn(
            model, mesh, config.refresh.embed_batch_size, self.dtype
        )
        self.emb = None  # [Npad, D]
        if self.mode == "amortized":
            self.every = int(config.refresh.every)
            self.embed_slice = slice_embed_fn(
                model, mesh, self.every, config.refresh.embed_batch_size
            )
            self.building = None  # [Npad, D]: the next index, a slice a step
            self.building_from = -1  # the step of its oldest slice
        self.step = -1  # the checkpoint step the current embeddings came from
        self.last_swap_seconds = 0.0
        self.last_swap_bytes = 0  # bytes of embeddings this process read for its last swap
        self._bad: set[int] = set()  # versions rejected by a row checksum
        self._pending = None  # background_reads: (step, path, _Read) being read
        self._reading = f"{owner}-next"  # the lease on a version being read, until its swap
        self._lookout = _Lookout(self._look)  # process 0's looks beside the steps
        self._warned = -1
        self.health = None  # raises when `local`'s refresh job has died (lockstep waits)

    def _my_ranges(self) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        """(padded matrix shape, the row ranges this process's devices hold)."""
        shape = (int(self.tokens.shape[0]), int(self.config.model.proj_size))
        return shape, sharding.addressable_row_ranges(sharding.rows_sharding(self.mesh), shape)

    def _load_published(self, step: int, path: str) -> bool:
        """Swap in version `step`: each process reads and verifies only the rows its own
        devices hold (store.load_rows: per-block sha256), then every process agrees; a block
        that fails its checksum on any process rejects the version on all (False: the index
        is unchanged and the version is never tried again)."""
        read = _Read(path, self._my_ranges()[1])
        read.run()
        read.waited = read.seconds
        return self._swap_in(step, path, read)

    def _swap_in(self, step: int, path: str, read: _Read) -> bool:
        """Put a finished read on the devices (or reject the version everywhere); a collective."""
        t0 = time.time()
        if not _all_processes(not read.error):
            self._bad.add(step)
            log.warning("index: version %d rejected (%s)", step, read.error or "on another process")
            self._lease(None)
            return False
        shape, rows = self._my_ranges()[0], sharding.rows_sharding(self.mesh)
        parts = read.parts
        new = jax.make_array_from_callback(
            shape,
            rows,
            lambda idx: parts[(idx[0].start or 0, idx[0].stop or shape[0])].astype(self.dtype),
        )
        new.block_until_ready()
        self.emb, self.step = new, step
        self.last_swap_bytes = read.nbytes
        self.last_swap_seconds = time.time() - t0 + read.waited
        self._lease(step)
        log.info(
            "index: now using version %d (%s), read %.1f MB of its %.1f MB on this host in "
            "%.2fs%s, the trainer waited %.2fs",
            step,
            path,
            self.last_swap_bytes / 1e6,
            self.num_blocks * shape[1] * 4 / 1e6,
            read.seconds,
            " beside the training steps" if read.waited == 0 else "",
            self.last_swap_seconds,
        )
        return True

    def _lease(self, step: int | None) -> None:
        """Process 0, after a swap (`step`) or a rejection (None): the trainer's lease moves to
        the version now used and the lease taken for the read is dropped. Best effort: a
        storage error is logged (raising on process 0 alone would leave the others waiting)."""
        if jax.process_index() != 0:
            return
        try:
            if step is not None:
                retention.mark_in_use(self.dir, step, self.owner)
            retention.release(self.dir, self._reading)
        except OSError as e:
            log.warning("index: could not update the lease in %s (%s)", self.dir, e)

    def _look(self, newer_than: int):
        """Process 0: the newest valid version newer than `newer_than`, leased (owner
        `<owner>-next`) BEFORE any process reads it, so retention cannot delete it mid-read;
        checked again after the lease (retention may have removed it just before). None when
        there is none, or storage fails (logged: a later look tries again)."""
        try:
            found = self._newest(newer_than)
            if found is None:
                return None
            retention.mark_in_use(self.dir, found[0], self._reading)
            self._check_structure(found[1])
            return found
        except (store.CorruptIndexError, OSError) as e:
            log.warning("index: looking for a new version in %s failed (%s)", self.dir, e)
            return None

    def _check_structure(self, path: str) -> None:
        store.verify_version(
            path,
            expected_num_blocks=self.num_blocks,
            expected_dim=self.config.model.proj_size,
            checksum=False,  # each process checks the sha256 of the rows it reads
        )

    def _newest(self, newer_than: int):
        # structure only: each process verifies the rows it reads (_load_published)
        return store.latest_valid(
            self.dir,
            newer_than=newer_than,
            expected_num_blocks=self.num_blocks,
            expected_dim=self.config.model.proj_size,
            checksum=False,
            exclude=frozenset(self._bad),
        )

    @property
    def lockstep(self) -> bool:
        return self.mode == "external" and bool(self.config.refresh.get("lockstep", False))

    def start(self, params, step: int, health=None, no_job_grace: float = 0.0) -> None:
        """Get the index for `step` (the initial parameters at step 0, or a resume point).

        no_job_grace (external mode, `train` alone): when no index is published and no refresh
        job shows a sign of life (progress reported, or its lock held) within this many
        seconds, raise NoRefreshJob at once rather than wait refresh.wait_seconds."""
        if self.mode == "inprocess" and step % self.config.refresh.every:
            # A resume between two refreshes: the uninterrupted run was reading the index
            # re-embedded at the last multiple of refresh.every, which reembed kept on disk
            # (a 30x-stale-index ablation resumed at step 100 must not get a fresh index).
            last = step - step % self.config.refresh.every
            path = fs.join(self.dir, store.version_name(last))
            if self._exact_ready(last) and self._load_published(last, path):
                return
            log.warning(
                "index: version %d (the index the uninterrupted run reads at step %d) is not "
                "in %s: re-embedding with step %d's parameters, so this resume is not exact",
                last,
                step,
                self.dir,
                step,
            )
        if self.mode in ("inprocess", "amortized"):
            self.reembed(params, step)
            if self.mode == "amortized":
                self.building, self.building_from = self.emb, step
            return
        if self.lockstep:  # the version the uninterrupted run would be using at `step`
            self.health = health
            self._wait_for(step - step % self.config.refresh.every)
            return
        found = self._agreed_newest(-1)
        wait = self.config.refresh.wait_seconds
        grace = min(float(no_job_grace), wait) if no_job_grace else 0.0
        t0 = last_sign = next_log = time.time()
        heard = None  # the progress last logged
        seen = not grace  # a sign of a refresh job (only looked for with a grace)
        while found is None or not self._load_published(*found):
            # give up after wait_seconds with neither an index nor progress from the refresh
            # job, which reports after every part of the corpus (a first pass over 13M blocks
            # takes far longer than any fixed wait): process 0 decides for every process
            now = time.time()
            progress = store.read_progress(self.dir) if jax.process_index() == 0 else None
            if progress is not None and progress["updated"] > t0 - wait:
                last_sign = max(last_sign, min(progress["updated"], now))
            if not seen and jax.process_index() == 0:
                seen = progress is not None and progress["updated"] > t0 - wait
                seen = seen or refresh_job_running(self.workdir)
            verdict = 1 if now - last_sign > wait else 0
            if not seen and now - t0 > grace:
                verdict = 2
            verdict = _process_0s(verdict)
            if verdict == 2:
                raise NoRefreshJob(self.workdir, grace)
            if verdict:
                raise TimeoutError(
                    f"no valid index in {self.dir} and no progress from a refresh job for "
                    f"{wait:.0f}s: start the refresh job (`realm-jax refresh`), use `realm-jax "
                    "local`, or set --config.refresh.mode=inprocess or amortized"
                )
            if health is not None:
                health()  # raises when the refresh job has died
            if found is None:
                where = progress and (progress.get("checkpoint"), progress.get("phase"))
                where = where and (*where, progress.get("done"))
                if now >= next_log or where != heard:  # every 30 s, and at each part
                    log.info("waiting for the first index in %s: %s", self.dir, _said(progress))
                    next_log, heard = now + 30.0, where
                time.sleep(self.config.refresh.poll_seconds)
            found = self._agreed_newest(-1)

    def reembed(self, params, step: int) -> None:
        """In-process refresh: embed every block with the trainer's current parameters."""
        t0 = time.time()
        progress = Progress(log, f"index: re-embedding in-process at step {step}", self.num_blocks)
        self.emb = self.embed_parts(params, self.tokens, progress)  # waited for, part by part
        self.step, self.last_swap_seconds = step, time.time() - t0
        log.info(
            "index: re-embedded %d blocks in-process at step %d (%.2fs)",
            self.num_blocks,
            step,
            self.last_swap_seconds,
        )
        if self.mode == "inprocess":
            self._keep(step)

    def _keep(self, step: int) -> None:
        """Inprocess mode: publish the index just embedded as version `step` in the workdir's
        index folder (refresh.keep versions kept), for a resume before the next refresh (see
        start) and for `ask` and `export`. By row ranges (store.publish_rows): each process
        writes the rows its devices hold, nothing is gathered; a collective."""
        t0 = time.time()
        parts = [(at, rows.astype(np.float32)) for at, rows in sharding.owned_row_shards(self.emb)]
        if store.non_finite_rows(parts, self.num_blocks):  # the loop stops such a run
            log.warning("index: step %d's embeddings are not finite: not kept", step)
            return
        dim = int(self.emb.shape[1])
        store.publish_rows(self.dir, step, parts, self.num_blocks, dim, extra={"inprocess": True})
        if jax.process_index() == 0:
            try:
                retention.cleanup(self.dir, self.config.refresh.keep)
            except OSError as e:  # best effort: raising here alone would hang the others
                log.warning("index: retention in %s failed (%s)", self.dir, e)
        log.info("index: version %d kept in %s (%.2fs)", step, self.dir, time.time() - t0)

    def embed_next_slice(self, params, step: int) -> bool:
        """Amortized mode: re-embed slice step % refresh.every of every device's rows into the
        building matrix (dispatched, not waited for: it runs ahead of the train step on the
        device queue); when the last slice is in, serve the building matrix. True when the
        served index changed."""
        j = step % self.every
        if j == 0:
            self.building_from = step
        self.building = self.embed_slice(params, self.tokens, self.building, jnp.int32(j))
        if j != self.every - 1:
            return False
        self.emb, self.step = self.building, self.building_from
        self.last_swap_seconds = 0.0  # nothing waited for
        log.info(
            "index: slices of steps %d-%d complete, now serving them (amortized refresh)",
            self.building_from,
            step,
        )
        return True

    def due(self, step: int) -> bool:
        """Whether to look for a new index before `step`: every refresh.every steps in
        inprocess mode (it re-embeds), every refresh.check_every steps in external mode, so a
        published version is taken up within check_every steps (looking only every
        refresh.every steps let staleness run to about twice that)."""
        r = self.config.refresh
        if self.mode == "amortized":
            return True  # a slice every step
        every = r.every if self.mode == "inprocess" or self.lockstep else max(1, r.check_every)
        return step % every == 0

    def close(self) -> None:
        """Release the trainer's lease on its index version (the refresher may delete it)."""
        if self.mode == "external" and jax.process_index() == 0:
            if self.step >= 0:
                retention.release(self.dir, self.owner)
            retention.release(self.dir, self._reading)

    def _agreed_newest(self, newer_than: int | None = None):
        """The newest valid version newer than ours (or than `newer_than`), the same on every
        process: process 0 looks, the others follow (a version published between two
        processes' looks must not split them)."""
        after = self.step if newer_than is None else newer_than
        found = self._look(after) if jax.process_index() == 0 else None
        chosen = _process_0s(-1 if found is None else found[0])
        if chosen < 0:
            return None
        return chosen, fs.join(self.dir, store.version_name(chosen))

    def _exact_ready(self, step: int) -> bool:
        """Whether version `step` is published and verifies, the same answer on every process
        (process 0 looks, the others follow)."""
        ok = False
        if jax.process_index() == 0:
            path = fs.join(self.dir, store.version_name(step))
            try:
                self._check_structure(path)
                retention.mark_in_use(self.dir, step, self._reading)  # before any read
                self._check_structure(path)  # still there once leased
                ok = True
            except (store.CorruptIndexError, OSError):
                ok = False
        return bool(_process_0s(int(ok)))

    def _wait_for(self, step: int) -> None:
        """Lockstep: block until the refresh job publishes the index of checkpoint `step`, then
        load it (progress every 30 s; refresh.wait_seconds at most)."""
        r, t0, next_log = self.config.refresh, time.time(), 0.0
        while not self._exact_ready(step):
            waited = time.time() - t0
            if waited > r.wait_seconds:
                raise TimeoutError(
                    f"refresh.lockstep: index version {step} not published in {self.dir} "
                    f"after {r.wait_seconds:.0f}s: is the refresh job (`realm-jax refresh`) "
                    "running on this workdir?"
                )
            if self.health is not None:
                self.health()
            if waited >= next_log:
                log.info("lockstep: waiting for index version %d (%.0fs so far) ...", step, waited)
                next_log += 30.0
            time.sleep(min(r.poll_seconds, 0.5))
        path = fs.join(self.dir, store.version_name(step))
        if not self._load_published(step, path):
            raise store.CorruptIndexError(
                f"refresh.lockstep: index version {step} ({path}) fails its checksum"
            )

    def maybe_refresh(self, params, step: int) -> bool:
        """Swap in a newer index if one is published (re-embed in inprocess mode); True when
        the index changed."""
        if self.mode == "inprocess":
            self.reembed(params, step)
            return True
        if self.mode == "amortized":
            return self.embed_next_slice(params, step)
        if self.lockstep:
            if step != self.step:
                self._wait_for(step)
            return True
        if self.config.refresh.get("background_reads", True):
            if self._background_swap():
                return True
        else:
            found = self._agreed_newest()
            if found is not None and self._load_published(*found):
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

    def _background_swap(self) -> bool:
        """refresh.background_reads: at a look, swap in a version whose rows every process has
        read beside the training steps (True), else start reading the newest published one
        (the trainer does not wait for it; the swap happens at a later look)."""
        if self._pending is not None:
            step, path, read = self._pending
            if not _all_processes(read.done.is_set()):
                return False  # a host is still reading: look again at the next due step
            self._pending = None
            return self._swap_in(step, path, read)
        # process 0 lists the store in a background thread (never on the training thread)
        found = self._lookout.poll(self.step) if jax.process_index() == 0 else None
        chosen = _process_0s(-1 if found is None else found[0])
        found = None if chosen < 0 else (chosen, fs.join(self.dir, store.version_name(chosen)))
        if found is not None:
            read = _Read(found[1], self._my_ranges()[1])
            threading.Thread(target=read.run, name=f"index-read-{found[0]}", daemon=True).start()
            self._pending = (found[0], found[1], read)
            log.info("index: reading version %d beside the training steps", found[0])
        return False


class _Lookout:
    """Process 0's looks for a newer version (listing and checking the store, then the
    lease), each in a background thread, so the training thread never waits on storage: a
    due step starts a look, and a later due step takes its answer (once)."""

    def __init__(self, look):
        self.look, self.thread, self.found = look, None, None

    def poll(self, newer_than: int):
        """The answer of the last finished look ((step, path) or None); starts the next look
        when none is running and there was nothing to hand over."""
        if self.thread is not None:
            if self.thread.is_alive():
                return None
            self.thread = None
            found, self.found = self.found, None
            if found is not None and found[0] > newer_than:
                return found
        self.thread = threading.Thread(
            target=self._run, args=(newer_than,), name="index-lookout", daemon=True
        )
        self.thread.start()
        return None

    def _run(self, newer_than: int) -> None:
        self.found = self.look(newer_than)


class _Read:
    """One process's read of its rows of a published version (store.load_rows), run inline
    or in a background thread."""

    def __init__(self, path: str, ranges: list[tuple[int, int]]):
        self.path, self.ranges = path, ranges
        self.parts: dict = {}
        self.nbytes, self.seconds, self.error = 0, 0.0, ""
        self.done = threading.Event()
        self.waited = 0.0  # set by an inline reader: the trainer waited for all of it

    def run(self) -> None:
        t0 = time.time()
        try:
            self.parts, self.nbytes = store.load_rows(self.path, self.ranges)
        except (store.CorruptIndexError, OSError) as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - any failure rejects the version, never hangs
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.time() - t0
            self.done.set()


def _said(progress: dict | None) -> str:
    """The refresh job's progress record in words (the trainer's waiting line)."""
    if progress is None:
        return "no refresh job has reported yet"
    p, now = progress, time.time()
    if p.get("checkpoint") is None:  # started, not at a checkpoint yet
        return f"the refresh job is {p.get('phase')}, last heard {now - p['updated']:.0f}s ago"
    words = f"the refresh job is at checkpoint {p.get('checkpoint')}, {p.get('phase')}"
    done, of = p.get("done", 0), p.get("of", 1)
    if p.get("phase") == "embed" and of > 1:
        words += f" part {done + 1} of {of}"
        if done:
            eta = (now - p.get("since", now)) / done * (of - done)
            words += f" (about {eta / 60:.0f} min to go)"
    return words + f", last heard {now - p['updated']:.0f}s ago"


def _all_processes(ok: bool) -> bool:
    """True when `ok` holds on every process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return ok
    return bool(multihost_utils.process_allgather(np.int32(ok)).min())


def _process_0s(value: int) -> int:
    """Process 0's `value` on every process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))
