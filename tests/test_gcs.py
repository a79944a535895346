"""gs:// workdirs against a local GCS emulator (gcp-storage-emulator, in memory, on a free port):
the fs layer, the index publish protocol (manifest last; a writer killed with SIGKILL
mid-publish is never seen by readers and is reaped after its grace period), prepared data,
the trainer's lease object, orbax checkpoints and TensorBoard event files.

What the emulator cannot show, and so is not tested here: generation-match preconditions
(gcp-storage-emulator accepts every ifGenerationMatch: the lease race test skips saying so),
TFDS/array_record reading gs:// directly (array_record opens local files only:
prepared.py reads a verified local copy, which is what is tested), and orbax checkpoints of a
real train state: the emulator's answers to OCDBT's manifest commits fail tensorstore
("Malformed StorageGeneration") from about 50 arrays, so the checkpoint test saves 2.
"""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO

# Before gcsfs is first imported: its zonal-bucket probe asks a control-plane API that the
# emulator does not serve (one warning per call otherwise).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "realm-test"
EMULATOR = shutil.which("gcp-storage-emulator") or os.path.join(
    os.path.dirname(sys.executable), "gcp-storage-emulator"
)


# gcp-storage-emulator serves one request at a time (http.server.HTTPServer): one client that
# leaves a response unread (gcsfs reading a file's first bytes) would stall every other client.
# A threading server serves each connection on its own thread, as GCS does.
THREADED_EMULATOR = """
import sys
from http import server
server.HTTPServer = server.ThreadingHTTPServer
from gcp_storage_emulator.__main__ import main
sys.argv[0] = "gcp-storage-emulator"
sys.exit(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs():
    """The emulator's URL; STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage) and
    TENSORSTORE_GCS_HTTP_URL (orbax's tensorstore) point at it for the module."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("google.cloud.storage")
    pytest.importorskip("gcp_storage_emulator")
    if not os.path.exists(EMULATOR):
        pytest.skip("gcp-storage-emulator is not installed (pip install -r requirements.txt)")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", THREADED_EMULATOR, "start", "--host", "127.0.0.1"]
        + ["--port", str(port)]
        + ["--default-bucket", BUCKET, "--in-memory", "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the GCS emulator did not start: {proc.stderr.read()!r}")
            time.sleep(0.1)
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore wants some credentials
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)
    proc.stderr.close()


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
    assert manifest["format"] == 2 and manifest["source_checkpoint"] == "c/10"
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
    from realm_jax.data import prepare, prepared

    monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path / "cache"))
    local, remote = str(tmp_path / "data"), f"{root}/data"
    prepare.prepare(sample_config, local)
    summary = prepare.prepare(sample_config, remote)
    assert fs.exists(f"{remote}/summary.json") and summary["files"]
    for rel, size in summary["files"].items():
        assert fs.size(f"{remote}/{rel}") == size
    want, got = prepared.load_blocks(local), prepared.load_blocks(remote)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
    assert len(prepared.examples_source(remote)) == len(prepared.examples_source(local))
    # A dataset file gone: a clear error, not a TFDS traceback.
    rel = next(r for r in summary["files"] if "array_record" in r)
    fs.remove(f"{remote}/{rel}")
    prepared._checked.clear()
    with pytest.raises(prepared.PrepareError, match="is damaged: .* is missing"):
        prepared.load_summary(remote)
    # No summary (an upload interrupted before its commit marker): an incomplete prepare.
    fs.remove(f"{remote}/summary.json")
    with pytest.raises(prepared.PrepareError, match="incomplete"):
        prepared.load_summary(remote)


def test_beam_prepare_builds_in_place_on_gcs(root, tmp_path, monkeypatch):
    """`prepare` on Beam into a gs:// data_dir: worker processes write their array_record
    shards into the build folder on the object store themselves, as Dataflow's workers must
    (Beam's own gs:// file system, pointed at the emulator), in 2 windows of shards of 100
    records; the driver names the shards and writes dataset_info there. The records equal the
    in-process path's, and nothing of the build is left beside the datasets."""
    pytest.importorskip("apache_beam")
    from realm_jax import fs
    from realm_jax.config import load_config
    from realm_jax.data import prepare
    from tests.test_beam_prepare import _assert_same  # record for record, and the summaries

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


def _enforces_generation_match(root) -> bool:
    from google.api_core import exceptions
    from google.cloud import storage

    blob = storage.Client().bucket(BUCKET).blob(f"{root.split('/', 3)[3]}/probe")
    blob.upload_from_string(b"1")
    try:
        blob.upload_from_string(b"2", if_generation_match=0)
    except exceptions.PreconditionFailed:
        return True
    return False


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
    time.sleep(2.2)
    with lock.workdir_lock(root, "trainer"):  # expired: taken over
        held = json.loads(fs.read_bytes(paths.lock_path(root, "trainer")))
        assert held["pid"] == os.getpid() and held["expires"] > time.time()
    assert not fs.exists(paths.lock_path(root, "trainer"))  # released on exit
    with lock.workdir_lock(root, "trainer"):  # so the next one takes it at once
        pass


def test_lease_race_needs_generation_match(root):
    from realm_jax import lock

    if not _enforces_generation_match(root):
        pytest.skip(
            "gcp-storage-emulator ignores ifGenerationMatch: the race between two processes "
            "taking a free lease at once, and a holder noticing a lost lease, are not tested"
        )
    a, b = (
        lock.ObjectLease(f"{root}/race.lock", "trainer"),
        lock.ObjectLease(f"{root}/race.lock", "trainer", ttl=0.1),
    )
    b.acquire()
    time.sleep(0.2)
    a.acquire()  # b's expired: a takes over
    assert not b.renew()  # b learns it lost the lease


# ----------------------------------------------------------- orbax and TensorBoard on gs://


def test_orbax_checkpoint_on_gcs(root):
    import jax
    import jax.numpy as jnp

    from realm_jax import checkpoint

    state = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(5, jnp.int32)}
    mgr = checkpoint.manager(root, with_data=False)
    assert checkpoint.save(mgr, 3, state)
    mgr.wait_until_finished()
    reader = checkpoint.manager(root, with_data=False, read_only=True)
    assert reader.all_steps() == [3]
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
    and __del__), which must happen while the emulator is up."""
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
