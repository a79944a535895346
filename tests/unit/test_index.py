"""Index storage: atomic publish, verification, retention with leases, crash safety, ScaNN."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from realm_jax.index import retention
from realm_jax.index import store as ix
from tests.conftest import REPO


def _emb(n: int = 64, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def test_publish_load_round_trip(tmp_path):
    d = str(tmp_path / "index")
    assert ix.latest_valid(d) is None and ix.list_versions(d) == []
    emb = _emb()
    path = ix.publish_index(d, 100, emb, extra={"source_checkpoint": "ckpt/100"})
    assert os.path.basename(path) == "step_00000100"
    assert ix.latest_valid(d) == (100, path)
    assert ix.latest_valid(d, newer_than=100) is None
    manifest = ix.verify_version(path, expected_num_blocks=64, expected_dim=8)
    assert manifest["step"] == 100 and manifest["scann"] is False
    assert manifest["source_checkpoint"] == "ckpt/100" and manifest["embed_seconds"] is None
    loaded = ix.load_embeddings(path)
    assert loaded.dtype == np.float32 and not isinstance(loaded, np.memmap)
    np.testing.assert_array_equal(loaded, emb)
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]
    assert ix.staleness(600, 100) == 500


def test_publish_is_idempotent(tmp_path):
    d = str(tmp_path)
    p1 = ix.publish_index(d, 5, _emb(seed=1))
    created = ix.verify_version(p1)["created"]
    p2 = ix.publish_index(d, 5, _emb(seed=2))  # same step again: the existing one is kept
    assert p1 == p2 and ix.verify_version(p2)["created"] == created
    np.testing.assert_array_equal(ix.load_embeddings(p2), _emb(seed=1))
    assert ix.list_versions(d) == [5] and sorted(os.listdir(d)) == ["step_00000005"]


def test_publish_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        ix.publish_index(str(tmp_path), 1, np.zeros(5, np.float32))
    bad = _emb()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ix.publish_index(str(tmp_path), 1, bad)
    with pytest.raises(ValueError, match="override"):
        ix.publish_index(str(tmp_path), 1, _emb(), extra={"step": 3})


def test_retention_keeps_newest_and_leased(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        ix.publish_index(d, step, _emb(seed=step))
        retention.cleanup(d, keep=3)
    retention.mark_in_use(d, 10, "trainer-0")
    with open(os.path.join(d, "in_use", "trainer-0.json")) as f:
        assert json.load(f)["step"] == 10
    for step in (40, 50):
        ix.publish_index(d, step, _emb(seed=step))
        retention.cleanup(d, keep=3)
    assert ix.list_versions(d) == [10, 30, 40, 50]  # 20 dropped, 10 leased
    retention.release(d, "trainer-0")
    retention.release(d, "trainer-0")  # releasing twice is fine
    removed = retention.cleanup(d, keep=2)
    assert ix.list_versions(d) == [40, 50] and len(removed) == 2
    with pytest.raises(ValueError):
        retention.mark_in_use(d, 1, "../evil")


def _corrupt(path: str, how: str) -> None:
    npy = os.path.join(path, "embeddings.npy")
    if how == "flip":
        with open(npy, "r+b") as f:
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "no_manifest":
        os.remove(os.path.join(path, "manifest.json"))
    elif how == "bad_json":
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write("{not json")
    elif how == "truncate":
        os.truncate(npy, os.path.getsize(npy) - 100)


@pytest.mark.parametrize(
    "how,message",
    [
        ("flip", "checksum mismatch"),
        ("no_manifest", "missing manifest"),
        ("bad_json", "bad JSON"),
        ("truncate", "truncated"),
    ],
)
def test_corrupt_version_rejected_and_skipped(tmp_path, caplog, how, message):
    d = str(tmp_path)
    good = ix.publish_index(d, 1, _emb(seed=1))
    bad = ix.publish_index(d, 2, _emb(seed=2))
    _corrupt(bad, how)
    with pytest.raises(ix.CorruptIndexError, match=message) as err:
        ix.verify_version(bad)
    assert bad in str(err.value)
    with caplog.at_level(logging.WARNING, logger="realm_jax.index"):
        assert ix.latest_valid(d) == (1, good)
        assert ix.latest_valid(d) == (1, good)  # a second poll does not warn again
    warnings = [r for r in caplog.records if bad in r.getMessage()]
    assert len(warnings) == 1 and message in warnings[0].getMessage()
    assert ix.latest_valid(d, newer_than=1) is None
    if how in ("flip", "truncate"):
        with pytest.raises(ix.CorruptIndexError):
            ix.load_embeddings(bad)
    # Re-publishing the same step replaces the corrupt version.
    assert ix.publish_index(d, 2, _emb(seed=2)) == bad and ix.latest_valid(d) == (2, bad)


def test_wrong_num_blocks_or_dim(tmp_path):
    d = str(tmp_path)
    good = ix.publish_index(d, 1, _emb(n=64))
    ix.publish_index(d, 2, _emb(n=65))
    with pytest.raises(ix.CorruptIndexError, match="wrong num_blocks 65, expected 64"):
        ix.verify_version(os.path.join(d, "step_00000002"), expected_num_blocks=64)
    with pytest.raises(ix.CorruptIndexError, match="wrong dim 8, expected 16"):
        ix.verify_version(good, expected_dim=16)
    assert ix.latest_valid(d, expected_num_blocks=64) == (1, good)
    # A manifest that lies about num_blocks is caught against the .npy header.
    mpath = os.path.join(good, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    manifest["num_blocks"] = 63
    with open(mpath, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ix.CorruptIndexError, match="wrong shape"):
        ix.verify_version(good)


CRASH_CHILD = """
import sys
import numpy as np
from realm_jax.index import store
emb = np.random.default_rng(0).standard_normal((400_000, 128), dtype=np.float32)
print("ready", flush=True)
store.publish_index(sys.argv[1], 200, emb)
"""


def _partial_npy(index_dir: str) -> bool:
    for name in os.listdir(index_dir):
        npy = os.path.join(index_dir, name, "embeddings.npy")
        if name.startswith(".tmp-") and os.path.isfile(npy) and os.path.getsize(npy) > 0:
            return True
    return False


def test_kill_mid_publish_leaves_previous_version(tmp_path):
    d = str(tmp_path)
    good = ix.publish_index(d, 100, _emb(n=400, d=128))
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, d], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.time() + 30
        while not _partial_npy(d):  # kill once the temp dir holds part of embeddings.npy
            assert time.time() < deadline and child.poll() is None, "no temp dir appeared"
            time.sleep(0.0005)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    tmps = [n for n in os.listdir(d) if n.startswith(".tmp-step_200-")]
    assert len(tmps) == 1 and str(child.pid) in tmps[0]
    assert ix.list_versions(d) == [100]  # no partial final-named dir
    assert ix.latest_valid(d) == (100, good)
    npy = os.path.join(d, tmps[0], "embeddings.npy")
    assert os.path.getsize(npy) < 400_000 * 128 * 4  # it really was killed mid-write
    assert not os.path.exists(os.path.join(d, tmps[0], "manifest.json"))
    removed = retention.cleanup(d, keep=3)
    assert removed == [os.path.join(d, tmps[0])]
    assert sorted(os.listdir(d)) == ["step_00000100"]


def test_cleanup_keeps_live_writer_temp(tmp_path):
    d = str(tmp_path)
    live = os.path.join(d, f".tmp-step_7-{os.getpid()}-abcd1234")
    os.makedirs(live)
    with open(os.path.join(live, ".writer"), "w") as f:
        json.dump({"host": os.uname().nodename, "pid": os.getpid()}, f)
    assert retention.cleanup(d, keep=1) == [] and os.path.isdir(live)
    old = time.time() - 2 * 3600  # idle for two hours: abandoned even if the pid is alive
    os.utime(os.path.join(live, ".writer"), (old, old))
    os.utime(live, (old, old))
    assert retention.cleanup(d, keep=1) == [live]


# ----------------------------------------------------------------------------- ScaNN


def _clustered(n: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((64, d)).astype(np.float32)
    db = centers[rng.integers(0, 64, n)] + 0.5 * rng.standard_normal((n, d)).astype(np.float32)
    q = centers[rng.integers(0, 64, 200)] + 0.5 * rng.standard_normal((200, d)).astype(np.float32)
    return db.astype(np.float32), q.astype(np.float32)


def _recall(ids: np.ndarray, db: np.ndarray, q: np.ndarray, k: int) -> float:
    exact = np.argsort(-(q @ db.T), axis=1)[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, exact, strict=True)]))


@pytest.mark.parametrize("n,brute", [(20_000, False), (1_500, True)])
def test_scann_recall_and_round_trip(tmp_path, n, brute):
    scann_index = pytest.importorskip("realm_jax.index.scann")
    pytest.importorskip("scann")
    db, q = _clustered(n, 128, seed=n)
    params = scann_index.scann_params(n)
    assert params["brute_force"] is brute
    searcher = scann_index.build_searcher(db, k=10, **params)
    ids, scores = scann_index.search(searcher, q, 10)
    assert ids.shape == (200, 10) and ids.dtype == np.int64 and scores.dtype == np.float32
    assert _recall(ids, db, q, 10) >= 0.95
    np.testing.assert_allclose(scores[:, 0], np.einsum("qd,qd->q", q, db[ids[:, 0]]), rtol=1e-4)
    scann_index.save_searcher(searcher, str(tmp_path / "s"))
    os.rename(tmp_path / "s", tmp_path / "moved")  # relative asset paths survive a rename
    ids2, scores2 = scann_index.search(scann_index.load_searcher(str(tmp_path / "moved")), q, 10)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(scores2, scores)


_SCANN_BUILD = """
import logging, os, sys
import numpy as np
from realm_jax.index import scann as s
db = np.random.default_rng(0).standard_normal((2000, 16)).astype(np.float32)
searcher = s.build_searcher(db, k=5, **s.scann_params(2000, brute_force=False))  # a k-means tree
assert s.search(searcher, db[:2], 5)[0].shape == (2, 5)
with s._without_native_info():  # what else reaches fd 2 meanwhile is passed on
    logging.getLogger("realm_jax.test").warning("our warning, kept")
    os.write(2, b"E0000 00:00:1.0 1 x.cc:1] a native error, kept\\n")
    os.write(2, b"I0000 00:00:1795943177.628672     405 x.cc:58] native info, dropped\\n")
print("built")
"""


def test_scann_build_prints_no_native_info():
    """A ScaNN tree's build (`evaluate --retriever hybrid`, `finetune`'s frozen index) prints
    none of ScaNN's absl INFO lines nor absl's uninitialised-logging notice; our logs and
    native warnings and errors still reach stderr."""
    pytest.importorskip("scann")
    r = subprocess.run(
        [sys.executable, "-c", _SCANN_BUILD], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "built", r.stderr[-3000:]
    for noise in ("absl::InitializeLog", "partitioner_factory_base", "PartitionerFactory ran",
                  "native info", "I0000"):  # fmt: skip
        assert noise not in r.stderr, r.stderr[-3000:]
    assert "our warning, kept" in r.stderr and "a native error, kept" in r.stderr, r.stderr


def test_scann_params_scale():
    from realm_jax.index.scann import scann_params

    big = scann_params(13_350_000)
    assert 3000 < big["num_leaves"] < 4000 and big["leaves_to_search"] == 183
    mid = scann_params(20_000)
    assert mid["num_leaves"] == 141 and mid["leaves_to_search"] == 10
    assert scann_params(5000, num_leaves=8)["leaves_to_search"] == 8
    for n in (100, 20_000, 13_350_000):  # a result passed back in is unchanged
        assert scann_params(n, **scann_params(n)) == scann_params(n)
    assert scann_params(100, brute_force=False)["num_leaves"] == 2


def test_publish_with_searcher(tmp_path):
    scann_index = pytest.importorskip("realm_jax.index.scann")
    pytest.importorskip("scann")
    db, q = _clustered(300, 16, seed=3)
    searcher = scann_index.build_searcher(db, k=5)
    path = ix.publish_index(str(tmp_path), 9, db, searcher=searcher)
    manifest = ix.verify_version(path)
    assert manifest["scann"] is True and "dataset.npy" in manifest["scann_files"]
    loaded = scann_index.load_searcher(os.path.join(path, "scann"))
    ids, _ = scann_index.search(loaded, q, 20)  # k > the searcher's default works too
    np.testing.assert_array_equal(ids[:, :5], scann_index.search(searcher, q, 5)[0])
    assert ids.shape == (200, 20)
    os.remove(os.path.join(path, "scann", "dataset.npy"))
    with pytest.raises(ix.CorruptIndexError, match="ScaNN file scann/dataset.npy missing"):
        ix.verify_version(path)


def test_load_rows_reads_and_verifies_only_the_blocks_asked_for(tmp_path):
    """Format 3: a host reads only the row blocks holding its rows (bytes counted), checks
    each against its own sha256, gets zeros for padding rows past the end; a flipped byte is
    found by the reader of that block alone, naming its rows."""
    emb = _emb(61, 16, seed=3)
    path = ix.publish_index(str(tmp_path), 7, emb, block_rows=8)
    manifest = ix.verify_version(path)
    assert manifest["format"] == 3 and manifest["row_blocks"]["rows"] == 8
    assert len(manifest["row_blocks"]["sha256"]) == 8  # ceil(61 / 8)
    parts, read = ix.load_rows(path, [(16, 24)])
    np.testing.assert_array_equal(parts[(16, 24)], emb[16:24])
    assert read == 8 * 16 * 4  # one block
    parts, read = ix.load_rows(path, [(5, 20), (56, 64)])  # across blocks; past the end
    np.testing.assert_array_equal(parts[(5, 20)], emb[5:20])
    np.testing.assert_array_equal(parts[(56, 64)][:5], emb[56:61])
    assert not parts[(56, 64)][5:].any()
    assert read == (24 + 5) * 16 * 4  # blocks 0-2, and the last block's 5 rows
    # flip one byte of row 42 (block 5): only a reader of block 5 notices
    epath = os.path.join(path, ix.EMBEDDINGS)
    with open(epath, "rb") as f:
        _, _, _, offset = ix._read_npy_header(f, epath)
    with open(epath, "r+b") as f:
        f.seek(offset + 42 * 16 * 4 + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    ix.load_rows(path, [(0, 40)])
    with pytest.raises(ix.CorruptIndexError, match="rows 40-48"):
        ix.load_rows(path, [(32, 48)])
    # versions without row blocks (format 2) are read and verified whole, as before
    old = ix.publish_index(str(tmp_path / "old"), 1, emb)
    m = json.load(open(os.path.join(old, ix.MANIFEST)))
    m["format"] = 2
    del m["row_blocks"]
    json.dump(m, open(os.path.join(old, ix.MANIFEST), "w"))
    parts, read = ix.load_rows(old, [(0, 8)])
    np.testing.assert_array_equal(parts[(0, 8)], emb[:8])
    assert read == 61 * 16 * 4  # the whole matrix


def test_progress_is_written_before_the_index_folder_exists(tmp_path):
    """The refresh job reports 'loading the corpus' before it has published anything: the
    index folder does not exist yet on a fresh workdir."""
    idx = str(tmp_path / "fresh" / "index")
    ix.write_progress(idx, checkpoint=None, phase="loading the corpus")
    got = ix.read_progress(idx)
    assert got["phase"] == "loading the corpus" and got["checkpoint"] is None


def _device_parts(emb: np.ndarray, devices: int = 4) -> list[tuple[int, np.ndarray]]:
    """What each of `devices` devices holds of emb, padded to a multiple of them (as
    sharding.owned_row_shards returns): the padding rows are zeros."""
    per = -(-len(emb) // devices)
    padded = np.zeros((per * devices, emb.shape[1]), np.float32)
    padded[: len(emb)] = emb
    return [(i * per, padded[i * per : (i + 1) * per]) for i in range(devices)]


def test_publish_rows_writes_each_owners_rows_and_reads_back_any_range(tmp_path):
    """Format 4: the rows as parts, one a device (the padding past num_blocks not written),
    that partition the rows; the whole matrix (load_embeddings) and any range across parts
    (load_rows, only the blocks holding it read) equal the source rows; the searcher is built
    from exactly those rows; the version verifies and is found like any other."""
    emb, seen = _emb(61, 16, seed=4), []
    d = str(tmp_path)
    path = ix.publish_rows(
        d, 3, _device_parts(emb), 61, 16, searcher_fn=lambda h: seen.append(h.copy()),
        block_rows=8, extra={"source_checkpoint": "c/3"},
    )  # fmt: skip
    m = ix.verify_version(path, expected_num_blocks=61, expected_dim=16)
    assert m["format"] == 4 and m["source_checkpoint"] == "c/3" and not m["scann"]
    spans = [(p["start"], p["stop"]) for p in m["row_parts"]]
    assert spans == [(0, 16), (16, 32), (32, 48), (48, 61)]  # a partition, no padding
    assert not os.path.exists(os.path.join(path, ix.EMBEDDINGS))
    np.testing.assert_array_equal(ix.load_embeddings(path), emb)
    np.testing.assert_array_equal(seen[0], emb)
    parts, read = ix.load_rows(path, [(10, 20), (56, 64)])
    np.testing.assert_array_equal(parts[(10, 20)], emb[10:20])
    np.testing.assert_array_equal(parts[(56, 64)][:5], emb[56:61])
    assert not parts[(56, 64)][5:].any()
    assert read == (8 + 8 + 5) * 16 * 4  # rows 8-15 and 16-23 (two parts), 56-60
    assert ix.latest_valid(d) == (3, path)
    assert ix.publish_rows(d, 3, _device_parts(emb[::-1]), 61, 16) == path  # kept
    np.testing.assert_array_equal(ix.load_embeddings(path), emb)
    assert [n for n in os.listdir(d) if n.startswith(".tmp")] == []


def test_publish_rows_checksums_catch_a_flipped_byte(tmp_path):
    """A flipped byte in one part: the reader of that block names its rows and part; other
    blocks read fine; a full verify and a whole load refuse the version."""
    emb = _emb(64, 16, seed=5)
    path = ix.publish_rows(str(tmp_path), 4, _device_parts(emb), 64, 16, block_rows=8)
    rel = ix.part_name(32, 48)
    fpath = os.path.join(path, *rel.split("/"))
    with open(fpath, "rb") as f:
        _, _, _, offset = ix._read_npy_header(f, fpath)
    with open(fpath, "r+b") as f:
        f.seek(offset + (42 - 32) * 16 * 4 + 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    np.testing.assert_array_equal(ix.load_rows(path, [(0, 40)])[0][(0, 40)], emb[:40])
    with pytest.raises(ix.CorruptIndexError, match=f"rows 40-48 \\({rel}\\)"):
        ix.load_rows(path, [(36, 44)])
    with pytest.raises(ix.CorruptIndexError, match="checksum mismatch"):
        ix.verify_version(path)
    with pytest.raises(ix.CorruptIndexError):
        ix.load_embeddings(path)


def test_publish_rows_refuses_parts_that_do_not_partition_the_rows(tmp_path):
    """A missing part (rows 16-31 nobody wrote) is refused at the commit: no version, no
    temp dir left; so are non-finite rows (counted below num_blocks only)."""
    parts = _device_parts(_emb(64, 8))
    with pytest.raises(OSError, match="process 0 could not commit"):
        ix.publish_rows(str(tmp_path), 5, parts[:1] + parts[2:], 64, 8)
    assert os.listdir(tmp_path) == []
    parts[1][1][3, 2] = np.nan
    assert ix.non_finite_rows(parts, 64) == 1 and ix.non_finite_rows(parts, 16) == 0
    with pytest.raises(OSError, match=r"process\(es\) \[0\] could not write"):
        ix.publish_rows(str(tmp_path), 5, parts, 64, 8)
    assert os.listdir(tmp_path) == []


def test_owned_row_shards_are_this_processs_rows_once(tmp_path):
    """sharding.owned_row_shards of a row-sharded array: each device's rows once (replicas
    skipped), copied from the device; addressable_row_ranges: the same ranges."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from realm_jax import sharding

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    emb = _emb(8 * 4, 3)
    x = sharding.put_rows(emb, mesh)
    got = sharding.owned_row_shards(x)
    assert [a for a, _ in got] == [0, 8, 16, 24]
    np.testing.assert_array_equal(np.concatenate([r for _, r in got]), emb)
    ranges = sharding.addressable_row_ranges(sharding.rows_sharding(mesh), emb.shape)
    assert ranges == [(0, 8), (8, 16), (16, 24), (24, 32)]
    half = jax.device_put(emb, NamedSharding(mesh, P("data")))  # replicated over 'model'
    assert [a for a, _ in sharding.owned_row_shards(half)] == [0, 16]
    cols = jax.device_put(emb[:, :2], NamedSharding(mesh, P(None, "model")))
    with pytest.raises(ValueError, match="more than the rows"):
        sharding.owned_row_shards(cols)
