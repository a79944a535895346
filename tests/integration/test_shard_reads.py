"""A gs:// prepared data dir read where it lies (data/datasets.py, REALM_JAX_REMOTE_READS=direct):
no host copies the whole data dir any more. Against a local GCS (tests/support/fake_gcs.py) and a
prepared corpus of 8,064 blocks whose blocks dataset is cut into 3 array_record shards:

- the shards opened in place give the TFDS source's records (any shard, across a boundary);
- a row range opens only the shards that hold it, and padding rows are zeros;
- the row-sharded token table (and the titles) equal the whole table's, local and gs://;
- a shard that no longer matches summary.json, or whose bytes changed, is refused by its reader;
- REALM_JAX_REMOTE_READS=copy still copies the whole data dir (the former way);
- 2 jax.distributed processes (2 fake CPU devices each) build the row-sharded token table
  (datasets.sharded_block_tokens, what the trainer and the refresh job use) and the training
  batches from gs://: each process reads only the shards of its own rows (counted by an HTTP
  proxy per process in front of the store: bytes and objects), the table equals the whole
  local one and the batches equal those of the local data dir, and nothing is copied.

The proxy counts the bytes it delivered: array_record's GCS reader asks for open-ended ranges
("bytes=N-") and drops the connection when it has what it wants, so a count includes what was
in flight then (a few hundred KiB on loopback); the bounds below allow for it.
"""

import collections
import glob
import http.client
import http.server
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import urllib.parse

import numpy as np
import pytest

from tests.conftest import REPO
from tests.support import fake_gcs

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "realm-shards"
COPIES = 12  # the bundled sample 12 times over: 8,064 blocks, a 5.7 MB blocks dataset
SHARDS = 3  # the blocks dataset is cut into 3 shards of 2,688 blocks
OVERRIDES = ["data.masking=random", "data.engine=local"]


class CountingProxy:
    """An HTTP proxy in front of the local GCS that counts, per object path, the requests and
    the response body bytes it delivered (streamed, so a dropped connection stops the count)."""

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlparse(upstream)
        self.bytes: collections.Counter = collections.Counter()
        self.requests: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle(self):
                try:
                    super().handle()
                except OSError:
                    pass  # the client dropped the connection mid-body

            def forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                up = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                up.request(self.command, self.path, body=body, headers=headers)
                resp = up.getresponse()
                name = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
                with proxy.lock:
                    proxy.requests[name] += 1
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
                self.send_response(resp.status)
                length = resp.getheader("Content-Length")
                data = None
                if length is None:
                    data = resp.read()
                    length = str(len(data))
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                try:
                    while self.command != "HEAD":
                        chunk = data if data is not None else resp.read(8192)
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        with proxy.lock:
                            proxy.bytes[name] += len(chunk)
                        if data is not None:
                            break
                except OSError:
                    self.close_connection = True
                finally:
                    up.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, fragment: str) -> tuple[int, int]:
        """(requests, bytes) for the objects whose path contains `fragment`."""
        with self.lock:
            reqs = sum(v for k, v in self.requests.items() if fragment in k)
            got = sum(v for k, v in self.bytes.items() if fragment in k)
        return reqs, got

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reshard(folder: str, n: int) -> None:
    """Cut the one-shard TFDS array_record dataset in `folder` into `n` shards (as a larger
    prepare writes them): the records in order, the dataset info's shard lengths to match."""
    from array_record.python import array_record_module as ar

    [old] = glob.glob(os.path.join(folder, "*.array_record-00000-of-00001"))
    reader = ar.ArrayRecordReader(old)
    records = reader.read_all()
    reader.close()
    os.remove(old)
    prefix = old[: -len("00000-of-00001")]
    cuts = np.array_split(np.arange(len(records)), n)
    for k, idx in enumerate(cuts):
        writer = ar.ArrayRecordWriter(f"{prefix}{k:05d}-of-{n:05d}", "group_size:1")
        for i in idx:
            writer.write(records[i])
        writer.close()
    info_path = os.path.join(folder, "dataset_info.json")
    info = json.load(open(info_path))
    info["splits"][0]["shardLengths"] = [str(len(idx)) for idx in cuts]
    with open(info_path, "w") as f:
        json.dump(info, f)


def _summarize_files(ddir: str) -> None:
    """summary.json's file list and sizes rewritten for the files now in `ddir`."""
    from realm_jax import fs

    path = os.path.join(ddir, "summary.json")
    s = json.load(open(path))
    s["files"] = {
        f"{n}/{rel}": os.path.getsize(os.path.join(ddir, n, *rel.split("/")))
        for n in ("blocks", "examples", "eval_examples")
        for rel in fs.walk_files(os.path.join(ddir, n))
    }
    with open(path, "w") as f:
        json.dump(s, f)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with fake_gcs.module_server(tmp_path_factory, BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def data(gcs, tmp_path_factory):
    """(local one-shard data dir, local 3-shard twin, its gs:// copy, the config)."""
    from realm_jax import fs
    from realm_jax.config import load_config
    from realm_jax.data import prepare

    root = tmp_path_factory.mktemp("shard-data")
    lines = open(os.path.join(REPO, "data", "sample", "corpus.jsonl")).read().splitlines()
    with open(root / "corpus.jsonl", "w") as f:
        for k in range(COPIES):
            for line in lines:
                d = json.loads(line)
                d["id"], d["title"] = f"{k}/{d['id']}", f"{d['title']} ({k})"
                f.write(json.dumps(d) + "\n")
    config = load_config(
        os.path.join(REPO, "configs/realm.py:smoke"),
        [f"data.corpus={root / 'corpus.jsonl'}", *OVERRIDES],
    )
    local = str(root / "one")
    prepare.prepare(config, local)
    sharded = str(root / "three")
    shutil.copytree(local, sharded)
    _reshard(os.path.join(sharded, "blocks", "realm_blocks", "1.0.0"), SHARDS)
    _summarize_files(sharded)
    remote = f"gs://{BUCKET}/three"
    fs.upload_tree(sharded, remote)  # summary.json sorts last: written after the datasets
    return local, sharded, remote, config


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Sources opened afresh (their read counts from zero), an empty cache, direct reads."""
    from realm_jax.data import datasets

    monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(datasets.REMOTE_READS, raising=False)
    datasets._open_in_place.cache_clear()
    datasets._open.cache_clear()
    yield tmp_path / "cache"
    datasets._open_in_place.cache_clear()


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_shards_read_in_place_give_the_tfds_records(data, fresh):
    from realm_jax.data import datasets

    local, sharded, remote, _ = data
    src, want = datasets.blocks_source(remote), datasets.blocks_source(local)
    assert isinstance(src, datasets.ShardedSource) and len(src.shards) == SHARDS
    assert len(src) == len(want) and repr(src) == repr(want)  # grain's check on a resume
    # the 3-shard twin is a valid TFDS dataset: TFDS's own source reads it the same
    assert len(datasets.blocks_source(sharded)) == len(want)
    n = len(want)
    keys = [0, 1, n // 3 - 1, n // 3, n // 2, 2 * n // 3, n - 1]
    for k in keys:
        _same(src[k], want[k])
    clone = pickle.loads(pickle.dumps(src))  # as grain's worker processes get it
    assert not clone.opened
    _same(clone[n - 2], want[n - 2])
    across = list(src.read_range(n // 3 - 5, n // 3 + 5))  # over a shard boundary
    for k, rec in zip(range(n // 3 - 5, n // 3 + 5), across):
        _same(rec, want[k])
    ex, ex_want = datasets.examples_source(remote), datasets.examples_source(local)
    assert len(ex) == len(ex_want) and repr(ex) == repr(ex_want)
    for k in (0, 17, len(ex_want) - 1):
        _same(ex[k], ex_want[k])
    assert not os.path.exists(fresh / "prepared")  # nothing copied


def test_block_rows_open_only_the_shards_that_hold_them(data, fresh):
    from realm_jax.data import datasets

    local, _, remote, _ = data
    tokens = datasets.load_blocks(local)[0]
    n, per = len(tokens), len(tokens) // SHARDS
    got = datasets.load_block_rows(remote, [(10, 60), (per - 3, per + 4)])
    np.testing.assert_array_equal(got[(10, 60)], tokens[10:60])
    np.testing.assert_array_equal(got[(per - 3, per + 4)], tokens[per - 3 : per + 4])
    src = datasets.blocks_source(remote)
    assert sorted(src.opened) == [0, 1] and src.records_read == 50 + 7
    tail = datasets.load_block_rows(remote, [(n - 2, n + 3)])[(n - 2, n + 3)]
    np.testing.assert_array_equal(tail[:2], tokens[n - 2 :])
    assert not tail[2:].any()  # the padding rows of a row-sharded table
    assert sorted(src.opened) == [0, 1, 2]


# The check on 5 devices (8,064 blocks: one padding row), in a process of its own: the test
# process has 4, which divide the table.
ROW_SHARDED = r"""
import sys
import jax
import numpy as np
from realm_jax import sharding
from realm_jax.data import datasets

local, remote = sys.argv[1:]
mesh = jax.make_mesh((5,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
table, _, titles = datasets.load_blocks(local)
assert len(table) % 5, len(table)
for ddir in (local, remote):
    got = datasets.sharded_block_tokens(ddir, mesh, with_titles=True)
    assert got.shape == table.shape and got.titles.name(len(titles) - 1) == titles[-1]
    np.testing.assert_array_equal(got.titles.ids, datasets.TitleIds.of(titles).ids)
    assert got.rows.sharding.is_equivalent_to(sharding.rows_sharding(mesh), 2)
    np.testing.assert_array_equal(sharding.to_host(got.rows), sharding.pad_rows(table, mesh))
assert datasets.sharded_block_tokens(remote, mesh).titles is None
print("ok")
"""


def test_the_row_sharded_table_equals_the_whole_one(data, fresh):
    """One process, 5 devices (a count that does not divide the blocks: padding rows)."""
    local, _, remote, _ = data
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {
        **os.environ,
        "XLA_FLAGS": " ".join(flags + ["--xla_force_host_platform_device_count=5"]),
    }
    r = subprocess.run(
        [sys.executable, "-c", ROW_SHARDED, local, remote],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_shard_that_no_longer_matches_the_summary_is_refused(data, fresh):
    from realm_jax import fs
    from realm_jax.data import datasets

    _, sharded, _, _ = data
    remote = f"gs://{BUCKET}/damaged"
    fs.upload_tree(sharded, remote)
    datasets.load_summary(remote)  # checked whole at first
    folder = "blocks/realm_blocks/1.0.0"
    last = sorted(f for f in os.listdir(os.path.join(sharded, folder)) if "array_record" in f)[-1]
    good = open(os.path.join(sharded, folder, last), "rb").read()
    fs.write_bytes(f"{remote}/{folder}/{last}", good[: len(good) // 2])  # replaced under the run
    src = datasets.blocks_source(remote)
    assert src[0]["block_id"] == 0  # the intact shards still read
    with pytest.raises(
        datasets.PrepareError,
        match=f"{last} has {len(good) // 2} bytes, summary.json says {len(good)}",
    ):
        src[len(src) - 1]
    with pytest.raises(datasets.PrepareError, match="damaged or re-prepared"):
        list(src.read_range(len(src) - 3, len(src)))
    # the same size, some bytes changed: riegeli's chunk hashes refuse what is read of it
    first = sorted(f for f in os.listdir(os.path.join(sharded, folder)) if "array_record" in f)[0]
    good = bytearray(open(os.path.join(sharded, folder, first), "rb").read())
    good[len(good) // 3 : len(good) // 3 + 64] = bytes(64)
    fs.write_bytes(f"{remote}/{folder}/{first}", bytes(good))
    with pytest.raises(datasets.PrepareError, match=f"{first} does not read"):
        list(src.read_range(0, src.shards[0].records))


def test_copy_mode_still_copies_the_whole_data_dir(data, fresh, monkeypatch):
    from realm_jax.data import datasets

    local, _, remote, _ = data
    monkeypatch.setenv(datasets.REMOTE_READS, "copy")
    src = datasets.blocks_source(remote)
    assert not isinstance(src, datasets.ShardedSource) and len(src) == len(
        datasets.blocks_source(local)
    )
    assert len(os.listdir(fresh / "prepared")) == 1
    monkeypatch.setenv(datasets.REMOTE_READS, "sometimes")
    with pytest.raises(ValueError, match="REALM_JAX_REMOTE_READS"):
        datasets.remote_reads()


WORKER = r"""
import os, sys
sys.path.insert(0, os.getcwd())
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import json
import numpy as np
from realm_jax import sharding
from realm_jax.config import load_config
from realm_jax.data import pipeline, datasets
from realm_jax.index.feed import IndexFeed
from realm_jax.model.realm import realm_model
from tests.support.realm_fixtures import tiny_config
local, remote = os.environ["SHARD_LOCAL"], os.environ["SHARD_REMOTE"]
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
tokens = datasets.sharded_block_tokens(remote, mesh, with_titles=True)
table, _, titles = datasets.load_blocks(local)
want = sharding.pad_rows(table, mesh)
assert tokens.shape == table.shape
assert np.array_equal(tokens.titles.ids, datasets.TitleIds.of(titles).ids)
assert np.array_equal(sharding.to_host(tokens.rows), want)
# the trainer's index feed takes the table as it is (no host copy of the whole table)
feed = IndexFeed(tiny_config("refresh.mode=inprocess"), os.environ["SHARD_WORK"], mesh,
                 realm_model(tiny_config().model), tokens)
assert feed.tokens is tokens.rows and feed.num_blocks == tokens.shape[0]
blocks = datasets.blocks_source(remote)
config = load_config("configs/realm.py:smoke", json.loads(os.environ["SHARD_OVERRIDES"]))
loaders = [iter(pipeline.train_loader(config, d, global_batch_size=8, seed=3))
           for d in (remote, local)]
for _ in range(3):
    got, ref = next(loaders[0]), next(loaders[1])
    assert got.keys() == ref.keys()
    for k in got:
        assert np.array_equal(got[k], ref[k]), k
examples = datasets.examples_source(remote)
print("READ", json.dumps({"shards": sorted(blocks.opened), "rows": blocks.records_read,
                          "examples": examples.records_read}), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_each_read_only_their_rows(data, fresh, tmp_path):
    """Each of 2 processes reads the blocks of its 2 devices' rows (about half the blocks
    dataset, 2 of its 3 shards) and its rows of the training batches, from gs:// in place."""
    import portpicker

    local, _, remote, _ = data
    server = os.environ["STORAGE_EMULATOR_HOST"]
    proxies = [CountingProxy(server) for _ in range(2)]
    port = portpicker.pick_unused_port()
    procs = []
    try:
        for pid in range(2):
            env = {
                **os.environ,
                "XLA_FLAGS": "",
                "JAX_PLATFORMS": "cpu",
                "CLOUD_STORAGE_EMULATOR_ENDPOINT": proxies[pid].url,  # array_record's reads
                "SHARD_LOCAL": local,
                "SHARD_REMOTE": remote,
                "SHARD_WORK": str(tmp_path / "work"),
                "SHARD_OVERRIDES": json.dumps(OVERRIDES),
            }
            log = open(tmp_path / f"worker.{pid}", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, str(port), str(pid)],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        outs = []
        for pid, p in enumerate(procs):
            p.wait(timeout=300)
            outs.append(open(tmp_path / f"worker.{pid}").read())
            assert p.returncode == 0, outs[-1][-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for proxy in proxies:
            proxy.close()
    reads = [json.loads(o.split("READ ", 1)[1].splitlines()[0]) for o in outs]
    folder = os.path.join(data[1], "blocks", "realm_blocks", "1.0.0")
    shard_files = sorted(f for f in os.listdir(folder) if "array_record" in f)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in shard_files)
    blocks = json.load(open(os.path.join(local, "summary.json")))["counts"]["blocks"]
    # process 0 holds rows [0, N/2): shard 0 and the first half of shard 1; process 1 the rest
    assert reads[0]["shards"] == [0, 1] and reads[1]["shards"] == [1, 2], reads
    assert reads[0]["rows"] + reads[1]["rows"] == blocks, reads
    assert reads[0]["examples"] > 0 and reads[1]["examples"] > 0  # their rows, read in place
    got = [proxy.of("realm_blocks-train.array_record") for proxy in proxies]
    ex = [proxy.of("realm_examples-train.array_record") for proxy in proxies]
    print(f"blocks shards: {total} bytes; per process (requests, bytes): {got}; examples: {ex}")
    never = {0: shard_files[2], 1: shard_files[0]}
    for pid, proxy in enumerate(proxies):
        assert proxy.of(never[pid]) == (0, 0), (pid, dict(proxy.requests))
        _, got = proxy.of("realm_blocks-train.array_record")
        assert 0 < got < 0.8 * total, (pid, got, total)  # half its rows + what was in flight
    assert not os.path.exists(fresh / "prepared")  # no host copied the data dir
