"""Models by name: a HuggingFace hub id (e.g. google/bert_uncased_L-2_H-128_A-2) wherever a
model folder is asked for, downloaded once with huggingface_hub into its cache (progress bars
from huggingface_hub; HF_HOME / HF_HUB_CACHE move the cache, HF_HUB_OFFLINE=1 reads it only).

What comes down is what realm-jax reads and nothing else: config.json, vocab.txt and the
weights, safetensors when the repository has them, else pytorch_model.bin (read through
safe_pickle, never run as code), and a sentence-transformers model's small JSON files (its
modules, pooling and prompts: model.init_retriever_from). TensorFlow and Flax weights are not
fetched.

A name is taken as a hub id only when it is not an existing local path nor a URL, and has the
hub's shape (`name` or `owner/name`); so a folder always wins, and a missing folder whose path
looks like an id (runs/foo) is reported as both a missing folder and an unknown id.
"""

from __future__ import annotations

import functools
import logging
import os
import re

from realm_jax import fs

log = logging.getLogger(__name__)

# the hub's repository ids: an optional owner, then a name; letters, digits, '-', '_', '.'
_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# a sentence-transformers model's description (interop/sentence_embedder.py)
SENTENCE_FILES = ["modules.json", "config_sentence_transformers.json",
                  "sentence_bert_config.json", "1_Pooling/config.json"]  # fmt: skip
SAFETENSORS = ["config.json", "vocab.txt", "model.safetensors", "model.safetensors.index.json",
               "model-*.safetensors", *SENTENCE_FILES]  # fmt: skip
PICKLE = ["config.json", "vocab.txt", "pytorch_model.bin", "pytorch_model.bin.index.json",
          "pytorch_model-*.bin", *SENTENCE_FILES]  # fmt: skip


class HubError(ValueError):
    """A model name that is neither a folder nor a hub model that can be fetched."""


def looks_like_id(path: str) -> bool:
    """Whether `path` has a hub id's shape and is not a local path or a URL that exists."""
    p = os.fspath(path)
    if not p or fs.is_remote(p) or os.path.exists(p) or ".." in p or p.endswith((".", "-")):
        return False
    return bool(_ID.match(p))


def _has_weights(folder: str) -> bool:
    names = set(os.listdir(folder))
    return bool(names & {"model.safetensors", "model.safetensors.index.json"})


@functools.cache
def download(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot folder of hub model `repo_id` (downloaded on first use, then read from
    the cache). A HubError with one line naming the folder alternative when the hub cannot give
    it (offline and not cached, unknown, gated, unreachable)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - a dependency of tokenizers, always there
        raise HubError(f"{repo_id}: not a folder, and huggingface_hub is not installed") from None
    get = functools.partial(huggingface_hub.snapshot_download, repo_id, revision=revision)
    try:
        log.info("model %s: from the HuggingFace hub cache (downloaded on first use)", repo_id)
        folder = get(allow_patterns=SAFETENSORS)
        if not _has_weights(folder):  # no safetensors in the repository: its pickle
            folder = get(allow_patterns=PICKLE)
    except errors.OfflineModeIsEnabled as e:
        raise HubError(_message(repo_id, f"the hub is offline (HF_HUB_OFFLINE) ({e})")) from None
    except errors.LocalEntryNotFoundError:
        why = "the hub cannot be reached"
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            why = "the hub is offline (HF_HUB_OFFLINE=1)"
        raise HubError(_message(repo_id, f"it is not in the HuggingFace cache and {why}")) from None
    except errors.GatedRepoError:
        raise HubError(_message(repo_id, "the model is gated (log in: hf auth login)")) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError):
        raise HubError(_message(repo_id, "the hub has no such model")) from None
    except errors.HFValidationError as e:
        raise HubError(_message(repo_id, f"not a valid hub id ({e})")) from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise HubError(_message(repo_id, f"the hub cannot be reached ({_first_line(e)})")) from None
    log.info("model %s: %s", repo_id, folder)
    return folder


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _message(repo_id: str, why: str) -> str:
    here = "" if os.path.isabs(repo_id) else f" (relative to {os.getcwd()})"
    return (
        f"{repo_id}: no such folder{here}, and as a HuggingFace hub id: {why}; give a local "
        "model folder instead (config.json + model.safetensors or pytorch_model.bin), e.g. one "
        f"made online with: hf download {repo_id} --local-dir DIR"
    )


def resolve(path: str) -> str:
    """`path` itself for a local path or a URL; for a hub id, its local snapshot folder."""
    if looks_like_id(path):
        return download(os.fspath(path))
    return path


def seed(folder: str, repo_id: str, cache_dir: str | None = None, revision: str = "main") -> str:
    """Put a local model folder into a HuggingFace cache as hub model `repo_id` (the hub's own
    layout: refs/<revision> -> snapshots/<commit>/<files>), so that an air-gapped host, or a
    test with HF_HUB_OFFLINE=1, reads it by id through huggingface_hub's own lookup. The commit
    is a hash of the files; the snapshot folder (returned) holds copies of what realm-jax reads."""
    import hashlib
    import shutil

    from huggingface_hub import constants

    names = [n for n in sorted(os.listdir(folder)) if n in _SEEDED or n.endswith(".safetensors")]
    names += [n for n in SENTENCE_FILES if os.path.isfile(os.path.join(folder, n))]
    names = list(dict.fromkeys(names))
    if "config.json" not in names:
        raise HubError(f"{folder}: no config.json: not a model folder")
    h = hashlib.sha1(repo_id.encode())
    for n in names:
        h.update(n.encode() + str(os.path.getsize(os.path.join(folder, n))).encode())
    commit = h.hexdigest()
    root = os.path.join(
        cache_dir or constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--")
    )
    snap = os.path.join(root, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    for n in names:
        os.makedirs(os.path.dirname(os.path.join(snap, n)), exist_ok=True)
        shutil.copyfile(os.path.join(folder, n), os.path.join(snap, n))
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", revision), "w") as f:
        f.write(commit)
    download.cache_clear()
    return snap


_SEEDED = ("config.json", "vocab.txt", "model.safetensors.index.json", "pytorch_model.bin")


def main(argv: list[str] | None = None) -> int:
    """python -m realm_jax.interop.hub seed FOLDER REPO_ID: a model folder into the cache."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m realm_jax.interop.hub", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("seed", help="put a local model folder into the HuggingFace cache by id")
    s.add_argument("folder")
    s.add_argument("repo_id")
    s.add_argument("--cache_dir", default=None, help="default: huggingface_hub's (HF_HUB_CACHE)")
    args = p.parse_args(argv)
    print(seed(args.folder, args.repo_id, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
