"""The release's block corpus: ORQA's blocks.tfr + titles.tfr and HuggingFace's
block_records.npy, read without TensorFlow and without running a pickle.

ORQA's `enwiki-20181220/blocks.tfr` holds one record per block (its UTF-8 text: sentences of
one article joined by spaces) and `titles.tfr`, beside it, the title of each block's article;
record i of both is block i, the row of the release's `block_emb` [13353718, 128] computed from
`[CLS] title [SEP] text [SEP]` cut to 288 wordpieces (orqa/predict/encode_blocks.py).
HuggingFace's `block_records.npy` holds the same texts (no titles) as a numpy object array
of bytes, which np.save stores as a pickle: `load_npy_strings` parses the .npy header itself
and unpickles with an allow-list (numpy's array reconstruction, numpy.dtype of object/bytes/
str, and the bytes builtins), refusing any other callable before it is looked up.

Use from `prepare`: a data.corpus ending in .tfr/.tfrecord(s) or .npy is a release corpus,

    realm-jax prepare --config.data.corpus=gs://orqa-data/enwiki-20181220/blocks.tfr

builds the blocks dataset with block id i = record i (no re-cutting; titles from the sibling
titles.tfr, or empty when there is none): token_ids = [CLS] title [SEP] text [SEP] cut as
ORQA's pad_or_truncate_pair cuts them (title to block_len - 3 wordpieces, the text to what
remains), so the release's block_emb, row for row, is an index of the prepared corpus (with
block_len 288 and the release's uncased BERT vocabulary, realm_jax/assets/vocab.txt, its rows
embed these token_ids, up to differences between HF tokenizers' WordPiece and BERT's
FullTokenizer). Sentences and examples are then made from the blocks as for any corpus.
prepare streams them (data/release_prepare.py: chunks of data.release_chunk_blocks, memory
flat in the corpus; no Beam path). In code: `read_release_blocks(path)` ((title, text) of each
record, here); the blocks made from them are data/release_blocks.py's (`release_chunk`,
`release_blocks`), as this room sits below data/ and reads formats, not our corpus.
"""

from __future__ import annotations

import ast
import pickle
import struct
from collections.abc import Iterator

import numpy as np

from realm_jax import fs
from realm_jax.corpus_errors import CorpusError
from realm_jax.interop import tfrecord

RELEASE_SUFFIXES = (".tfr", ".tfrecord", ".tfrecords", ".npy")
TITLES = "titles.tfr"
NPY_MAGIC = b"\x93NUMPY"


class BlockRecordsError(CorpusError):
    """Release block records that cannot be read safely (the message names the file)."""


# ------------------------------------------------------------------------ .npy without pickle
def read_npy_header(f, path: str) -> tuple[str, bool, tuple[int, ...]]:
    """(descr, fortran_order, shape) from an open .npy file, left at the start of the data."""
    if f.read(6) != NPY_MAGIC:
        raise BlockRecordsError(f"{path}: not a .npy file (bad magic)")
    version = f.read(2)
    if len(version) < 2 or version[0] not in (1, 2, 3):
        raise BlockRecordsError(f"{path}: unsupported .npy version {tuple(version)}")
    size_len = 2 if version[0] == 1 else 4
    raw = f.read(size_len)
    if len(raw) < size_len:
        raise BlockRecordsError(f"{path}: truncated .npy header")
    (n,) = struct.unpack("<H" if size_len == 2 else "<I", raw)
    text = f.read(n)
    if len(text) < n:
        raise BlockRecordsError(f"{path}: truncated .npy header")
    try:
        header = ast.literal_eval(text.decode("utf-8" if version[0] == 3 else "latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise BlockRecordsError(f"{path}: malformed .npy header ({e})") from None
    if not isinstance(descr, str):
        raise BlockRecordsError(f"{path}: structured dtype {descr!r}: not block records")
    return descr, bool(fortran), shape


class _ArrayClass:
    """Stands for numpy.ndarray inside the pickle: usable only as _reconstruct's argument."""


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core
    return core.multiarray._reconstruct


def _reconstruct(cls, shape, typecode):
    if cls is not _ArrayClass:
        raise pickle.UnpicklingError("_reconstruct of something other than numpy.ndarray")
    return _numpy_reconstruct()(np.ndarray, shape, typecode)


def _dtype(spec, align=False, copy=False):
    size = spec[1:] if isinstance(spec, str) else "?"
    if spec[:1] not in ("O", "S", "U") or not (size == "" or size.isdigit()):
        raise pickle.UnpicklingError(f"numpy.dtype({spec!r}) is not a dtype of block records")
    return np.dtype(spec, align=align, copy=copy)


def _latin1(text="", encoding="latin1"):  # how protocol-2 pickles spell bytes objects
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode of something other than latin1 text")
    return text.encode("latin1")


_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): _ArrayClass,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1,
    ("builtins", "bytes"): _latin1,
    ("__builtin__", "bytes"): _latin1,  # protocol 2's name for it (find_class sees it raw)
}


class _Unpickler(pickle.Unpickler):
    """Builds nothing but a numpy array of bytes/str: every global outside _ALLOWED (and any
    persistent id) is refused before it is imported or called."""

    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing {module}.{name}: block records are a numpy array of bytes, and "
                "nothing else is unpickled"
            )
        return _ALLOWED[(module, name)]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refusing a persistent id")


def load_npy_strings(path: str) -> np.ndarray:
    """A 1-D .npy of byte strings: an object array (HF's block_records.npy, np.save with
    allow_pickle=True) unpickled by the allow-list above, or a fixed-width |S array. Returns an
    object array of bytes (str elements encoded as UTF-8)."""
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError:
        raise BlockRecordsError(f"{path}: no such file") from None
    with f:
        descr, fortran, shape = read_npy_header(f, path)
        if len(shape) != 1:
            raise BlockRecordsError(f"{path}: shape {shape}: block records are 1-D")
        if descr == "|O":
            try:
                arr = _Unpickler(f, encoding="latin1").load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
                raise BlockRecordsError(f"{path}: cannot read the pickled array: {e}") from None
        elif descr[:2] == "|S":
            dtype = np.dtype(descr)
            raw = f.read(dtype.itemsize * shape[0])
            if len(raw) < dtype.itemsize * shape[0]:
                raise BlockRecordsError(f"{path}: truncated data")
            arr = np.frombuffer(raw, dtype).astype(object)
        else:
            raise BlockRecordsError(f"{path}: dtype {descr}: block records are byte strings")
    if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != object:
        raise BlockRecordsError(f"{path}: the pickle is not the {shape} object array announced")
    out = np.empty(shape, dtype=object)
    for i, x in enumerate(arr):
        if isinstance(x, str):
            x = x.encode("utf-8")
        if not isinstance(x, bytes):
            raise BlockRecordsError(f"{path}: record {i} is a {type(x).__name__}, not bytes")
        out[i] = x
    del fortran  # 1-D: the order does not matter
    return out


# ------------------------------------------------------------------------------ release blocks
def is_release_corpus(path: str) -> bool:
    """Whether data.corpus names release block records (by extension)."""
    return bool(path) and str(path).endswith(RELEASE_SUFFIXES)


def titles_path(blocks_path: str) -> str | None:
    """titles.tfr beside the blocks file, when there is one."""
    cand = fs.join(fs.dirname(blocks_path), TITLES)
    return cand if fs.basename(blocks_path) != TITLES and fs.isfile(cand) else None


def input_files(blocks_path: str) -> list[str]:
    """The files that define a release corpus (for prepare's fingerprint)."""
    titles = titles_path(blocks_path)
    return [blocks_path] + ([titles] if titles else [])


def _texts(path: str) -> Iterator[bytes]:
    if not fs.exists(path):
        raise BlockRecordsError(f"{path}: no such file")
    if path.endswith(".npy"):
        yield from load_npy_strings(path)
    else:
        yield from tfrecord.read_records(path)


def _decode(raw: bytes, path: str, i: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BlockRecordsError(f"{path}: record {i}: invalid UTF-8 ({e.reason})") from None


def read_release_blocks(blocks_path: str, titles: str | None = "auto") -> Iterator[tuple[str, str]]:
    """(title, text) of every block, block 0 first. titles: a titles file, None for none
    (empty titles), "auto" for titles.tfr beside the blocks file if it exists."""
    titles = titles_path(blocks_path) if titles == "auto" else titles
    title_iter = _texts(titles) if titles else None
    i = -1
    for i, raw in enumerate(_texts(blocks_path)):
        title = ""
        if title_iter is not None:
            t = next(title_iter, None)
            if t is None:
                raise BlockRecordsError(f"{titles} has {i} records, {blocks_path} more")
            title = _decode(t, titles, i)
        yield title, _decode(raw, blocks_path, i)
    if title_iter is not None and next(title_iter, None) is not None:
        raise BlockRecordsError(f"{titles} has more records than {blocks_path} ({i + 1})")
