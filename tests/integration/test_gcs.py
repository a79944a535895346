"""gs:// workdirs against a local GCS (fake-gcs-server, in memory, on a free loopback port;
tests/support/fake_gcs.py): the fs layer, the index publish protocol (manifest last; a writer killed
with SIGKILL mid-publish is never seen by readers and is reaped after its grace period),
prepared data (in process and on Beam), the trainer's lease object (two processes racing for a
free or expired lease: exactly one wins; a live holder's lease is never taken; a lost lease is
noticed), orbax checkpoints and TensorBoard event files, and `realm-jax train` itself on a
gs:// workdir and data dir: a full REALM train state (264 arrays, OCDBT) saved, resumed to
more steps, the losses equal to the same runs on local disk.

What fake-gcs-server cannot show, and so is not tested here: preconditions on DELETE, media
uploads and conditional GETs (it ignores them; the lease writes with multipart uploads, whose
preconditions it enforces, and release() compares the generation itself before deleting),
GCS's retries, latency and rate limits, and real GCS credentials (array_record's own GCS
client reads the prepared shards in place from the emulator: datasets.py's ShardedSource,
tests/test_shard_reads.py). Nothing here reaches real GCS.
"""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tests.support import fake_gcs

# gcsfs reads this when it is first imported (by whichever test module uses gs:// first), so
# here rather than in the fixture: its zonal-bucket probe asks a control-plane API that no
# local GCS serves (one warning per call otherwise).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "realm-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server (tests/support/fake_gcs.py) for the module: STORAGE_EMULATOR_HOST (gcsfs,
    google-cloud-storage) and TENSORSTORE_GCS_HTTP_URL (orbax's tensorstore) point at it,
    and are restored after."""
    with fake_gcs.module_server(tmp_path_factory, BUCKET) as server:
        yield server.url


@pytest.fixture
def root(gcs, request):
    """A fresh gs:// folder for one test."""
    return f"gs://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


def _emb(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


# ------------------------------------------------------------------------------ fs and paths


def test_fs_layer_on_gcs(root):
    from realm_jax import fs
    from realm_jax import workdir as paths

    assert paths.index_dir(root) == f"{root}/index" and paths.root(root + "/") == root
    assert fs.listdir(root) == [] and not fs.exists(f"{root}/a/x.json")
    fs.write_text(f"{root}/a/x.json", '{"k": 1}')
    fs.write_bytes(f"{root}/a/b/y.bin", b"\0" * 1000)
    assert json.loads(fs.read_text(f"{root}/a/x.json")) == {"k": 1}
    assert fs.isdir(f"{root}/a") and fs.isfile(f"{root}/a/x.json")
    assert not fs.isfile(f"{root}/a/b") and fs.size(f"{root}/a/b/y.bin") == 1000
    assert sorted(fs.listdir(f"{root}/a")) == ["b", "x.json"]
    assert list(fs.walk_files(f"{root}/a")) == ["b/y.bin", "x.json"]
    fs.rename(f"{root}/a/b", f"{root}/c/d")  # a folder: every object copied, then deleted
    fs.rename(f"{root}/c/d/y.bin", f"{root}/a/b/z.bin")  # one object
    assert (
        list(fs.walk_files(root)) == ["a/b/z.bin", "a/x.json"]
        and fs.size(f"{root}/a/b/z.bin") == 1000
    )
    fs.remove(f"{root}/a/x.json")
    fs.remove(f"{root}/a/x.json")  # already gone: fine
    fs.rmtree(f"{root}/a")
    assert fs.listdir(root) == []


# ------------------------------------------------------------------------- index publishing


def test_index_publish_and_read_on_gcs(root):
    from realm_jax import fs
    from realm_jax.index import store

    d = f"{root}/index"
    e10, e20 = _emb(50, 8, 0), _emb(50, 8, 1)
    path10 = store.publish_index(d, 10, e10, extra={"source_checkpoint": "c/10"})
    path20 = store.publish_index(d, 20, e20)
    assert path20 == f"{d}/step_00000020"
    assert store.latest_valid(d, expected_num_blocks=50, expected_dim=8) == (20, path20)
    np.testing.assert_array_equal(store.load_embeddings(path20), e20)
    manifest = json.loads(fs.read_bytes(f"{path10}/manifest.json"))
    assert manifest["format"] == 3 and manifest["source_checkpoint"] == "c/10"
    for rel, entry in manifest["files"].items():  # sizes as the bucket has them
        assert fs.size(f"{path10}/{rel}") == entry["size"]
    # A damaged newer version (same size, other bytes) is skipped for the one before.
    raw = bytearray(fs.read_bytes(f"{path20}/embeddings.npy"))
    raw[-1] ^= 0xFF
    fs.write_bytes(f"{path20}/embeddings.npy", bytes(raw))
    store._verified.clear()
    assert store.latest_valid(d) == (10, path10)
    with pytest.raises(store.CorruptIndexError, match="checksum mismatch"):
        store.load_embeddings(path20)
    # Publishing the same step again replaces the damaged version.
    assert store.publish_index(d, 20, e20) == path20
    assert store.latest_valid(d) == (20, path20)


def test_index_published_by_row_ranges_on_gcs(root):
    """Format 4 on an object store: the parts written in place under rows/, the manifest last;
    any range reads back equal, a damaged part is found by the reader of its rows, and the
    version is skipped for the one before; publishing the step again replaces it."""
    from realm_jax import fs
    from realm_jax.index import store

    d, emb = f"{root}/index-rows", _emb(50, 8, 4)
    parts = [(0, emb[:13]), (13, emb[13:26]), (26, emb[26:39]), (39, emb[39:])]
    path = store.publish_rows(d, 30, parts, 50, 8, block_rows=4)
    assert store.verify_version(path)["format"] == 4
    assert store.latest_valid(d, expected_num_blocks=50, expected_dim=8) == (30, path)
    np.testing.assert_array_equal(store.load_embeddings(path), emb)
    got, read = store.load_rows(path, [(10, 30)])
    np.testing.assert_array_equal(got[(10, 30)], emb[10:30])
    rel = store.part_name(26, 39)
    raw = bytearray(fs.read_bytes(f"{path}/{rel}"))
    raw[-1] ^= 0xFF
    fs.write_bytes(f"{path}/{rel}", bytes(raw))
    store._verified.clear()
    with pytest.raises(store.CorruptIndexError, match="rows 38-39"):
        store.load_rows(path, [(30, 40)])
    assert store.latest_valid(d) is None
    assert store.publish_rows(d, 30, parts, 50, 8) == path
    np.testing.assert_array_equal(store.load_embeddings(path), emb)


def test_index_with_scann_searcher_on_gcs(root, tmp_path):
    pytest.importorskip("scann")
    from realm_jax import fs
    from realm_jax.index import scann as scann_index
    from realm_jax.index import store

    db = _emb(300, 16, 3)
    searcher = scann_index.build_searcher(db, k=5)
    path = store.publish_index(f"{root}/index", 9, db, searcher=searcher)
    manifest = store.verify_version(path)
    assert "scann/dataset.npy" in manifest["files"] and manifest["scann"] is True
    local = tmp_path / "scann"
    fs.download_tree(f"{path}/scann", str(local), list(fs.walk_files(f"{path}/scann")))
    q = _emb(20, 16, 4)
    loaded = scann_index.load_searcher(str(local))
    np.testing.assert_array_equal(
        scann_index.search(loaded, q, 5)[0], scann_index.search(searcher, q, 5)[0]
    )
    fs.remove(f"{path}/scann/dataset.npy")
    with pytest.raises(store.CorruptIndexError, match="ScaNN file scann/dataset.npy missing"):
        store.verify_version(path, checksum=False)


KILLED_WRITER = """
import sys, time
import numpy as np
from realm_jax import fs
from realm_jax.index import store

index_dir, stage = sys.argv[1], sys.argv[2]
emb = np.random.default_rng(7).standard_normal((20000, 64)).astype(np.float32)
if stage == "before_manifest":  # every data file written, the commit marker not yet
    real = store._write_json_atomic
    def stall(path, obj):
        if path.endswith(store.MANIFEST):
            print("STALLED", flush=True)
            time.sleep(600)
        real(path, obj)
    store._write_json_atomic = stall
else:  # in the middle of the embeddings' upload
    real_open = fs.open
    class Slow:
        def __init__(self, f): self.f = f
        def write(self, data):
            n = self.f.write(data)
            print("WRITING", flush=True)
            time.sleep(600)
            return n
        def __enter__(self): return self
        def __exit__(self, *a): return self.f.__exit__(*a)
    fs.open = lambda p, mode="rb": Slow(real_open(p, mode)) if "w" in mode else real_open(p, mode)
store.publish_index(index_dir, 20, emb)
"""


@pytest.mark.parametrize("stage", ["mid_upload", "before_manifest"])
def test_killed_writer_is_never_read(root, stage, monkeypatch):
    from realm_jax import fs
    from realm_jax.index import retention, store

    d = f"{root}/index"
    e10 = _emb(20000, 64, 1)
    path10 = store.publish_index(d, 10, e10)
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, d, stage],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        line = writer.stdout.readline().strip()
        assert line in ("STALLED", "WRITING"), writer.stderr.read()
        assert store.latest_valid(d) == (10, path10)  # a reader while the writer runs
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        writer.stderr.close()
    partial = f"{d}/step_00000020"
    names = fs.listdir(partial)
    assert ".writer" in names and "manifest.json" not in names
    if stage == "before_manifest":
        assert fs.size(f"{partial}/embeddings.npy") == 128 + 20000 * 64 * 4  # all data there
    assert store.list_versions(d) == [10, 20]
    assert store.latest_valid(d) == (10, path10)  # readers never see it
    with pytest.raises(store.UncommittedVersionError):
        store.load_embeddings(partial)
    np.testing.assert_array_equal(store.load_embeddings(path10), e10)
    # Retention leaves it alone during its grace period (a writer may still be at work) ...
    assert retention.cleanup(d, keep=1) == [] and fs.isdir(partial)
    # ... and removes it after.
    monkeypatch.setattr(retention, "TMP_MAX_AGE_S", -1.0)
    assert retention.cleanup(d, keep=1) == [partial]
    assert store.list_versions(d) == [10]
    e20 = _emb(20000, 64, 2)
    assert store.publish_index(d, 20, e20) == partial  # a new writer publishes it whole
    assert store.latest_valid(d) == (20, partial)
    np.testing.assert_array_equal(store.load_embeddings(partial), e20)


def test_leases_and_retention_on_gcs(root):
    from realm_jax.index import retention, store

    d = f"{root}/index"
    for step in (1, 2, 3, 4):
        store.publish_index(d, step, _emb(10, 4, step))
    retention.mark_in_use(d, 1, "trainer")
    assert retention.leased_steps(d) == {1}
    removed = retention.cleanup(d, keep=2)
    assert removed == [f"{d}/step_00000002"] and store.list_versions(d) == [1, 3, 4]
    retention.release(d, "trainer")
    assert retention.cleanup(d, keep=2) == [f"{d}/step_00000001"]


def test_version_published_by_the_old_local_protocol_still_loads(tmp_path):
    """Format 1 (before the manifest listed every file) verifies and loads as it did."""
    from realm_jax.index import store

    emb = _emb(30, 8, 5)
    path = store.publish_index(str(tmp_path), 5, emb)
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    del manifest["files"]
    manifest["format"] = 1
    with open(mpath, "w") as f:
        json.dump(manifest, f)
    store._verified.clear()
    assert store.verify_version(path)["format"] == 1
    assert store.latest_valid(str(tmp_path)) == (5, path)
    np.testing.assert_array_equal(store.load_embeddings(path), emb)


# --------------------------------------------------------------------------- prepared data


@pytest.fixture(scope="module")
def sample_config():
    from realm_jax.config import load_config

    return load_config(
        os.path.join(REPO, "configs/realm.py:smoke"),
        [f"data.corpus={REPO}/data/sample/corpus.jsonl", "data.masking=random"],
    )


def test_prepare_to_gcs_and_read_back(root, sample_config, tmp_path, monkeypatch):
    from realm_jax import fs
    from realm_jax.data import datasets, prepare

    monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path / "cache"))
    local, remote = str(tmp_path / "data"), f"{root}/data"
    prepare.prepare(sample_config, local)
    summary = prepare.prepare(sample_config, remote)
    assert fs.exists(f"{remote}/summary.json") and summary["files"]
    for rel, size in summary["files"].items():
        assert fs.size(f"{remote}/{rel}") == size
    want, got = datasets.load_blocks(local), datasets.load_blocks(remote)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
    assert len(datasets.examples_source(remote)) == len(datasets.examples_source(local))
    # A dataset file gone: a clear error, not a TFDS traceback.
    rel = next(r for r in summary["files"] if "array_record" in r)
    fs.remove(f"{remote}/{rel}")
    datasets._checked.clear()
    with pytest.raises(datasets.PrepareError, match="is damaged: .* is missing"):
        datasets.load_summary(remote)
    # No summary (an upload interrupted before its commit marker): an incomplete prepare.
    fs.remove(f"{remote}/summary.json")
    with pytest.raises(datasets.PrepareError, match="incomplete"):
        datasets.load_summary(remote)


@pytest.mark.system  # CI: Beam = in process, Beam on gs:// inputs
def test_beam_prepare_builds_in_place_on_gcs(root, tmp_path, monkeypatch):
    """`prepare` on Beam into a gs:// data_dir: worker processes write their array_record
    shards into the build folder on the object store themselves, as Dataflow's workers must
    (Beam's own gs:// file system, pointed at fake-gcs-server), in 2 windows of shards of 100
    records; the driver names the shards and writes dataset_info there. The records equal the
    in-process path's, and nothing of the build is left beside the datasets. Beam renames
    through GCS's batch API: its requests get the Content-ID parts fake-gcs-server needs, here
    and in the workers (tests/support/fake_gcs.py)."""
    pytest.importorskip("apache_beam")
    fake_gcs.patch_storage_batch()
    pythonpath = [fake_gcs.batch_patch_dir(), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in pythonpath if p))
    from realm_jax import fs
    from realm_jax.config import load_config
    from realm_jax.data import prepare
    from tests.support.runs import (
        assert_same_prepared as _assert_same,
    )  # record for record, and the summaries

    monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path / "cache"))
    over = [f"data.corpus={REPO}/data/sample/corpus.jsonl", "data.masking=random"]
    cfg = load_config(os.path.join(REPO, "configs/realm.py:smoke"), over)
    local, remote = str(tmp_path / "data"), f"{root}/data"
    want = prepare.prepare(cfg, local)
    beam = ["data.engine=beam", "data.beam_chunk_kb=64", "data.beam_window_kb=192"]
    cfg = load_config(os.path.join(REPO, "configs/realm.py:smoke"), over + beam)
    cfg.data.beam_shard_records = 100
    opts = "--direct_num_workers=2 --direct_running_mode=multi_processing"
    fs.write_bytes(f"{remote}/.prepare-tmp-1/blocks/x", b"left by a killed prepare")
    got = prepare.prepare(cfg, remote, beam_options=opts)
    assert got["engine"] == "beam" and got["counts"] == want["counts"]
    assert sorted(fs.listdir(remote)) == ["blocks", "eval_examples", "examples", "summary.json"]
    info = json.loads(fs.read_text(f"{remote}/blocks/realm_blocks/1.0.0/dataset_info.json"))
    assert len(info["splits"][0]["shardLengths"]) > 6  # 2 windows' shards, joined
    assert got["counts"]["eval_examples"] > 0  # so all three datasets are compared below
    _assert_same(local, remote)


# ---------------------------------------------------------------------- the trainer's lease


HOLD_LEASE = """
import sys, time
from realm_jax import lock
lock.LEASE_SECONDS, lock.RENEW_SECONDS = float(sys.argv[2]), 0.2
with lock.workdir_lock(sys.argv[1], "trainer"):
    print("HELD", flush=True)
    time.sleep(600)
"""


def test_trainer_lease_on_gcs(root):
    from realm_jax import fs, lock
    from realm_jax import workdir as paths

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEASE, root, "2.0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "HELD", holder.stderr.read()
        time.sleep(2.5)  # past the first expiry: only the holder's renewals keep it
        with pytest.raises(lock.LockError, match=f"pid {holder.pid} on host"):
            with lock.workdir_lock(root, "trainer"):
                pytest.fail("took a lease another process holds")
        with lock.workdir_lock(root, "refresher"):  # another role: its own lease
            pass
    finally:
        holder.send_signal(signal.SIGKILL)  # no release: the lease must expire by itself
        holder.wait()
        holder.stdout.close()
        holder.stderr.close()
    # At once, as a relaunch after a crash does: the dead holder's lease is not refused but
    # watched, and taken over when it runs out unrenewed (within its 2 s period).
    t0 = time.time()
    with lock.workdir_lock(root, "trainer"):  # expired: taken over
        held = json.loads(fs.read_bytes(paths.lock_path(root, "trainer")))
        assert held["pid"] == os.getpid() and held["expires"] > time.time()
    assert time.time() - t0 < 10
    assert not fs.exists(paths.lock_path(root, "trainer"))  # released on exit
    with lock.workdir_lock(root, "trainer"):  # so the next one takes it at once
        pass


# A trainer racing for the lease: one per process, driven over stdin ("acquire T": take the
# lease at wall-clock time T, both racers at once; "release"), answering one line each.
RACER = """
import sys, time
from realm_jax import lock
held = None
print("READY", flush=True)
for line in sys.stdin:
    command, *arg = line.split()
    if command == "acquire":
        lease = lock.ObjectLease(sys.argv[1], "trainer")
        time.sleep(max(0.0, float(arg[0]) - time.time() - 0.002))
        while time.time() < float(arg[0]):  # the last 2 ms: spin, for a sharp start
            pass
        try:
            lease.acquire()
        except lock.LockError as e:
            print("LOST", "taken" if "just taken" in str(e) else "held", flush=True)
        else:
            held = lease
            print("WON", flush=True)
    elif command == "release":
        held.release()
        held = None
        print("RELEASED", flush=True)
"""

RACE_ROUNDS = 30


def _line(proc: subprocess.Popen) -> str:
    """The process's next output line; fails with its stderr when it has died."""
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"racer exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
    return line


def _ask(proc: subprocess.Popen, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return _line(proc)


def test_two_trainers_race_for_a_lease_and_exactly_one_wins(root):
    """Two processes take the same lease at the same instant, RACE_ROUNDS times: a free lease
    (no object) and an expired one in turn. Each round exactly one wins; the other, asked
    again, is refused while the winner holds it; the winner's release frees it."""
    from realm_jax import fs, lock

    url = f"{root}/trainer.lock"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, url],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    lost_how = {"held": 0, "taken": 0}  # read a fresh lease / lost the write's precondition
    try:
        for racer in racers:
            assert _line(racer) == "READY"
        for round_ in range(RACE_ROUNDS):
            expired = round_ % 2 == 1
            if expired:  # a holder's lease that ran out a minute ago
                lock.ObjectLease(url, "trainer", ttl=-60.0).acquire()
            start = f"acquire {time.time() + 0.05}"
            for racer in racers:
                racer.stdin.write(start + "\n")
                racer.stdin.flush()
            answers = [_line(racer) for racer in racers]
            assert sorted(a.split()[0] for a in answers) == ["LOST", "WON"], (round_, answers)
            winner, loser = (racers[0], racers[1]) if answers[0] == "WON" else racers[::-1]
            lost_how[answers[racers.index(loser)].split()[1]] += 1
            held = json.loads(fs.read_bytes(url))
            assert held["pid"] == winner.pid and held["expires"] > time.time() + 30
            # A live holder's lease is not taken, however often it is asked for.
            assert _ask(loser, f"acquire {time.time()}") == "LOST held"
            assert _ask(winner, "release") == "RELEASED"
            assert not fs.exists(url), round_
    finally:
        for racer in racers:
            racer.stdin.close()
            racer.wait(timeout=30)
            racer.stdout.close()
            racer.stderr.close()
    print(
        f"lease race: the loser read a fresh lease {lost_how['held']} times, lost the write "
        f"race {lost_how['taken']} times in {RACE_ROUNDS} rounds"
    )


@pytest.mark.parametrize("expired", [False, True])
def test_a_lease_taken_between_read_and_write_is_not_overwritten(root, expired):
    """The race made certain: another process takes the lease after this one read it free
    (or expired) and before this one writes. The write's generation precondition fails:
    LockError, and the other keeps the lease."""
    from realm_jax import lock

    url = f"{root}/trainer.lock"
    if expired:
        lock.ObjectLease(url, "trainer", ttl=-60.0).acquire()
    slow, fast = lock.ObjectLease(url, "trainer"), lock.ObjectLease(url, "trainer")
    write = slow._write

    def write_after_the_other(generation: int) -> None:
        fast.acquire()
        write(generation)

    slow._write = write_after_the_other
    with pytest.raises(lock.LockError, match="was just taken by another trainer"):
        slow.acquire()
    assert slow.generation is None
    generation, info = fast._current()
    assert generation == fast.generation and info["token"] == fast.token
    fast.release()
    assert fast._current() is None


def test_a_holder_notices_its_lost_lease_and_leaves_the_new_one(root):
    """A holder that stopped renewing past its expiry: another takes the lease over; the old
    holder's next renewal says it lost it, and its release, whether or not it noticed, does
    not delete the new holder's lease (fake-gcs-server ignores the DELETE's precondition, so
    this is release()'s own generation check)."""
    from realm_jax import lock

    url = f"{root}/trainer.lock"
    for noticed in (True, False):
        old, new = lock.ObjectLease(url, "trainer", ttl=0.2), lock.ObjectLease(url, "trainer")
        old.acquire()
        with pytest.raises(lock.LockError, match="is held by another trainer"):
            new.acquire()
        time.sleep(0.3)
        new.acquire()  # expired: taken over
        if noticed:
            assert not old.renew() and old.generation is None
        old.release()
        assert new._current()[1]["token"] == new.token
        assert new.renew()
        new.release()
        assert new._current() is None


def test_a_renewal_retried_after_it_landed_keeps_the_lease(root, monkeypatch):
    """google-cloud-storage retries a conditional upload after a timeout or a 5xx; when the
    first attempt had landed, the retry fails its precondition on the holder's own write.
    Simulated here (the write lands, then PreconditionFailed): the holder keeps its lease."""
    from google.api_core import exceptions
    from google.cloud.storage import Blob

    from realm_jax import lock

    lease = lock.ObjectLease(f"{root}/trainer.lock", "trainer")
    lease.acquire()
    upload = Blob.upload_from_string

    def landed_then_412(self, *args, **kwargs):
        upload(self, *args, **kwargs)
        raise exceptions.PreconditionFailed("the retry of a write that landed")

    monkeypatch.setattr(Blob, "upload_from_string", landed_then_412)
    before = lease.generation
    assert lease.renew()
    monkeypatch.undo()
    assert lease.generation != before and lease.generation == lease._current()[0]
    other = lock.ObjectLease(f"{root}/trainer.lock", "trainer")
    with pytest.raises(lock.LockError, match="is held by another trainer"):
        other.acquire()
    lease.release()
    assert lease._current() is None


# ----------------------------------------------------------- orbax and TensorBoard on gs://


def test_orbax_checkpoint_on_gcs(root):
    """checkpoint.py's manager on gs:// (OCDBT, orbax's default): 200 arrays, 3 saves, 2 kept
    (the oldest deleted on the bucket), the newest restored equal."""
    import jax
    import jax.numpy as jnp

    from realm_jax import checkpoint

    state = {f"a{i:03d}": jnp.full((i % 7 + 1, 3), i, jnp.float32) for i in range(199)}
    state["b"] = jnp.ones(5, jnp.int32)
    mgr = checkpoint.manager(root, keep=2, with_data=False)
    for step in (1, 2, 3):
        assert checkpoint.save(mgr, step, state)
    mgr.wait_until_finished()
    reader = checkpoint.manager(root, with_data=False, read_only=True)
    assert reader.all_steps() == [2, 3]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    out = checkpoint.restore(reader, 3, abstract)
    for k in state:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(state[k]))
    mgr.close()


def _event_scalars(data: bytes) -> dict[tuple[str, int], float]:
    """Scalars of a TensorBoard event file, read by hand (TFRecord framing + Event proto)."""
    from tensorboardX.proto import event_pb2

    out, pos = {}, 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
        pos += 12 + n + 4
        for v in event.summary.value:
            out[(v.tag, event.step)] = v.simple_value
    return out


TB_WRITER = """
import sys
from realm_jax.train.metrics import MetricWriter
writer = MetricWriter(sys.argv[1])
writer.scalars(1, {"loss": 2.5})
writer.scalars(2, {"loss": 1.5, "recall@5": 0.25})
writer.close()
"""


def test_tensorboard_events_on_gcs(root):
    """In a process of its own: tensorboardX's gs:// writer uploads once more at exit (atexit
    and __del__), which must happen while the server is up."""
    from realm_jax import fs

    tb = f"{root}/tb"
    subprocess.run(
        [sys.executable, "-c", TB_WRITER, tb],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (name,) = fs.listdir(tb)
    scalars = _event_scalars(fs.read_bytes(f"{tb}/{name}"))
    assert scalars == {("loss", 1): 2.5, ("loss", 2): 1.5, ("recall_at_5", 2): 0.25}


# ------------------------------------------------------------ `realm-jax train` on gs://

# The end-to-end trainer's tiny model on 60 sample passages (tests/test_trainer.py), for 4 steps
# with checkpoints every 2, then resumed to 8.
TRAIN_STEPS = (4, 8)


def _train_flags(data_dir: str, steps: int) -> list[str]:
    from tests.support.runs import REALM_OVERRIDES as OVERRIDES

    values = dict(o.split("=", 1) for o in OVERRIDES)
    values.update({"train.steps": steps, "train.checkpoint_every": 2, "data.data_dir": data_dir})
    return [f"--config.{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="module")
def train_data(gcs, tmp_path_factory) -> tuple[str, str]:
    """(local, gs://) copies of the same prepared data: 60 passages of the bundled sample."""
    from realm_jax import fs
    from realm_jax.data import prepare
    from tests.support.runs import realm_config as config

    root = tmp_path_factory.mktemp("train-data")
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        (root / "corpus.jsonl").write_text("".join(f.readlines()[:60]))
    local, remote = str(root / "prepared"), f"gs://{BUCKET}/train-data/prepared"
    prepare.prepare(config(f"data.corpus={root / 'corpus.jsonl'}"), local)
    fs.upload_tree(local, remote, skip=("summary.json",))
    with open(os.path.join(local, "summary.json"), "rb") as f:
        fs.write_bytes(f"{remote}/summary.json", f.read())  # the commit marker, last
    return local, remote


def _train(workdir: str, data_dir: str, steps: int, env: dict) -> str:
    """`python -m realm_jax train` to `steps`; its console output."""
    cmd = [
        *(sys.executable, "-m", "realm_jax", "train", "--workdir", workdir),
        *("--config", os.path.join(REPO, "configs", "realm.py") + ":smoke"),
        *_train_flags(data_dir, steps),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _logged_losses(workdir: str) -> dict[int, float]:
    """step -> loss from the run's TensorBoard event files (float32, every step logged)."""
    from realm_jax import fs
    from realm_jax import workdir as paths

    tb, out = paths.tb_dir(workdir), {}
    for name in sorted(fs.listdir(tb)):
        for (tag, step), value in _event_scalars(fs.read_bytes(fs.join(tb, name))).items():
            if tag == "loss":
                out[step] = value
    return out


@pytest.mark.parametrize(
    # CI: the gs:// runs alone; their losses equal to a local twin's in the system tier (the
    # exact resume is CI's SIGKILL test in test_trainer.py, orbax's gs:// round trip above)
    "local_twin",
    [False, pytest.param(True, marks=pytest.mark.system)],
    ids=["gcs", "gcs_equals_local"],
)
def test_realm_train_saves_and_resumes_on_gcs(root, train_data, tmp_path, local_twin):
    """The trainer (`python -m realm_jax train`, refresh in process) on a gs:// workdir reading
    a gs:// data dir: 4 steps with checkpoints every 2 (orbax, OCDBT: the full train state,
    params and Adam moments, 264 arrays), then resumed to 8 steps. With its local twin (the
    system tier): every step's loss equals the same two runs' on a local workdir and data dir
    to 1e-5, so the gs:// checkpoint restored the state and the data iterator exactly.

    Compile time is most of the cost: the runs share a JAX compilation cache, on one CPU
    device with XLA's backend optimisation off; the two workdirs run with the same flags."""
    from realm_jax import fs
    from realm_jax import workdir as paths

    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "REALM_JAX_CACHE": str(tmp_path / "cache"),  # copies (REALM_JAX_REMOTE_READS=copy, HF)
    }
    local_data, remote_data = train_data
    runs = {}
    pairs = [(str(tmp_path / "local"), local_data)] if local_twin else []
    for workdir, data_dir in pairs + [(f"{root}/run", remote_data)]:
        first = _train(workdir, data_dir, TRAIN_STEPS[0], env)
        assert "resumed from" not in first
        resumed = _train(workdir, data_dir, TRAIN_STEPS[1], env)
        assert f"resumed from checkpoint {TRAIN_STEPS[0]}" in resumed, resumed[-3000:]
        runs[workdir] = _logged_losses(workdir)
        assert sorted(runs[workdir]) == list(range(1, TRAIN_STEPS[1] + 1)), runs[workdir]
    remote = runs[f"{root}/run"]
    assert all(np.isfinite(v) for v in remote.values()), remote
    metas = [json.loads(fs.read_text(f"{paths.checkpoint_dir(w)}/8/state/_METADATA")) for w in runs]
    meta = metas[-1]
    if local_twin:
        local = runs[str(tmp_path / "local")]
        for step in local:
            np.testing.assert_allclose(remote[step], local[step], rtol=1e-5, err_msg=f"{step}")
        assert meta["tree_metadata"].keys() == metas[0]["tree_metadata"].keys()
    ckpt = paths.checkpoint_dir(f"{root}/run")
    assert sorted(int(s) for s in fs.listdir(ckpt)) == [4, 6, 8]  # train.keep_checkpoints 3
    assert meta["use_ocdbt"] and len(meta["tree_metadata"]) > 200  # 264 arrays when written
    assert fs.exists(f"{ckpt}/8/state/manifest.ocdbt")
    assert not fs.exists(paths.lock_path(f"{root}/run", "trainer"))  # the lease was released
