"""Device mesh, logical axis rules, and sharded creation of pytrees.

Parameters carry logical axis names (models.py); these rules map them onto mesh axes. The
document index (embeddings and tokens) is sharded by rows over *every* device of the job.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

# Weights: shard the big matrices over 'model' (vocab, mlp, heads); activations' batch on 'data'.
LOGICAL_RULES = (
    ("act_batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("span_pair", None),  # the span head's start|end projection: whole (model/realm.py)
    ("heads", "model"),
    ("embed", None),
    ("embed_out", None),
    ("kv", None),
    ("proj", None),
    ("pos", None),
    ("type", None),
    ("unit", None),
)


class MeshError(ValueError):
    """A mesh that does not fit the devices or the batch."""


def resolve_mesh_shape(shape, num_devices: int) -> tuple[int, ...]:
    """Replace one -1 by the devices left over; check the product equals num_devices."""
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        raise MeshError(f"mesh.shape {tuple(shape)}: at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshError(f"mesh.shape {tuple(shape)} does not divide {num_devices} devices")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise MeshError(
            f"mesh.shape {tuple(shape)} needs {math.prod(shape)} devices, the job has {num_devices}"
        )
    return tuple(shape)


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A mesh from config.mesh (axes + shape with -1 for 'the rest'), Auto axis types."""
    devices = devices if devices is not None else jax.devices()
    axes = tuple(mesh_config.axes)
    if len(axes) != len(mesh_config.shape):
        raise MeshError(
            f"mesh.axes {axes} and mesh.shape {tuple(mesh_config.shape)} differ in length"
        )
    if "data" not in axes:
        raise MeshError(f"mesh.axes {axes} must include 'data'")
    shape = resolve_mesh_shape(mesh_config.shape, len(devices))
    return jax.make_mesh(
        shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes), devices=devices
    )


def inference_mesh(mesh_config, devices=None, batch_size: int = 0) -> Mesh:
    """The mesh to answer with (`ask`, `evaluate`, realm_jax.load): config.mesh when its shape
    fits `devices` (default: the job's), else every axis 1 but 'data', which takes the most of
    the devices that divides `batch_size` (all of them when 0, or in a multi-process job), with
    one log line saying so. A workdir trained on a pod's mesh loads on a laptop: its checkpoint
    is restored resharded to this mesh's shardings (orbax restores to the target's)."""
    devices = list(devices if devices is not None else jax.devices())
    try:
        resolve_mesh_shape(mesh_config.shape, len(devices))
        return make_mesh(mesh_config, devices)
    except MeshError as e:
        axes = tuple(mesh_config.axes)
        if "data" not in axes or len(axes) != len(mesh_config.shape):
            raise
        reason = str(e)
    n = len(devices)
    if batch_size > 0 and jax.process_count() == 1:  # several processes: each keeps its own
        n = max(d for d in range(1, n + 1) if batch_size % d == 0)
    shape = tuple(n if a == "data" else 1 for a in axes)
    log.info(
        "%s here: answering on mesh.shape %s (%s) of %d device(s), the checkpoint resharded",
        reason,
        shape,
        ", ".join(axes),
        n,
    )
    return jax.make_mesh(
        shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes), devices=devices[:n]
    )


def data_size(mesh: Mesh) -> int:
    return mesh.shape["data"]


def check_batch(
    batch_size: int, mesh: Mesh, field: str = "train.batch_size", grad_accum: int = 1
) -> None:
    """The global batch (config field `field`) must split evenly over the data axis and over
    processes, and into grad_accum micro-batches that each split over the data axis."""
    if grad_accum > 1 and batch_size % (grad_accum * data_size(mesh)):
        raise MeshError(
            f"{field} {batch_size} does not split into train.grad_accum={grad_accum} "
            f"micro-batches over the mesh's data axis ({data_size(mesh)}): it must be "
            f"divisible by {grad_accum * data_size(mesh)}; change {field}, train.grad_accum "
            "or mesh.shape"
        )
    if batch_size % data_size(mesh):
        raise MeshError(
            f"{field} {batch_size} is not divisible by the mesh's data axis "
            f"({data_size(mesh)} of {mesh.devices.size} devices, mesh.shape "
            f"{tuple(mesh.shape.values())}); change {field} or mesh.shape"
        )
    if batch_size % jax.process_count():
        raise MeshError(
            f"{field} {batch_size} is not divisible by the job's {jax.process_count()} "
            f"processes (each reads an equal share); change {field} or the process count"
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def rows_spec(mesh: Mesh) -> P:
    """Rows sharded over every mesh axis (the document index)."""
    return P(tuple(mesh.axis_names))


def rows_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, rows_spec(mesh))


# FSDP (config mesh.fsdp): parameters and optimizer state also split their hidden ('embed')
# dimension over the data axis, as maxtext's "fsdp" rules do; XLA all-gathers each weight where
# a layer uses it and reduce-scatters its gradient, so a device holds 1/data of the state.
FSDP_RULES = (("embed", "data"),) + tuple(r for r in LOGICAL_RULES if r[0] != "embed")


def _mesh_axis_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in names)


def divisible_spec(shape, spec: P, mesh: Mesh) -> P:
    """spec with every mesh axis dropped from a dimension it does not divide (that dimension
    replicated instead): a 2-wide type embedding stays whole on a 16-way data axis."""
    parts = tuple(spec) + (None,) * (len(shape) - len(spec))
    return P(*(ax if n % _mesh_axis_size(mesh, ax) == 0 else None for n, ax in zip(shape, parts)))


def logical_shardings(mesh: Mesh, abstract_boxed_tree, fsdp: bool = False):
    """Shardings for a tree whose leaves may be nn.LogicallyPartitioned (others replicated).

    fsdp=True also shards the hidden dimension of every weight over 'data' (FSDP_RULES). A
    mesh axis that does not divide a dimension leaves that dimension replicated."""
    rules = FSDP_RULES if fsdp else LOGICAL_RULES
    specs = nn.get_partition_spec(abstract_boxed_tree)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    return jax.tree.map(
        lambda s, x: NamedSharding(mesh, divisible_spec(x.shape, s.spec, mesh)),
        shardings,
        nn.meta.unbox(abstract_boxed_tree),
    )


def padded_rows(num_rows: int, mesh: Mesh) -> int:
    """Rows rounded up so every device holds the same number."""
    n = mesh.devices.size
    return -(-num_rows // n) * n


def pad_rows(array: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Zero rows appended to [N, ...] so every device holds the same number of rows."""
    n = padded_rows(array.shape[0], mesh)
    if n == array.shape[0]:
        return array
    out = np.zeros((n, *array.shape[1:]), array.dtype)
    out[: array.shape[0]] = array
    return out


def put_rows(array: np.ndarray, mesh: Mesh) -> jax.Array:
    """Put a host [N, ...] array (already padded) on the mesh, sharded by rows.

    Every process passes the full array; each device takes its own rows (works multi-host).
    """
    sharding = rows_sharding(mesh)
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Process-local batch shards -> global arrays sharded on 'data'."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def owned_row_shards(x: jax.Array) -> list[tuple[int, np.ndarray]]:
    """(first row, rows) of each row block of `x` that this process writes when publishing it
    by row ranges: its addressable shards that are replica 0 (so a row block held by several
    devices is written once), each copied from its own device. No communication: the rows of
    other processes' devices are never fetched (issue 58: no whole copy anywhere)."""
    out: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        rows, *rest = shard.index
        if any(r != slice(None) and (r.start, r.stop) != (0, n) for r, n in zip(rest, x.shape[1:])):
            raise ValueError(
                f"owned_row_shards: {x.sharding} splits more than the rows of {x.shape}"
            )
        if shard.replica_id == 0:
            out.setdefault(rows.start or 0, np.asarray(shard.data))
    return sorted(out.items())


def addressable_row_ranges(
    sharding: NamedSharding, shape: tuple[int, ...]
) -> list[tuple[int, int]]:
    """The row ranges [a, b) that this process's devices hold of an array of `shape` under
    `sharding`: what a reader loads of a row-sharded index, and nothing more."""
    index_map = sharding.addressable_devices_indices_map(tuple(shape))
    return sorted({(i[0].start or 0, i[0].stop or shape[0]) for i in index_map.values()})


def _spans_every_process(x: jax.Array) -> bool:
    return len({d.process_index for d in x.sharding.device_set}) == jax.process_count()


def _leaf_to_host(x) -> np.ndarray:
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated and x.sharding.has_addressable_devices:
        return np.asarray(x.addressable_data(0))
    if not _spans_every_process(x):  # a partial gather would leave the others waiting forever
        raise ValueError(
            f"to_host: an array {x.shape} on devices of some processes but not all "
            f"({x.sharding}); put it on this process's devices or on a mesh over all of them"
        )
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_host(tree: Any) -> Any:
    """The whole (global) value of every array in `tree`, as numpy, on every process.

    `jax.device_get` (and `np.asarray`) of an array sharded over devices of other processes
    raises "spans non-addressable devices" on a pod: this works on one process and on many.
    A fully addressable array is fetched (`device_get`), a fully replicated one is read from
    a local shard (no communication), any other one (row-sharded index embeddings, a batch
    split by the data axis) is gathered with `process_allgather(x, tiled=True)`.

    That gather is a collective: on several processes EVERY process must call `to_host` on
    the same arrays in the same order (never under `if jax.process_index() == 0`), or the
    job hangs. The choice of path depends only on the arrays' global shardings, which every
    process agrees on. Leaves that are not jax arrays come back as `np.asarray(leaf)`.
    """
    return jax.tree.map(_leaf_to_host, tree)


def broadcast_text(text: str) -> str:
    """Process 0's `text` on every process (`ask`'s prompt: process 0 reads the question,
    every process answers it). A collective: every process calls it, in the same order."""
    if jax.process_count() == 1:
        return text
    data = np.frombuffer(text.encode(), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    if n == 0:
        return ""
    buf = np.zeros(n, np.uint8)
    buf[: min(n, len(data))] = data[:n]
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


class traced_in_mesh:
    """A jitted function that is traced, lowered and called with `mesh` as the ambient mesh
    (`jax.set_mesh`), so the model's activation constraints (`bert.constrain_batch`) apply:
    outside a mesh they are no-ops. Calls pass through unchanged otherwise."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)
