"""Read a PyTorch checkpoint (`pytorch_model.bin`) into numpy arrays without torch and without
running its pickle's code.

torch.save (PyTorch >= 1.6) writes a zip: `<name>/data.pkl` (the pickled object: a dict of
tensors, each a call of torch._utils._rebuild_tensor_v2 on a storage), `<name>/data/<key>` (one
raw little- or big-endian buffer per storage, named by the pickle's persistent ids) and
`<name>/byteorder`. A pickle is a program: unpickling calls whatever callables it names. Here
the unpickler admits a short list of names (the tensor and parameter rebuilds, the storage
classes, torch dtypes, OrderedDict), each mapped to a numpy stand-in written here; any other
name is refused before anything is called (UnsafePickleError names it). Tensor views are
checked against their storage's bounds before numpy reads them.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile

import numpy as np

MAX_DATA_PKL_BYTES = 64 << 20  # data.pkl holds names and shapes, never the tensors' data


class UnsafePickleError(ValueError):
    """A checkpoint that cannot be read safely: a foreign callable, a legacy format, a torn
    zip, a tensor outside its storage."""


# torch storage class name -> numpy dtype of its elements. bfloat16 has no numpy dtype: it is
# read as uint16 and widened to float32 (exact).
_STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
# torch dtype name (pickled as `torch.<name>`) -> element dtype.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float64": "float64",
    "double": "float64",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "int64": "int64",
    "long": "int64",
    "int32": "int32",
    "int": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}


class _StorageType:
    """Stands in for a torch storage class (or dtype) in the pickle: carries the element type."""

    def __init__(self, name: str, dtype: str | None):
        self.name, self.dtype = name, dtype  # dtype None: UntypedStorage (bytes)

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Storage:
    """A storage's raw elements, as a 1-D array in their stored dtype (bfloat16 as uint16)."""

    def __init__(self, data: np.ndarray, dtype: str | None):
        self.data, self.dtype = data, dtype


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, meta=None):
    """numpy's version of torch._utils._rebuild_tensor_v2: a view of `storage` (bounds checked)."""
    del requires_grad, hooks, meta
    if not isinstance(storage, _Storage):
        raise UnsafePickleError(f"a tensor rebuilt from {type(storage).__name__}, not a storage")
    size = tuple(int(s) for s in size)
    stride = tuple(int(s) for s in stride)
    offset = int(offset)
    data = storage.data
    if storage.dtype is None:  # an untyped (byte) storage rebuilt as a tensor: not from torch.save
        raise UnsafePickleError("a tensor over an untyped storage (dtype unknown)")
    if len(size) != len(stride) or offset < 0 or any(s < 0 for s in size + stride):
        raise UnsafePickleError(f"a tensor with size {size}, stride {stride}, offset {offset}")
    if 0 not in size:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= data.shape[0]:
            raise UnsafePickleError(
                f"a tensor of size {size} (stride {stride}, offset {offset}) reaches element "
                f"{last} of a storage of {data.shape[0]}"
            )
        item = data.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(
            data[offset:], shape=size, strides=[s * item for s in stride], writeable=False
        )
    else:
        view = np.zeros(size, data.dtype)
    out = np.array(view)  # a copy: owns its memory, leaves the file mapping alone
    if storage.dtype == "bfloat16":
        return (out.astype(np.uint32) << 16).view(np.float32)
    return out.astype(out.dtype.newbyteorder("="), copy=False)


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    """nn.Parameter's rebuild: the tensor itself."""
    del requires_grad, hooks, state
    if not isinstance(data, np.ndarray):
        raise UnsafePickleError(f"a parameter rebuilt from {type(data).__name__}")
    return data


def _allowed(module: str, name: str):
    """The stand-in for an admitted global, else None."""
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_tensor_v2
    if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        return _rebuild_parameter
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "torch" and name in _STORAGES:
        return _StorageType(name, _STORAGES[name])
    if module == "torch" and name in _DTYPES:
        return _StorageType(name, _DTYPES[name])
    if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
        return _StorageType(name, None)
    return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storages):
        super().__init__(file)
        self.storages = storages  # persistent id -> _Storage

    def find_class(self, module: str, name: str):
        found = _allowed(module, name)
        if found is None:
            raise UnsafePickleError(
                f"the pickle calls {module}.{name}, which is not a tensor rebuild: refused "
                "(nothing in it was run)"
            )
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"unknown persistent id {pid!r:.80}")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(numel, int):
            raise UnsafePickleError(f"a storage of type {kind!r:.60}")
        return self.storages(str(key), kind.dtype, numel)


class TorchZip:
    """An open torch.save zip: `tensors()` reads every tensor of its pickled dict."""

    def __init__(self, path: str):
        self.path = path
        if not zipfile.is_zipfile(path):
            raise UnsafePickleError(legacy_message(path))
        try:
            self.zip = zipfile.ZipFile(path)
            names = self.zip.namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise UnsafePickleError(f"{path}: a damaged zip ({e})") from None
        pkls = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise UnsafePickleError(f"{path}: not a torch.save archive (no <name>/data.pkl)")
        self.prefix = pkls[0][: -len("data.pkl")]
        order = "little"  # archives written before torch 1.10 have no byteorder record
        if self.prefix + "byteorder" in names:
            order = self._read(self.prefix + "byteorder", limit=16).decode(errors="replace")
        if order not in ("little", "big"):
            raise UnsafePickleError(f"{path}: byteorder {order!r}")
        self.order = "<" if order == "little" else ">"
        self._cache: dict[str, _Storage] = {}

    def _read(self, member: str, limit: int | None = None) -> bytes:
        try:
            info = self.zip.getinfo(member)
            if limit is not None and info.file_size > limit:
                raise UnsafePickleError(f"{self.path}: {member} is {info.file_size} bytes")
            return self.zip.read(member)
        except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
            raise UnsafePickleError(f"{self.path}: cannot read {member} ({e})") from None

    def _storage(self, key: str, dtype: str | None, numel: int) -> _Storage:
        if key in self._cache:
            return self._cache[key]
        if dtype is not None and dtype not in _DTYPES.values():
            raise UnsafePickleError(f"{self.path}: a storage of dtype {dtype!r:.40}")
        stored = {"bfloat16": "uint16", None: "uint8"}.get(dtype, dtype)
        dt = np.dtype(stored)
        if dt.itemsize > 1:
            dt = dt.newbyteorder(self.order)
        member = f"{self.prefix}data/{key}"
        try:
            info = self.zip.getinfo(member)
        except KeyError:
            raise UnsafePickleError(f"{self.path}: no {member} (a truncated checkpoint?)") from None
        need = numel * dt.itemsize
        if numel < 0 or info.file_size < need:
            raise UnsafePickleError(
                f"{self.path}: {member} has {info.file_size} bytes, its storage needs {need}"
            )
        data = self._mapped(info, dt, numel)
        if data is None:
            data = np.frombuffer(self._read(member), dt, count=numel)
        self._cache[key] = _Storage(data, dtype)
        return self._cache[key]

    def _mapped(self, info: zipfile.ZipInfo, dt: np.dtype, numel: int) -> np.ndarray | None:
        """The member's bytes mapped in place (torch.save stores them uncompressed), so a
        multi-GB block_emb is not read into memory twice; None when compressed."""
        if info.compress_type != zipfile.ZIP_STORED or numel == 0:
            return None
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            head = f.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise UnsafePickleError(f"{self.path}: damaged zip entry {info.filename}")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + numel * dt.itemsize > os.path.getsize(self.path):
            raise UnsafePickleError(f"{self.path}: truncated ({info.filename} runs past the end)")
        return np.memmap(self.path, dtype=dt, mode="r", offset=start, shape=(numel,))

    def load(self):
        """The unpickled object (a dict of numpy arrays for a state dict)."""
        data = self._read(self.prefix + "data.pkl", limit=MAX_DATA_PKL_BYTES)
        try:
            return _Unpickler(io.BytesIO(data), self._storage).load()
        except UnsafePickleError as e:
            if str(e).startswith(self.path):
                raise
            raise UnsafePickleError(f"{self.path}: {e}") from None
        except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError) as e:
            raise UnsafePickleError(f"{self.path}: cannot unpickle data.pkl ({e})") from None


def legacy_message(path: str) -> str:
    return (
        f"{path}: not a zip archive: the legacy torch.save format (before PyTorch 1.6) is not "
        "read, as its pickles are never loaded; re-save it with a recent PyTorch or convert it "
        "to safetensors"
    )


def looks_like_torch_zip(head: bytes) -> bool:
    """Whether a file's first bytes are a zip's (cheap check before any model is built)."""
    return head[:4] == b"PK\x03\x04"


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """{name: array} from a torch.save'd state dict (pytorch_model.bin), without torch.

    float32/float64/float16/int*/uint8/bool keep their dtype; bfloat16 becomes float32.
    Raises UnsafePickleError for a foreign callable, a legacy (non-zip) file or a damaged one.
    """
    obj = TorchZip(path).load()
    if not isinstance(obj, dict):
        raise UnsafePickleError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray):
            raise UnsafePickleError(f"{path}: entry {name!r:.60} is not a named tensor")
        out[name] = value
    return out
