"""Test harness: 4 fake CPU devices, set before JAX starts; paths to ../shared; the tiers.

Tiers (docs/testing.md): a test's folder is its tier, and its marker is set here from the folder:
  tests/unit         marker `unit`         in-process checks against independent references
  tests/integration  marker `integration`  the CLI, fake GCS, multi-process jobs, short runs
  tests/system       marker `system`       pod rehearsal, drills, long multi-process runs
  tests/experiments  marker `experiments`  the studies' scripts (experiments/)
A test marked `@pytest.mark.system` in another folder (a long variant beside the tests it
extends) belongs to the system tier. `make check` runs unit, `make test` (CI) unit +
integration, `make test-system` and `make test-experiments` the rest. Shared helpers live in
tests/support/ and here."""

import os

os.environ.setdefault("XLA_FLAGS", "")
# The test process has 4 fake CPU devices (TEST_DEVICES below: the sharded steps against their
# references, on a (2, 2) mesh where a test needs both axes); the CLI and worker processes the
# tests start inherit XLA_FLAGS and see 2, still a sharded data axis. Fake devices share the
# machine's 2 cores: a tiny REALM step ran 10x slower on 8 than on one, and the suite took 2.8
# CPU-min more with 8 here than with 4 (docs/testing.md). REALM_JAX_TEST_DEVICES sets another.
CHILD_DEVICES = 2
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={CHILD_DEVICES}"
# XLA's CPU backend optimisation off, here and in the processes the tests start: the suite's
# programs are tiny and run a few steps, so compiling is most of its time (test_train_step.py
# alone: 31% less CPU, 2026-11-27). Tests that train for real (learning/) drop these flags.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + " ".join(FAST_COMPILE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the session, inherited by every CLI and worker process
# the tests start: the same tiny programs compiled once instead of once per process (what most
# of the suite's time went to). Removed at exit; REALM_JAX_TEST_XLA_CACHE=0 turns it off.
if os.environ.get("REALM_JAX_TEST_XLA_CACHE", "1") != "0" and not os.environ.get(
    "JAX_COMPILATION_CACHE_DIR"
):
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="realm-jax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

TEST_DEVICES = int(os.environ.get("REALM_JAX_TEST_DEVICES", "4"))
jax.config.update("jax_num_cpu_devices", TEST_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHARED = os.environ.get("REALM_JAX_SHARED", os.path.join(os.path.dirname(REPO), "shared"))

# Models by name, offline: the configs name bert-tiny by its hub id (config.BERT_TINY). The tests
# read it through huggingface_hub's own code with the hub offline, from a hub-layout cache made
# here from ../shared's copy of the same model (interop/hub.py seed), inherited by every CLI and
# worker process the tests start. Without ../shared the id cannot be resolved offline and the
# tests that need it skip (or fail under CI=true) through shared_path.
BERT_TINY_DIR = os.path.join(SHARED, "models", "bert-tiny-mlm")
if os.path.isdir(BERT_TINY_DIR) and os.environ.get("REALM_JAX_TEST_HUB", "offline") == "offline":
    import atexit as _atexit
    import shutil as _shutil
    import tempfile as _tempfile

    from realm_jax.config import BERT_TINY
    from realm_jax.interop import hub as _hub

    _hub_cache = _tempfile.mkdtemp(prefix="realm-jax-tests-hf-cache-")
    _atexit.register(_shutil.rmtree, _hub_cache, ignore_errors=True)
    _hub.seed(BERT_TINY_DIR, BERT_TINY, _hub_cache)
    os.environ["HF_HUB_CACHE"] = _hub_cache
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants as _hf_constants  # read at import: set them here too

    _hf_constants.HF_HUB_CACHE, _hf_constants.HF_HUB_OFFLINE = _hub_cache, True


def shared_path(*parts: str) -> str:
    """A path under ../shared, or skip the test with a clear reason when it is absent (a
    user's clone has no ../shared). Under CI=true the test fails instead: CI has ../shared,
    and a test that skipped there would pass without checking anything."""
    path = os.path.join(SHARED, *parts)
    if not os.path.exists(path):
        why = f"needs {path} (the project's ../shared folder, absent in a fresh clone)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI=true: a test of ../shared must run in CI, not skip")
        pytest.skip(why)
    return path


@pytest.fixture
def shared():
    return shared_path


def run_cli(*args: str, timeout: float = 60):
    """`python -m realm_jax ARGS` as a user runs it (a process of its own, on the CPU, from the
    repository): its CompletedProcess, stdout and stderr as text."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "realm_jax", *args],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def prepare_sample_head(tmp_path_factory, config_fn, passages: int) -> str:
    """The bundled sample's first `passages` passages prepared into a fresh temp folder with
    the config `config_fn(*overrides)` gives (the small-corpus fixtures of the trainer,
    checkpoint, drill and resume tests)."""
    from realm_jax.data import prepare

    root = tmp_path_factory.mktemp("corpus")
    with open(os.path.join(REPO, "data", "sample", "corpus.jsonl")) as f:
        lines = f.readlines()[:passages]
    (root / "corpus.jsonl").write_text("".join(lines))
    ddir = str(root / "prepared")
    prepare.prepare(config_fn(f"data.corpus={root / 'corpus.jsonl'}"), ddir)
    return ddir


TIERS = ("unit", "integration", "system", "experiments")


# The longest modules of `make test`, longest first (its --durations, 2026-11-27): collected
# first, so that pytest-xdist (--dist loadfile --no-loadscope-reorder: modules handed out in
# collection order) starts them at once and ends on short unit modules, not on a 4-minute
# one with the other worker idle. Only the suite's wall time depends on this list. (Every long
# module first, by --durations=0, was not faster: 15.3-15.6 min against 14.2, one run each.)
LONGEST_FIRST = (
    "integration/learning/test_world.py",
    "integration/test_trainer.py",
    "integration/test_train_step.py",
    "integration/test_qa_finetune.py",
    "integration/test_gcs.py",
    "integration/test_multiprocess_tasks.py",
    "integration/test_ict.py",
    "integration/test_qa_gold.py",
    "integration/test_release_openqa.py",
    "integration/test_beam_prepare.py",
    "unit/test_qa_step.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark every test with its folder's tier, unless it is marked `system` itself: a long
    variant kept beside the tests it extends (one module, one compile) runs in the system tier.
    A test outside the tier folders is an error. The LONGEST_FIRST modules go first."""
    rank = {}
    for item in items:
        rel = os.path.relpath(str(item.path), os.path.join(REPO, "tests")).split(os.sep)
        if rel[0] not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/<tier>/, tiers {TIERS}")
        if not item.get_closest_marker("system"):
            item.add_marker(getattr(pytest.mark, rel[0]))
        path = "/".join(rel)
        first = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
        rank[item.nodeid] = (first, len(rank))  # the others keep their order
    items.sort(key=lambda item: rank[item.nodeid])


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory):
    """Two sample articles' passages prepared for ORQA fine-tuning, and their questions."""
    from tests.support.runs import prepare_qa_files

    return prepare_qa_files(tmp_path_factory)
