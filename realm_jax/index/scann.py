"""ScaNN maximum-inner-product search for host-side retrieval.

Used by `ask`, evaluation and corpora too large for device memory; training retrieves exactly
on device instead. Parameters scale with the corpus: a k-means tree of about sqrt(N) leaves,
asymmetric hashing (2 dims per 4-bit code, anisotropic loss) and exact float32 re-scoring of
the best `reorder` candidates. Small corpora use exact brute force (see BRUTE_FORCE_BELOW).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import threading
from typing import Any

import numpy as np

from realm_jax import fs

# Below this many blocks ScaNN searches exactly. A tree of sqrt(N) leaves has about sqrt(N)
# points per leaf, and ScaNN's k-means wants >= 50 per leaf (its min_partition_size) to train
# stable centroids; 4096 blocks gives 64. Exact search of 4096 x 128 costs ~0.5 MFLOP per
# query, so nothing is lost by skipping the tree there.
BRUTE_FORCE_BELOW = 4096
MIN_POINTS_PER_LEAF = 50
MIN_LEAVES_TO_SEARCH = 10
LEAVES_FRACTION = 0.05
AH_DIMS_PER_BLOCK = 2
AH_THRESHOLD = 0.2  # anisotropic quantisation threshold recommended for dot product


def scann_params(
    num_blocks: int,
    *,
    num_leaves: int = -1,
    leaves_to_search: int = -1,
    reorder: int = 100,
    brute_force: bool | None = None,
    tree: bool = True,
) -> dict:
    """ScaNN parameters for a corpus of `num_blocks`; -1 (or 0) picks the size-based default.

    Returns {"brute_force", "tree", "num_leaves", "leaves_to_search", "reorder"} (leaves are 0
    on the brute-force and no-tree paths); passing that dict back in returns it unchanged, so
    build_searcher(emb, **scann_params(n)) works. `brute_force` None decides by size.
    `tree=False` skips the k-means partition (asymmetric hashing + exact re-scoring over every
    block): for mid-size or poorly clustered corpora, where a partition loses recall.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if brute_force is None:
        brute_force = num_blocks < BRUTE_FORCE_BELOW and num_leaves <= 0
    if brute_force:
        return {
            "brute_force": True,
            "tree": False,
            "num_leaves": 0,
            "leaves_to_search": 0,
            "reorder": reorder,
        }
    if not tree:
        return {
            "brute_force": False,
            "tree": False,
            "num_leaves": 0,
            "leaves_to_search": 0,
            "reorder": reorder,
        }
    if num_leaves <= 0:
        most = max(2, num_blocks // MIN_POINTS_PER_LEAF)
        num_leaves = int(min(max(round(math.sqrt(num_blocks)), 2), most))
    if leaves_to_search <= 0:
        leaves_to_search = max(MIN_LEAVES_TO_SEARCH, math.ceil(LEAVES_FRACTION * num_leaves))
    leaves_to_search = min(leaves_to_search, num_leaves)
    return {
        "brute_force": False,
        "tree": True,
        "num_leaves": num_leaves,
        "leaves_to_search": leaves_to_search,
        "reorder": reorder,
    }


def _scann():
    """Import scann lazily: it is heavy and only host-side retrieval needs it."""
    from scann.scann_ops.py import scann_ops_pybind

    return scann_ops_pybind


# ScaNN's C++ logs through absl straight to file descriptor 2: a k-means tree's build prints
# INFO lines (the sampled training set's size, how long the partitioner ran) and, at the
# process's first, absl's notice that logging was not initialised. Neither GLOG_minloglevel,
# TF_CPP_MIN_LOG_LEVEL nor ABSL_MIN_LOG_LEVEL reaches this pybind build (tried: each still
# printed them), so the build runs with fd 2 read through a pipe that drops exactly those
# lines and passes every other line on as it comes (absl's W/E/F lines, Python's own logs).
_ABSL_NOISE = re.compile(
    rb"^(I\d{4} [\d:.]+\s+\d+ [\w.-]+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called)"
)


@contextlib.contextmanager
def _without_native_info():
    """fd 2 through a filter for the duration: absl INFO lines and its uninitialised-logging
    notice dropped, every other line written on at once (so a fatal error is seen)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 to filter
        yield
        return
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not _ABSL_NOISE.match(line):
                        os.write(saved, line + b"\n")
            if pending and not _ABSL_NOISE.match(pending):
                os.write(saved, pending)

    thread = threading.Thread(target=pump, name="scann-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # fd 2 was the pipe's only write end: the pump reads to its end
        thread.join(timeout=10)
        if not thread.is_alive():
            os.close(saved)


def build_searcher(embeddings: np.ndarray, k: int = 10, **params: int) -> Any:
    """Build a dot-product ScaNN searcher over [N, D] embeddings returning `k` neighbours.

    `params` are scann_params overrides (num_leaves, leaves_to_search, reorder, brute_force)
    or a whole scann_params result.
    """
    db = np.ascontiguousarray(embeddings, dtype=np.float32)
    if db.ndim != 2 or db.shape[0] < 1:
        raise ValueError(f"embeddings must be a non-empty [N, D] matrix, got {db.shape}")
    p = scann_params(db.shape[0], **params)
    with _without_native_info():
        return _build(db, k, p)


def _build(db: np.ndarray, k: int, p: dict) -> Any:
    builder = _scann().builder(db, k, "dot_product")
    if p["brute_force"]:
        return builder.score_brute_force().build()
    training_sample = min(db.shape[0], 250_000)
    if p["tree"]:
        builder = builder.tree(
            num_leaves=p["num_leaves"],
            num_leaves_to_search=p["leaves_to_search"],
            training_sample_size=training_sample,
        )
    builder = builder.score_ah(
        AH_DIMS_PER_BLOCK,
        anisotropic_quantization_threshold=AH_THRESHOLD,
        training_sample_size=training_sample,
    )
    return builder.reorder(max(p["reorder"], k)).build()


def save_searcher(searcher: Any, directory: str) -> None:
    """Serialise with paths relative to `directory`, so the directory can be renamed/moved.
    `directory` may be gs://: ScaNN writes local files only, so they are written into a local
    temp folder first and then uploaded."""
    if not fs.is_remote(directory):
        os.makedirs(directory, exist_ok=True)
        searcher.serialize(directory, relative_path=True)
        return
    with tempfile.TemporaryDirectory(prefix="realm-scann-") as local:
        searcher.serialize(local, relative_path=True)
        fs.upload_tree(local, directory)


def load_searcher(directory: str) -> Any:
    """Load a searcher saved by save_searcher. Refuses pickled docids (never unpickle).

    `directory` may be gs://: ScaNN reads local files only, so the folder is downloaded into a
    temp folder under fs.cache_root() (the disk the other remote inputs are copied to; a
    searcher keeps the full embeddings for re-scoring, GiBs at Wikipedia scale), loaded, and
    deleted: the searcher holds everything in memory once loaded, and each index version is
    read once by a one-shot command (`ask`), so a kept copy would only pile up."""
    if fs.exists(fs.join(directory, "scann_docids.pkl")):
        raise ValueError(f"{directory}: holds a pickled docid map; refusing to unpickle it")
    if not fs.isfile(fs.join(directory, "scann_assets.pbtxt")):
        raise FileNotFoundError(f"{directory}: no scann_assets.pbtxt (not a saved searcher)")
    if not fs.is_remote(directory):
        return _scann().load_searcher(directory, assets_backcompat_shim=False)
    os.makedirs(fs.cache_root(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="scann-", dir=fs.cache_root()) as local:
        fs.download_tree(directory, local, list(fs.walk_files(directory)))
        return _scann().load_searcher(local, assets_backcompat_shim=False)


def search(
    searcher: Any, queries: np.ndarray, k: int, *, leaves_to_search: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by dot product: (ids [Q, k] int64, scores [Q, k] float32), best first.

    Rows are padded with id -1 and score -inf when the corpus has fewer than k blocks.
    """
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if q.ndim != 2:
        raise ValueError(f"queries must be [Q, D], got shape {q.shape}")
    if q.shape[0] == 0:
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    run = searcher.search_batched_parallel if q.shape[0] >= 512 else searcher.search_batched
    idx, dist = run(q, final_num_neighbors=k, leaves_to_search=leaves_to_search)
    idx, dist = np.asarray(idx, np.int64), np.asarray(dist, np.float32)
    if idx.shape[1] < k:
        pad = k - idx.shape[1]
        idx = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        dist = np.pad(dist, ((0, 0), (0, pad)), constant_values=-np.inf)
    return idx, dist
