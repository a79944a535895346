"""`realm-jax plan`: will this config fit that TPU slice? Answered on a laptop, before launch.

    python -m realm_jax plan --config configs/realm.py:base --topology v3-64

compiles the task's programs ahead of time for the topology, as maxtext's train_compile.py
does: with libtpu installed (`make plan` keeps it in its own venv, .venv-plan),
`jax.experimental.topologies.get_topology_desc` describes the slice's devices without a TPU
and `jax.jit(...).lower(<ShapeDtypeStructs with NamedShardings>).compile()` runs the real TPU
compiler; its `memory_analysis()` gives each device's argument, output and temporary bytes.
Without libtpu the same programs are compiled for as many fake CPU devices (XLA:CPU's figures,
which differ from TPU's; the output says so).

Per program (the REALM train step and the refresh job's corpus embedding; the ICT step; the
QA fine-tuning step and its index embedding) and per device it prints the parameters, the
optimizer state, the block-embedding and token-table shards, the batch shard, and XLA's
temporaries, against the chip's HBM, and exits non-zero (PlanError, one line) when a program
does not fit, when the mesh does not divide the batch, or when the mesh has an axis no rule
uses. With the memory: each program's collectives against the design's bound (comm_audit),
and its roofline step time, the largest of FLOPs / bf16 peak, HBM bytes / HBM bandwidth and
collective bytes / ICI bandwidth per device, naming the bound it hits (program_roofline).
`--json FILE` writes the same figures.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import re

from realm_jax.hlo_cost import loop_cost, loop_multipliers  # (light: re and math only)

GiB = 1024**3
# REALM's Wikipedia (December 2018): 13,353,718 blocks of up to 288 wordpieces (paper, §4.3).
WIKIPEDIA_BLOCKS = 13_353_718


log = logging.getLogger("realm_jax.plan")


class PlanError(ValueError):
    """A topology, mesh or config that cannot run, or a program that does not fit."""


@dataclasses.dataclass(frozen=True)
class Family:
    prefix: str  # libtpu's topology prefix ("v5" is v5p)
    dims: int  # 2-D (v2, v3, v5e, v6e) or 3-D torus (v4, v5p)
    cores_in_name: bool  # "v4-64" counts TensorCores (2 a chip); "v5e-64" counts chips
    devices_per_chip: int  # JAX devices a chip shows: 2 (v2/v3 cores) or 1 (megacore, v5e)
    hbm_gib: float  # HBM per JAX device
    chip_config: str = "default"  # libtpu's chip_config_name
    hbm_gbps: float | None = None  # HBM bandwidth per chip, GB/s (None: not published)
    ici_gbps: float | None = None  # bidirectional ICI per chip, GB/s (None: not published)


# Public Cloud TPU figures: v2 8 GiB and v3 16 GiB per TensorCore (each a device); v4 32 GiB,
# v5p 95 GiB per chip (megacore: one device); v5e 16 GiB, v6e 32 GiB per chip. Bandwidths per
# chip from the "key specifications" tables of docs.cloud.google.com/tpu/docs/{v3,v4,v5e,
# v5p,v6e}: HBM v3 900, v4 1200, v5e 819, v5p 2765, v6e 1638 GB/s; "bidirectional
# inter-chip interconnect (ICI) bandwidth (per chip)" v5e 400, v5p 1200, v6e 800 GB/s (older
# versions of those pages: "Interchip Interconnect BW" 1600 and 4800 Gbps, one direction).
# Not published per chip: v2's HBM bandwidth (its page has no specifications), v2/v3/v4 ICI
# (their pages give only per-Pod all-reduce and bisection bandwidth), so the roofline leaves
# those terms out. The bf16 peaks are train/instruments.py's PEAK_FLOPS (per JAX device).
FAMILIES = {
    "v2": Family("v2", 2, True, 2, 8),
    "v3": Family("v3", 2, True, 2, 16, hbm_gbps=900),
    "v4": Family("v4", 3, True, 1, 32, "megacore", hbm_gbps=1200),
    "v5p": Family("v5", 3, True, 1, 95, "megacore", hbm_gbps=2765, ici_gbps=1200),
    "v5e": Family("v5e", 2, False, 1, 16, hbm_gbps=819, ici_gbps=400),
    "v6e": Family("v6e", 2, False, 1, 32, hbm_gbps=1638, ici_gbps=800),
}
PREFIX_FAMILY = {f.prefix: name for name, f in FAMILIES.items()}


@dataclasses.dataclass(frozen=True)
class Target:
    """What to compile for: a TPU slice (topology) or N fake CPU devices."""

    name: str  # as asked: "v3-64", "v4:2x2x2", "cpu:8"
    platform: str  # "tpu" or "cpu"
    num_devices: int
    hbm_bytes: int | None  # per device (None: unknown, for cpu:N without --hbm_gib)
    topology: str = ""  # libtpu's name, e.g. "v3:4x8"
    chip_config: str = "default"
    family: str = ""


def _chip_grid(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice shape of a power-of-two chip count: 2-D doubles the smaller side
    (4 -> 2x2, 8 -> 2x4, 32 -> 4x8, 256 -> 16x16); 3-D grows 2x2x1 last axis first (8 ->
    2x2x2, 32 -> 2x4x4, 64 -> 4x4x4, 256 -> 4x8x8), as Cloud TPU names its slices."""
    if chips < 1 or chips & (chips - 1):
        raise PlanError(
            f"{chips} chips: not a power of two; name the topology exactly, e.g. v4:4x4x12"
        )
    if dims == 2:
        grid = [1, 1]
        while math.prod(grid) < chips:
            grid[0 if grid[0] < grid[1] else 1] *= 2
        return tuple(grid)
    if chips < 4:
        return (chips, 1, 1)
    grid = [2, 2, 1]
    while math.prod(grid) < chips:
        i = max(i for i in range(3) if grid[i] == min(grid))
        grid[i] *= 2
    return tuple(grid)


def parse_target(name: str, hbm_gib: float = 0.0) -> Target:
    """'v3-64' / 'v5e-256' (Cloud TPU slice names), 'v4:2x2x2' (libtpu topology), 'cpu:8'."""
    hbm_override = int(hbm_gib * GiB) if hbm_gib else None
    m = re.fullmatch(r"cpu:(\d+)", name)
    if m:
        return Target(name, "cpu", int(m.group(1)), hbm_override)
    m = re.fullmatch(r"(v\d+[a-z]?)-(\d+)", name)
    if m and m.group(1) in FAMILIES:
        fam = FAMILIES[m.group(1)]
        n = int(m.group(2))
        chips = n // 2 if fam.cores_in_name else n
        if fam.cores_in_name and n % 2:
            raise PlanError(f"{name}: {m.group(1)} slices count TensorCores, 2 a chip")
        grid = _chip_grid(chips, fam.dims)
        topology = f"{fam.prefix}:{'x'.join(map(str, grid))}"
        family = m.group(1)
    else:
        m = re.fullmatch(r"(v\d+[a-z]?):(\d+(?:x\d+)+)", name)
        if not m or m.group(1) not in PREFIX_FAMILY:
            raise PlanError(
                f"unknown --topology {name!r}: use a slice name ({', '.join(FAMILIES)} "
                "followed by -N, e.g. v3-64, v4-64, v5e-256, v5p-128), a libtpu topology "
                "(e.g. v4:2x2x2) or cpu:N"
            )
        family = PREFIX_FAMILY[m.group(1)]
        fam = FAMILIES[family]
        grid = tuple(int(x) for x in m.group(2).split("x"))
        topology, chips = name, math.prod(grid)
    return Target(
        name,
        "tpu",
        chips * fam.devices_per_chip,
        hbm_override or int(fam.hbm_gib * GiB),
        topology,
        fam.chip_config,
        family,
    )


def libtpu_version() -> str | None:
    """libtpu's version if it is installed (the TPU compiler), else None."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "unknown version"


def target_devices(target: Target):
    """(devices, compiler description). TPU topologies need libtpu; without it the same
    number of fake CPU devices stands in (jax_num_cpu_devices must not be fixed yet)."""
    import jax

    if target.platform == "tpu" and libtpu_version() is not None:
        from jax.experimental import topologies

        bounds = (2, 2, 1) if target.num_devices > 4 else (1, 1, 1)
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=target.topology,
            chip_config_name=target.chip_config,
            chips_per_host_bounds=bounds,
            num_slices=1,
        )
        devices = list(topo.devices)
        if len(devices) != target.num_devices:
            raise PlanError(
                f"{target.name}: libtpu describes {len(devices)} devices, expected "
                f"{target.num_devices}"
            )
        return devices, f"libtpu {libtpu_version()} (the TPU compiler, no TPU needed)"
    jax.config.update("jax_num_cpu_devices", target.num_devices)
    devices = jax.devices("cpu")
    if len(devices) != target.num_devices:
        raise PlanError(
            f"could not fake {target.num_devices} CPU devices (got {len(devices)}): run plan "
            "in a fresh process"
        )
    if target.platform == "tpu":
        why = (
            "libtpu is not installed, so XLA:CPU compiled for "
            f"{target.num_devices} fake CPU devices: memory figures are XLA:CPU's, not "
            "TPU's (`make plan` installs libtpu in .venv-plan)"
        )
    else:
        why = f"XLA:CPU, {target.num_devices} fake CPU devices"
    return devices, why


# ------------------------------------------------------------------------------ programs


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
    shard: uneven shardings pad)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def _abstract(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


@dataclasses.dataclass
class Program:
    name: str
    jitted: object  # a jax.jit function
    args: tuple  # ShapeDtypeStructs with shardings
    groups: dict  # label -> tree of the args it holds (per-device accounting)


def _index_args(config, mesh, num_blocks: int, with_embeddings: bool = True):
    import jax.numpy as jnp

    from realm_jax import sharding

    rows = sharding.rows_sharding(mesh)
    n = sharding.padded_rows(num_blocks, mesh)
    tokens = _abstract(  # uint16 ids when the vocabulary fits (index/embedding.py token_dtype)
        (n, config.data.block_len),
        jnp.uint16 if config.model.vocab_size <= 65536 else jnp.int32,
        rows,
    )
    emb = _abstract((n, config.model.proj_size), jnp.float32, rows) if with_embeddings else None
    return emb, tokens


def _batch(mesh, fields: dict):
    import jax.numpy as jnp

    from realm_jax import sharding

    dtypes = {"mlm_weights": jnp.float32}
    b = sharding.batch_sharding(mesh)
    return {k: _abstract(shape, dtypes.get(k, jnp.int32), b) for k, shape in fields.items()}


def _state_groups(state) -> dict:
    return {"parameters": state.params, "optimizer state": state.opt_state}


def realm_programs(config, mesh, num_blocks: int) -> list[Program]:
    import jax.numpy as jnp

    from realm_jax import sharding
    from realm_jax.pretrain import step
    from realm_jax.train.state import abstract_sharded

    model, optimizer, init = step.state_parts(config)
    state, shardings = abstract_sharded(mesh, init, optimizer, config.mesh.get("fsdp", False))
    d, B = config.data, config.train.batch_size
    P = d.max_predictions
    batch = _batch(
        mesh,
        {
            "query_ids": (B, d.query_len),
            "mlm_positions": (B, P),
            "mlm_targets": (B, P),
            "mlm_weights": (B, P),
            "block_id": (B,),
        },
    )
    emb, tokens = _index_args(config, mesh, num_blocks)
    index_step = _abstract((), jnp.int32, sharding.replicated(mesh))
    fn = step.compile_train_step(config, mesh, model, optimizer, shardings, num_blocks)
    groups = _state_groups(state) | {
        "block embeddings shard": emb,
        "token table shard": tokens,
        "batch shard": batch,
    }
    train = Program("REALM train step", fn, (state, batch, emb, tokens, index_step), groups)
    programs = [train, refresh_program(config, mesh, num_blocks)]
    if config.train.eval_every > 0:
        programs.append(realm_eval_program(config, mesh, num_blocks, state))
    if step.frozen_steps(config) > 0:  # the steps before train.embedders_frozen_steps
        frozen = step.compile_train_step(
            config, mesh, model, optimizer, shardings, num_blocks, frozen=True
        )
        args = (state, batch, emb, tokens, index_step)
        programs.append(Program("REALM train step (embedders frozen)", frozen, args, groups))
    return programs


def realm_eval_program(config, mesh, num_blocks: int, state) -> Program:
    """The held-out evaluation's program (pretrain/evaluation.py compile_eval: the forward
    pass and its metrics) at train.eval_batch_size."""
    from realm_jax.pretrain import evaluation, step

    d, B = config.data, config.train.eval_batch_size
    P = d.max_predictions
    fields = {
        "query_ids": (B, d.query_len),
        "mlm_positions": (B, P),
        "mlm_targets": (B, P),
        "mlm_weights": (B, P),
        "block_id": (B,),
    }
    batch = _batch(mesh, fields)
    emb, tokens = _index_args(config, mesh, num_blocks)
    model = step.state_parts(config)[0]
    fn = evaluation.compile_eval(config, mesh, model, num_blocks)
    groups = {
        "parameters": state.params,
        "block embeddings shard": emb,
        "token table shard": tokens,
        "batch shard": batch,
    }
    return Program("REALM evaluation", fn, (state.params, batch, emb, tokens), groups)


def refresh_program(config, mesh, num_blocks: int) -> Program:
    """The refresh job's corpus embedding (the document embedder over the token table)."""
    from realm_jax.index.embedding import abstract_params, embed_blocks_fn
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name

    name = doc_embedder_name(ModelConfig.from_config(config.model, "embedder"))
    model, params = abstract_params(config, mesh, name)
    _, tokens = _index_args(config, mesh, num_blocks, with_embeddings=False)
    fn = embed_blocks_fn(model, mesh, config.refresh.embed_batch_size)
    groups = {"parameters": params, "token table shard": tokens}
    return Program("refresh: embed the corpus", fn, ({name: params}, tokens), groups)


def ict_programs(config, mesh, num_blocks: int) -> list[Program]:
    from realm_jax.ict import step
    from realm_jax.train.state import abstract_sharded

    model, optimizer, init = step.state_parts(config)
    state, shardings = abstract_sharded(mesh, init, optimizer, config.mesh.get("fsdp", False))
    d, B = config.data, config.train.batch_size
    batch = _batch(mesh, {"query_ids": (B, d.query_len), "block_ids": (B, d.block_len)})
    fn = step.compile_train_step(config, mesh, model, optimizer, shardings)
    groups = _state_groups(state) | {"batch shard": batch}
    return [Program("ICT train step", fn, (state, batch), groups)]


def qa_programs(config, mesh, num_blocks: int) -> list[Program]:
    from realm_jax.qa import step
    from realm_jax.train.state import abstract_sharded

    model, optimizer, init = step.state_parts(config)
    step.check_config(config, model, num_blocks, mesh)
    state, shardings = abstract_sharded(mesh, init, optimizer, config.mesh.get("fsdp", False))
    d, q, B = config.data, config.qa, config.train.batch_size
    batch = _batch(
        mesh,
        {
            "question_ids": (B, d.query_len),
            "answer_ids": (B, q.max_answers, q.answer_len),
            "gold_block": (B,),  # read only with qa.gold_in_beam
        },
    )
    emb, tokens = _index_args(config, mesh, num_blocks)
    fn = step.compile_train_step(config, mesh, model, optimizer, shardings, num_blocks)
    groups = _state_groups(state) | {
        "block embeddings shard": emb,
        "token table shard": tokens,
        "batch shard": batch,
    }
    train = Program("QA fine-tuning step", fn, (state, batch, emb, tokens), groups)
    return [
        train,
        refresh_program(config, mesh, num_blocks),
        qa_eval_program(config, mesh, num_blocks, state.params),
    ]


def qa_eval_program(config, mesh, num_blocks: int, params) -> Program:
    """`evaluate`'s reading program (qa/evaluation.py Predictor: qa.step.predict over each
    question's reader_beam_size blocks, traced in the mesh) at train.eval_batch_size."""
    import functools

    import jax
    import jax.numpy as jnp

    from realm_jax import sharding
    from realm_jax.qa import step

    model = step.state_parts(config)[0]
    from realm_jax.qa.evaluation import eval_reader_beam

    B, R = int(config.train.eval_batch_size), eval_reader_beam(config.qa)
    batch = _batch(mesh, {"question_ids": (B, config.data.query_len)})
    ids = _abstract((B, R), jnp.int32, sharding.batch_sharding(mesh))
    emb, tokens = _index_args(config, mesh, num_blocks)
    read = functools.partial(step.predict, model=model, mesh=mesh, length=step.reader_len(config))
    fn = sharding.traced_in_mesh(jax.jit(read), mesh)
    groups = {"parameters": params, "block embeddings shard": emb, "token table shard": tokens}
    return Program("QA evaluation", fn, (params, batch["question_ids"], ids, emb, tokens), groups)


PROGRAMS = {"realm": realm_programs, "ict": ict_programs, "qa": qa_programs}


# ------------------------------------------------------------------------------ checks


def check_mesh(config, mesh, num_blocks: int) -> None:
    """PlanError for a mesh that cannot run this config."""
    from realm_jax import sharding

    for axis, size in mesh.shape.items():
        if axis not in ("data", "model") and size > 1:
            raise PlanError(
                f"mesh axis {axis!r} (size {size}) is used by no sharding rule: parameters "
                "and batch would be replicated over it; use axes ('data', 'model')"
            )
    hosts = len({d.process_index for d in mesh.devices.flat})
    for field in ("train.batch_size",) + (
        ("train.eval_batch_size",) if config.task == "realm" and config.train.eval_every else ()
    ):
        b = config[field.split(".")[0]][field.split(".")[1]]
        data = sharding.data_size(mesh)
        if b % data:
            raise PlanError(
                f"{field} {b} is not divisible by the mesh's data axis ({data} of "
                f"{mesh.devices.size} devices, mesh {dict(mesh.shape)}); change {field} or "
                "--config.mesh.shape"
            )
        if b % hosts:
            raise PlanError(f"{field} {b} is not divisible by the slice's {hosts} hosts")
    accum = int(config.train.get("grad_accum", 1)) if config.task == "realm" else 1
    if config.train.batch_size % (accum * sharding.data_size(mesh)):
        raise PlanError(
            f"train.batch_size {config.train.batch_size} does not split into "
            f"train.grad_accum={accum} micro-batches over the mesh's data axis "
            f"({sharding.data_size(mesh)}): it must be divisible by "
            f"{accum * sharding.data_size(mesh)}"
        )
    if num_blocks < mesh.devices.size:
        raise PlanError(
            f"{num_blocks} blocks for {mesh.devices.size} devices: every device needs at "
            "least one block of the index"
        )
    k = int(config.train.num_candidates) if config.task == "realm" else 0
    if k > num_blocks:
        raise PlanError(f"train.num_candidates {k} exceeds the corpus ({num_blocks} blocks)")


# ------------------------------------------------------------------------------ communication

# XLA:CPU all-reduces a weight's gradient once per place the step uses it (its pass to
# reassociate add(all-reduce(a), all-reduce(b)) is not in the CPU pipeline): REALM's step
# uses the word embeddings twice (input lookup and tied decoder) and the document embedder on
# the null block and the candidates, so its reduction was 1.95x the parameters on 4x1 (ICT's
# 1.0x). The bound allows that factor; docs/architecture.md "What each program communicates".
GRAD_REDUCTIONS = 2.0
SLACK = 1.25  # for the small collectives the formula leaves out (metrics, counts, norms)
SLACK_BYTES = 256 * 1024


def _net(config, part: str):
    from realm_jax.model.bert import ModelConfig

    return ModelConfig.from_config(config.model, part)


def _tensor_parallel(net, tokens: int, model: int) -> int:
    """Megatron's activation all-reduces over `model` for `tokens` tokens on one data shard:
    two per layer forward, two backward, and the vocabulary-parallel embedding's psum (one
    each way), float32 [tokens, H]: 0 without a model axis."""
    if model <= 1:
        return 0
    return 4 * net.hidden_size * tokens * (4 * net.num_layers + 2)


def comm_bound(config, mesh, program: Program) -> dict:
    """What the design lets a program move, per device per run, in collective result bytes
    (../shared/DESIGN.md "What each program should communicate"): one gradient reduction
    (GRAD_REDUCTIONS on XLA:CPU; with FSDP the weights' gathers too), tensor-parallel
    activations, the search's query embeddings and per-shard top-k, the candidates' tokens
    and, for REALM, the vocabulary-parallel loss's per-row figures. {part: bytes, "bound"}."""
    from realm_jax import sharding
    from realm_jax.model.inputs import joint_len

    d, m = sharding.data_size(mesh), dict(mesh.shape).get("model", 1)
    n = mesh.devices.size
    evaluation = program.name.endswith("evaluation")
    B = int(config.train.eval_batch_size if evaluation else config.train.batch_size)
    D = int(config.model.proj_size)
    Lq, Lb = int(config.data.query_len), int(config.data.block_len)
    per = B // d
    parts = {}
    params = _bytes_per_device(program.groups.get("parameters", []))
    fsdp = bool(config.mesh.get("fsdp", False))
    emb, reader = _net(config, "embedder"), _net(config, "reader")
    if program.name.startswith("refresh"):
        rows = sharding.padded_rows(_blocks(program), mesh) // n * m  # one model group's
        parts["tensor parallel"] = _tensor_parallel(emb, rows * Lb, m)
        parts["gathers (fsdp)"] = params * d if fsdp else 0
    elif evaluation:  # forward only: no gradient to reduce
        parts["gathers (fsdp)"] = params * d if fsdp else 0
    else:
        parts["gradients"] = int(params * (d if fsdp else 1) * GRAD_REDUCTIONS) if d > 1 else 0
        parts["gathers (fsdp)"] = 3 * params * d if fsdp else 0
    if program.name.startswith("REALM"):
        K, P_ = int(config.train.num_candidates), int(config.data.max_predictions)
        tokens = per * (K * joint_len(config), Lq, K * Lb)
        parts["tensor parallel"] = _tensor_parallel(reader, tokens[0], m) + sum(
            _tensor_parallel(emb, t, m) for t in tokens[1:]
        )
        parts["retrieval"] = 4 * B * D + 8 * B * K * n + 4 * B * K * Lb
        parts["loss"] = 4 * per * K * P_ * (4 + reader.hidden_size) if m > 1 else 0
    elif program.name.startswith("ICT"):
        parts["tensor parallel"] = sum(_tensor_parallel(emb, per * t, m) for t in (Lq, Lb))
        parts["in-batch embeddings"] = 2 * 4 * B * D
    elif program.name.startswith("QA"):
        from realm_jax.qa.step import reader_len

        q = config.qa
        K, beam = int(q.reader_beam_size), int(q.retriever_beam_size)
        parts["tensor parallel"] = _tensor_parallel(
            reader, per * K * reader_len(config), m
        ) + _tensor_parallel(emb, per * Lq, m)
        parts["retrieval"] = 4 * B * D + 8 * B * beam * n + 4 * B * K * Lb
    parts["bound"] = int(sum(parts.values()) * SLACK) + SLACK_BYTES
    return parts


def _blocks(program: Program) -> int:
    tokens = program.groups["token table shard"]
    return tokens.shape[0]


def comm_audit(compiled, program: Program, config, mesh) -> dict:
    """The compiled program's collectives (hlo_audit) beside the design's bound."""
    from realm_jax import hlo_audit

    text = compiled.as_text()
    # with the loops' trips XLA:TPU leaves unwritten read from their conditions
    found = hlo_audit.collectives(text, mesh.devices.size, loop_multipliers(text)[1])
    bound = comm_bound(config, mesh, program)
    total = hlo_audit.total_bytes(found)
    return {
        "total_bytes": total,
        "by_kind": hlo_audit.summary(found),
        "in_loops": sum(c.in_loop for c in found),
        "largest": [
            f"{c.bytes_per_step:,} B: {c.describe()}"
            for c in sorted(found, key=lambda c: -c.bytes_per_step)[:3]
        ],
        "bound": bound,
        "within_bound": total <= bound["bound"],
        "_found": found,  # for tests and callers in process; dropped from the JSON
    }


# ------------------------------------------------------------------------------ roofline


def chip_rates(target: Target, device) -> dict:
    """Per JAX device: bf16 peak FLOP/s (train/instruments.py's PEAK_FLOPS; on cpu:N the
    measured matmul ceiling), HBM and ICI bytes/s (Family's published figures per chip over
    its devices; None where not published)."""
    from realm_jax.train import instruments

    if target.platform == "cpu":
        return {"peak_flops": instruments.peak_flops(device), "hbm_bw": None, "ici_bw": None}
    fam = FAMILIES[target.family]
    per = fam.devices_per_chip
    return {  # "v5p" finds PEAK_FLOPS's "v5" (first match), as device_kind "TPU v5" does
        "peak_flops": next((p for k, p in instruments.PEAK_FLOPS if k in target.family), None),
        "hbm_bw": fam.hbm_gbps * 1e9 / per if fam.hbm_gbps else None,
        "ici_bw": fam.ici_gbps * 1e9 / per if fam.ici_gbps else None,
    }


def roofline(flops: float, hbm_bytes: float, comm_bytes: float, rates: dict) -> dict:
    """Step time per device = max(FLOPs / peak, HBM bytes / HBM bandwidth, collective bytes
    / ICI bandwidth); a term whose rate is unknown is None and left out; `bound` names the
    largest (compute, memory or communication)."""
    terms = {
        "compute": (flops, rates.get("peak_flops")),
        "memory": (hbm_bytes, rates.get("hbm_bw")),
        "communication": (comm_bytes, rates.get("ici_bw")),
    }
    seconds = {k: (n / r if r else None) for k, (n, r) in terms.items()}
    known = {k: v for k, v in seconds.items() if v is not None}
    bound = max(known, key=known.get) if known else None
    return {
        "flops": flops,
        "hbm_bytes": hbm_bytes,
        "comm_bytes": comm_bytes,
        "seconds": seconds,
        "step_seconds": known[bound] if bound else None,
        "bound": bound,
        "rates": rates,
    }


def program_roofline(cost, hlo_text: str, rates: dict) -> dict:
    """The roofline of a compiled program (per device: the partitioned program's) from
    XLA's cost analysis (`compiled.cost_analysis()`, a dict or a list of one) with the loop
    trips it counts once added (loop_cost), and its collectives' bytes (hlo_audit's, each
    instance times its loop trips, loop_multipliers)."""
    from realm_jax import hlo_audit

    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    extra_flops, extra_bytes = loop_cost(hlo_text)
    _, mult, _ = loop_multipliers(hlo_text)
    comm = sum(
        c.bytes * mult.get(c.computation, (c.count,))[0] for c in hlo_audit.collectives(hlo_text)
    )
    xla = {"flops": float(cost.get("flops", 0)), "bytes": float(cost.get("bytes accessed", 0))}
    out = roofline(xla["flops"] + extra_flops, xla["bytes"] + extra_bytes, comm, rates)
    out["xla_cost_analysis"] = xla  # as XLA counts it: each loop body once
    return out


# ------------------------------------------------------------------------------ compile


def _compile(program: Program):
    """(compiled, None) or (None, the compiler's out-of-memory message)."""
    lowered = program.jitted.lower(*program.args)  # in the mesh, as training traces it
    try:
        return lowered.compile(), None
    except Exception as e:  # XLA:TPU refuses a program that cannot fit at compile time
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
            return None, " ".join(text.split())[:600]
        raise


def analyse(program: Program, hbm_bytes: int | None, config=None, mesh=None, rates=None) -> dict:
    """Per-device bytes: each group of arguments, and XLA's memory analysis of the program;
    with the config and mesh, its collectives beside the design's bound (comm_audit); with
    the chip's rates (chip_rates), its roofline step time (program_roofline)."""
    import time

    t0 = time.perf_counter()
    compiled, oom = _compile(program)
    seconds = time.perf_counter() - t0
    out = {
        "program": program.name,
        "compile_seconds": round(seconds, 1),
        "groups": {k: _bytes_per_device(v) for k, v in program.groups.items()},
    }
    if compiled is None:
        out.update(fits=False, total=None, compiler_error=oom)
        return out
    ma = compiled.memory_analysis()
    xla = {
        "arguments": int(ma.argument_size_in_bytes),
        "outputs": int(ma.output_size_in_bytes),
        "aliased": int(ma.alias_size_in_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
        "generated_code": int(ma.generated_code_size_in_bytes),
    }
    total = (
        xla["arguments"]
        + xla["outputs"]
        - xla["aliased"]
        + xla["temporaries"]
        + xla["generated_code"]
    )
    out.update(xla=xla, total=total, fits=hbm_bytes is None or total <= hbm_bytes)
    if config is not None and mesh is not None:
        out["communication"] = comm_audit(compiled, program, config, mesh)
    if rates is not None:
        out["roofline"] = program_roofline(compiled.cost_analysis(), compiled.as_text(), rates)
    return out


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:8.3f}"


def format_report(head: dict, results: list[dict]) -> str:
    hbm = head["hbm_bytes"]
    lines = [
        f"plan: {head['config']} on {head['target']} ({head['devices']} devices, "
        f"{head['hosts']} host(s), "
        + (f"{hbm / GiB:.1f} GiB HBM per device)" if hbm else "HBM not given: --hbm_gib)"),
        f"  compiler: {head['compiler']}",
        f"  mesh {head['mesh']}; fsdp {'on' if head['fsdp'] else 'off'}; remat "
        f"{'on' if head['remat'] else 'off'}; compute dtype {head['dtype']}; global batch "
        f"{head['batch_size']} ({head['per_data_shard']} per data shard); "
        f"{head['num_blocks']:,} blocks ({head['blocks_per_device']:,} per device, "
        f"{head['num_blocks_source']})",
    ]
    for r in results:
        lines += ["", f"{r['program']} (per device, GiB; compiled in {r['compile_seconds']} s)"]
        for k, v in r["groups"].items():
            lines.append(f"  {k:<34}{_gib(v)}")
        if r["total"] is None:
            lines.append(f"  does NOT fit: the compiler refused it: {r['compiler_error']}")
            continue
        x = r["xla"]
        lines += [
            f"  {'step temporaries (XLA)':<34}{_gib(x['temporaries'])}",
            f"  {'outputs not aliased to inputs':<34}{_gib(x['outputs'] - x['aliased'])}",
            f"  {'generated code':<34}{_gib(x['generated_code'])}",
            f"  {'total (XLA arguments + above)':<34}{_gib(r['total'])}",
        ]
        if hbm:
            share = r["total"] / hbm
            verdict = (
                f"fits: {(hbm - r['total']) / GiB:.2f} GiB headroom"
                if r["fits"]
                else f"does NOT fit: {(r['total'] - hbm) / GiB:.2f} GiB over"
            )
            lines.append(f"  {'of HBM':<34}{share:8.0%}   {verdict}")
        lines += _format_communication(r.get("communication"))
        lines += _format_roofline(r.get("roofline"))
    return "\n".join(lines)


def _format_roofline(rf: dict | None) -> list[str]:
    if not rf:
        return []
    rates = rf["rates"]
    terms = []
    for (k, t), rate, unit in zip(
        rf["seconds"].items(),
        (rates["peak_flops"], rates["hbm_bw"], rates["ici_bw"]),
        ("TFLOP/s", "GB/s", "GB/s"),
    ):
        scale = 1e12 if unit == "TFLOP/s" else 1e9
        terms.append(
            f"{k} {t:.4f} s (at {rate / scale:,.0f} {unit})"
            if t is not None
            else f"{k} - (no published rate)"
        )
    step = rf["step_seconds"]
    return [
        f"  roofline per device per step: {rf['flops']:.3g} FLOP, "
        f"{rf['hbm_bytes'] / GiB:.2f} GiB HBM traffic, {rf['comm_bytes'] / GiB:.3f} GiB "
        "collectives",
        "    " + "; ".join(terms),
        f"    step >= {step:.4f} s: {rf['bound']}-bound" if step else "    no rates: no bound",
    ]


def _format_communication(c: dict | None) -> list[str]:
    if not c:
        return []
    mib = 1024**2
    lines = [f"  communication per device per step (MiB; {c['in_loops']} collectives in loops)"]
    for kind, s in sorted(c["by_kind"].items()):
        lines.append(
            f"    {kind:<32}{s['bytes'] / mib:8.2f}   {s['executions']} executions of "
            f"{s['instructions']} instructions"
        )
    bound = c["bound"]
    verdict = "within" if c["within_bound"] else "ABOVE"
    lines.append(
        f"    {'total':<32}{c['total_bytes'] / mib:8.2f}   {verdict} the design's bound "
        f"{bound['bound'] / mib:.2f} ("
        + ", ".join(f"{k} {v / mib:.2f}" for k, v in bound.items() if k != "bound" and v)
        + ")"
    )
    lines += [f"    largest: {x}" for x in c["largest"][:2]]
    return lines


def num_blocks_for(config, workdir: str, given: int) -> tuple[int, str]:
    """--num_blocks, else the prepared corpus in the workdir, else Wikipedia's 13.35M."""
    if given:
        return given, "--num_blocks"
    if workdir:
        from realm_jax import workdir as paths
        from realm_jax.data import datasets

        summary = datasets.read_summary(paths.data_dir(config, workdir))
        if summary:
            return int(summary["counts"]["blocks"]), "the prepared corpus"
    return WIKIPEDIA_BLOCKS, "REALM's Wikipedia; --num_blocks to change"


def plan(
    config, target: Target, num_blocks: int, source: str = "", only: str = "all"
) -> tuple[dict, list]:
    """(header, one result per program) for config on target; `only`: "train" compiles the
    train step alone, "refresh" the refresh job's corpus embedding alone (a refresh slice)."""
    from realm_jax import sharding

    if config.task not in PROGRAMS:
        raise PlanError(f"task {config.task!r}: plan knows {', '.join(PROGRAMS)}")
    devices, compiler = target_devices(target)
    mesh = sharding.make_mesh(config.mesh, devices)
    check_mesh(config, mesh, num_blocks)
    m = config.model
    head = {
        "config": config.get("variant", ""),
        "target": target.name,
        "devices": len(devices),
        "hosts": len({d.process_index for d in devices}),
        "hbm_bytes": target.hbm_bytes,
        "compiler": compiler,
        "mesh": dict(mesh.shape),
        "fsdp": bool(config.mesh.get("fsdp", False)),
        "remat": bool(m.remat),
        "dtype": m.dtype,
        "batch_size": int(config.train.batch_size),
        "per_data_shard": int(config.train.batch_size) // sharding.data_size(mesh),
        "num_blocks": num_blocks,
        "blocks_per_device": sharding.padded_rows(num_blocks, mesh) // mesh.devices.size,
        "num_blocks_source": source,
    }
    results = []
    programs = PROGRAMS[config.task](config, mesh, num_blocks)
    if only != "all":
        programs = [p for p in programs if p.name.startswith("refresh") == (only == "refresh")]
        if only == "train":  # the train step alone, not the evaluation's forward pass
            programs = [p for p in programs if not p.name.endswith("evaluation")]
        if not programs:
            raise PlanError(f"--programs {only}: task {config.task!r} has no such program")
    rates = chip_rates(target, devices[0])
    for program in programs:
        log.info("compiling %s for %s", program.name, target.name)
        results.append(analyse(program, target.hbm_bytes, config, mesh, rates))
    return head, results


def command(config, args) -> int:
    """`realm-jax plan`: the report on the console, and with --json the same figures in a
    file, local or gs:// (written whole through realm_jax.fs)."""
    from realm_jax import fs  # lazy, as the rest: the module stays light to import

    target = parse_target(args.topology, args.hbm_gib)
    if args.json:  # a missing bucket fails now, not after minutes of compiling
        fs.check_buckets([args.json])
    n, source = num_blocks_for(config, args.workdir, args.num_blocks)
    head, results = plan(config, target, n, source, getattr(args, "programs", "all"))
    head["config"] = args.config
    print(format_report(head, results), flush=True)
    if args.json:
        for r in results:
            r.get("communication", {}).pop("_found", None)
        fs.write_text(args.json, json.dumps({"header": head, "programs": results}, indent=1))
    over = [r["program"] for r in results if not r["fits"]]
    if over:
        raise PlanError(f"{', '.join(over)} does not fit {target.name}'s HBM (see above)")
    return 0
