"""`realm-jax plan`: slice names against Cloud TPU's published shapes, per-device figures against
a count of the parameters, clear failures for broken meshes and programs that do not fit, and
rematerialisation lowering XLA's compiled temporaries. The base-on-64-devices compile is slow
and marked (make test-slow)."""

import math

import jax
import pytest
from flax import linen as nn

from realm_jax import plan
from realm_jax.config import load_config
from tests.support.plan_runs import run_plan

SMOKE = ["--config", "configs/realm.py:smoke", "--num_blocks", "500"]


# Cloud TPU's slice shapes as its documentation (and maxtext's table) names them.
PUBLISHED = {
    "v3-8": ("v3:2x2", 8),
    "v3-32": ("v3:4x4", 32),
    "v3-64": ("v3:4x8", 64),
    "v4-8": ("v4:2x2x1", 4),
    "v4-16": ("v4:2x2x2", 8),
    "v4-64": ("v4:2x4x4", 32),
    "v4-128": ("v4:4x4x4", 64),
    "v4-512": ("v4:4x8x8", 256),
    "v4-4096": ("v4:8x16x16", 2048),
    "v5p-128": ("v5:4x4x4", 64),
    "v5e-8": ("v5e:2x4", 8),
    "v5e-256": ("v5e:16x16", 256),
    "v6e-64": ("v6e:8x8", 64),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_slice_names_map_to_the_published_topologies(name):
    target = plan.parse_target(name)
    assert (target.topology, target.num_devices) == PUBLISHED[name]
    assert target.hbm_bytes == {"v3": 16, "v4": 32, "v5p": 95, "v5e": 16, "v6e": 32}[
        target.family
    ] * (1024**3)


def test_explicit_topologies_and_bad_names():
    t = plan.parse_target("v4:2x2x2")
    assert (t.num_devices, t.chip_config, t.family) == (8, "megacore", "v4")
    assert plan.parse_target("v3:4x8").num_devices == 64  # two TensorCores a chip
    assert plan.parse_target("cpu:16", hbm_gib=2).hbm_bytes == 2 * 1024**3
    for bad in ("v9-8", "v4", "tpu-64", "v3-7"):
        with pytest.raises(plan.PlanError):
            plan.parse_target(bad)
    with pytest.raises(plan.PlanError, match="power of two"):
        plan.parse_target("v4-96")  # 48 chips: the topology must be named exactly


def _param_bytes(config_spec: str) -> int:
    """Every parameter of the REALM model, counted from eval_shape: float32 bytes."""
    from realm_jax.pretrain import step

    config = load_config(config_spec)
    _, _, init = step.state_parts(config)
    params = jax.eval_shape(lambda: nn.meta.unbox(init(jax.random.key(0))))
    return sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(params))


@pytest.mark.system  # two AOT compiles; CI keeps plan's refusals and the ICT/QA programs
def test_smoke_plan_figures(tmp_path):
    """On 4 fake devices (data axis 4): replicated parameters are the whole model per device,
    Adam holds two copies of them, the index shards are a quarter of the padded corpus; with
    a 1 MiB HBM nothing fits, which is exit 2 with the figures still written."""
    rc, out, err, fig = run_plan(tmp_path, *SMOKE, "--topology", "cpu:4", "--hbm_gib", "0.001")
    assert rc == 2, (out, err)
    assert "does NOT fit" in out and "REALM train step" in out and "refresh" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("realm-jax plan: error: ") and "does not fit cpu:4's HBM" in last
    head, (train, refresh, evaluation) = fig["header"], fig["programs"]
    assert evaluation["program"] == "REALM evaluation" and evaluation["total"] > 0
    assert head["devices"] == 4 and head["mesh"] == {"data": 4, "model": 1}
    assert head["blocks_per_device"] == 125
    g = train["groups"]
    params = _param_bytes("configs/realm.py:smoke")
    assert g["parameters"] == params
    assert params * 2 <= g["optimizer state"] <= params * 2 + 1024  # mu, nu (+ counts)
    c = load_config("configs/realm.py:smoke")
    assert g["block embeddings shard"] == 125 * c.model.proj_size * 4
    assert g["token table shard"] == 125 * c.data.block_len * 2  # uint16 ids
    assert train["xla"]["temporaries"] > 0 and not train["fits"]
    x = train["xla"]
    assert train["total"] == (
        x["arguments"] + x["outputs"] - x["aliased"] + x["temporaries"] + x["generated_code"]
    )
    assert refresh["groups"]["token table shard"] == g["token table shard"]

    # FSDP: the hidden dimension of every weight split 4 ways (LayerNorm vectors too).
    rc, out, err, fsdp = run_plan(
        tmp_path, *SMOKE, "--topology", "cpu:4", "--config.mesh.fsdp=true", name="fsdp.json"
    )
    assert rc == 0, err
    assert "fits" not in out  # no HBM given for cpu:N: no verdict
    sharded = fsdp["programs"][0]["groups"]["parameters"]
    assert sharded * 4 == pytest.approx(params, rel=0.02)


def _programs(spec: str, overrides: list[str], devices: int, num_blocks: int):
    """plan's programs for a config on the first `devices` of this process's fake devices."""
    from realm_jax import sharding

    config = load_config(spec, overrides)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:devices])
    return plan.PROGRAMS[config.task](config, mesh, num_blocks)


@pytest.mark.system  # compiles the step twice: CI keeps plan's refusals and the ICT/QA programs
def test_remat_lowers_the_compiled_temporaries():
    """XLA's memory analysis, not RSS: the layers' scan under jax.checkpoint keeps only their
    inputs (the 4 x 256 step at the peer benchmark's shapes: 3.35 -> 0.89 GB on XLA:CPU)."""
    temps = {}
    for remat in ("false", "true"):
        over = [f"model.remat={remat}", "train.batch_size=16"]
        train = _programs("configs/realm.py:smoke", over, 1, 500)[0]
        temps[remat] = plan.analyse(train, None)["xla"]["temporaries"]
    assert temps["true"] < 0.6 * temps["false"], temps


@pytest.mark.parametrize(
    "args, message",
    [
        (("--config.mesh.shape=(-1,3)",), "mesh.shape (-1, 3) does not divide 4 devices"),
        (("--config.train.batch_size=6",), "train.batch_size 6 is not divisible"),
        (
            ("--config.mesh.axes=('data','expert')", "--config.mesh.shape=(2,2)"),
            "mesh axis 'expert' (size 2) is used by no sharding rule",
        ),
        (("--num_blocks=3",), "3 blocks for 4 devices"),
        (("--config.train.grad_accum=4",), "must be divisible by 16"),
        (("--topology=v4-96",), "48 chips: not a power of two"),
    ],
)
def test_a_plan_that_cannot_run_fails_clearly(tmp_path, args, message):
    """Refused before anything is compiled: one line, exit 2."""
    rc, out, err, _ = run_plan(
        tmp_path, "--config", "configs/realm.py:smoke", "--topology", "cpu:4", *args
    )
    assert rc == 2, (out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("realm-jax plan: error: ") and message in last, err


@pytest.mark.system  # 50 s of compiles; the plan's refusals and REALM programs stay in CI
def test_ict_and_qa_programs():
    ict = [plan.analyse(p, None) for p in _programs("configs/ict.py:smoke", [], 2, 64)]
    assert [p["program"] for p in ict] == ["ICT train step"]
    qa = [plan.analyse(p, None) for p in _programs("configs/orqa.py:smoke", [], 2, 64)]
    names = ["QA fine-tuning step", "refresh: embed the corpus", "QA evaluation"]
    assert [p["program"] for p in qa] == names
    for p in ict + qa:
        assert p["total"] > 0 and p["groups"]["parameters"] > 0


@pytest.mark.slow
def test_base_plans_on_a_64_device_topology(tmp_path):
    """configs/realm.py:base (BERT-base x 3, batch 512, 13.35M blocks) compiled for 64
    devices: v3-64 through libtpu where it is installed, 64 fake CPU devices otherwise."""
    rc, out, err, fig = run_plan(
        tmp_path, "--config", "configs/realm.py:base", "--topology", "v3-64", timeout=3600
    )
    assert fig is not None, err
    head, train = fig["header"], fig["programs"][0]
    assert head["devices"] == 64 and head["per_data_shard"] == 8
    assert head["num_blocks"] == plan.WIKIPEDIA_BLOCKS
    assert train["groups"]["token table shard"] == -(-plan.WIKIPEDIA_BLOCKS // 64) * 288 * 2
    if plan.libtpu_version() is not None:
        assert rc == 0 and all(p["fits"] for p in fig["programs"]), out


def test_refresh_slice_plan_and_the_flop_count_it_is_read_with(tmp_path):
    """`--programs refresh` compiles the refresh job's corpus embedding alone (what a refresh
    slice runs); and benchmarks/flops.py's hand count of a document embedder's FLOPs, which
    benchmarks/refresh_scale.py scales to 13M blocks, agrees with XLA's cost analysis of that
    program (one embedding chunk, so no loop body is counted once for many trips)."""
    rc, out, err, fig = run_plan(tmp_path, *SMOKE, "--topology", "cpu:2", "--programs", "refresh")
    assert rc == 0, err
    assert [p["program"] for p in fig["programs"]] == ["refresh: embed the corpus"]
    assert "REALM train step" not in out

    from benchmarks.flops import embedder_flops
    from realm_jax import sharding
    from realm_jax.index.embedding import abstract_params, embed_blocks_fn
    from realm_jax.model.bert import ModelConfig
    from realm_jax.model.realm import doc_embedder_name

    config = load_config("configs/realm.py:smoke")
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    e = ModelConfig.from_config(config.model, "embedder")
    name = doc_embedder_name(e)
    model, params = abstract_params(config, mesh, name)
    n = config.refresh.embed_batch_size  # one chunk
    tokens = jax.ShapeDtypeStruct((n, config.data.block_len), jax.numpy.int32)
    fn = embed_blocks_fn(model, mesh, n)
    cost = fn.lower({name: params}, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost["flops"] == pytest.approx(embedder_flops(e, n, config.data.block_len), rel=0.1)


def test_roofline_counts_every_loop_trip_and_names_the_bound():
    """XLA's cost analysis counts a while loop's body once; plan adds the other trips
    (loop_cost): the refresh program on 2 devices (250 blocks each, 5 chunks of 50) then
    matches benchmarks/flops.py's hand count of the document embedder. The step time is the
    largest of the compute, memory and communication terms, and the bound names it; a rate
    not published leaves its term out."""
    from benchmarks.flops import embedder_flops
    from realm_jax import sharding
    from realm_jax.model.bert import ModelConfig

    config = load_config("configs/realm.py:smoke")
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:2])
    program = plan.refresh_program(config, mesh, 500)
    rates = {"peak_flops": 1e12, "hbm_bw": 1e11, "ici_bw": 1e10}
    rf = plan.analyse(program, None, config, mesh, rates)["roofline"]
    hand = embedder_flops(ModelConfig.from_config(config.model, "embedder"), 250, 128)
    assert rf["flops"] == pytest.approx(hand, rel=0.05)
    assert rf["xla_cost_analysis"]["flops"] < 0.3 * hand  # one trip of five
    assert rf["hbm_bytes"] > rf["xla_cost_analysis"]["bytes"] > 0
    assert rf["seconds"]["compute"] == pytest.approx(rf["flops"] / 1e12)
    assert rf["step_seconds"] == max(rf["seconds"].values())
    assert rf["seconds"][rf["bound"]] == rf["step_seconds"]

    for bound, r in {"compute": 1e9, "memory": 1e7, "communication": 1e5}.items():
        out = plan.roofline(1e12, 1e9, 1e8, dict(rates, **{_RATE[bound]: r}))
        assert out["bound"] == bound and out["step_seconds"] == max(out["seconds"].values())
    out = plan.roofline(1e12, 1e12, 1e12, dict(rates, ici_bw=None))
    assert out["seconds"]["communication"] is None and out["bound"] == "memory"


_RATE = {"compute": "peak_flops", "memory": "hbm_bw", "communication": "ici_bw"}


def test_chip_rates_per_device_from_the_published_figures():
    """Per chip over the chip's devices: a v3 chip is two devices; v5p one (megacore)."""
    v3 = plan.chip_rates(plan.parse_target("v3-64"), None)
    assert v3 == {"peak_flops": 61.5e12, "hbm_bw": 450e9, "ici_bw": None}
    v5p = plan.chip_rates(plan.parse_target("v5p-128"), None)
    assert v5p == {"peak_flops": 459e12, "hbm_bw": 2765e9, "ici_bw": 1200e9}
    assert plan.chip_rates(plan.parse_target("v5e-256"), None)["ici_bw"] == 400e9


# An XLA:TPU-style loop: no known_trip_count, a matmul as a convolution over heads (a
# spatial dimension padded 11 each side: each output reads one of the kernel's 12 taps).
_TPU_LOOP = """HloModule m

%fused_computation (param_0: bf16[4,288,768,1], param_1: bf16[768,12,64,1]) -> bf16[4,288,12,64] {
  %param_0 = bf16[4,288,768,1]{3,2,1,0} parameter(0)
  %param_1 = bf16[768,12,64,1]{3,2,1,0} parameter(1)
  ROOT %convolution.1 = bf16[4,288,12,64]{3,2,1,0} convolution(%param_0, %param_1), window={size=1x12 pad=0_0x11_11 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}

%body (p: (s32[], bf16[4,288,768,1], bf16[768,12,64,1])) -> (s32[], bf16[4,288,768,1], bf16[768,12,64,1]) {
  %p = (s32[], bf16[4,288,768,1]{3,2,1,0}, bf16[768,12,64,1]{3,2,1,0}) parameter(0)
  %i = s32[]{:T(256)} get-tuple-element(%p), index=0
  %x = bf16[4,288,768,1]{3,2,1,0} get-tuple-element(%p), index=1
  %w = bf16[768,12,64,1]{3,2,1,0} get-tuple-element(%p), index=2
  %fusion = bf16[4,288,12,64]{3,2,1,0} fusion(%x, %w), kind=kOutput, calls=%fused_computation
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,288,768,1]{3,2,1,0}, bf16[768,12,64,1]{3,2,1,0}) tuple(%next, %x, %w)
}

%cond (p: (s32[], bf16[4,288,768,1], bf16[768,12,64,1])) -> pred[] {
  %p = (s32[], bf16[4,288,768,1]{3,2,1,0}, bf16[768,12,64,1]{3,2,1,0}) parameter(0)
  %n = s32[]{:T(256)} constant(12)
  %i = s32[]{:T(256)} get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[4,288,768,1], w: bf16[768,12,64,1]) -> s32[] {
  %x = bf16[4,288,768,1]{3,2,1,0} parameter(0)
  %w = bf16[768,12,64,1]{3,2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,288,768,1]{3,2,1,0}, bf16[768,12,64,1]{3,2,1,0}) tuple(%zero, %x, %w)
  %while = (s32[], bf16[4,288,768,1]{3,2,1,0}, bf16[768,12,64,1]{3,2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = s32[] get-tuple-element(%while), index=0
}
"""  # noqa: E501 (XLA's lines)


def test_loop_cost_on_xla_tpu_text():
    """XLA:TPU writes no known_trip_count: the trips come from the condition (i < 12); its
    matmuls are convolutions, FLOPs counted from the taps that read input; XLA's count has
    the body once, so loop_cost adds 11 trips of it."""
    _, mult, trips = plan.loop_multipliers(_TPU_LOOP)
    assert trips == {"body": 12} and mult["body"][0] == 12 and mult["fused_computation"][0] == 12
    flops, traffic = plan.loop_cost(_TPU_LOOP)
    assert flops == 11 * 2 * (4 * 288 * 12 * 64) * 768  # the Q projection, 11 more times
    fusion = 2 * (4 * 288 * 12 * 64 + 4 * 288 * 768 + 768 * 12 * 64)  # result + operands
    assert traffic == pytest.approx(11 * fusion, abs=256)  # + the counter's scalars
