"""Test harness: 8 fake CPU devices, set before JAX starts; paths to ../shared."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("REALM_JAX_SHARED", os.path.join(os.path.dirname(REPO), "shared"))


def shared_path(*parts: str) -> str:
    """A path under ../shared, or skip the test with a clear reason when it is absent."""
    path = os.path.join(SHARED, *parts)
    if not os.path.exists(path):
        pytest.skip(f"needs {path} (the project's ../shared folder, absent in a fresh clone)")
    return path


@pytest.fixture
def shared():
    return shared_path


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
