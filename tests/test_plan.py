"""`realm-jax plan`: slice names against Cloud TPU's published shapes, per-device figures against
a count of the parameters, clear failures for broken meshes and programs that do not fit, and
rematerialisation lowering XLA's compiled temporaries. The base-on-64-devices compile is slow
and marked (make test-slow)."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import linen as nn

from realm_jax import plan
from realm_jax.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ["--config", "configs/realm.py:smoke", "--num_blocks", "500"]


def run_plan(tmp_path, *args, name="plan.json", timeout=600):
    """The plan command in a fresh process (it fixes the number of fake CPU devices);
    (returncode, stdout, stderr, the JSON figures or None)."""
    out_json = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run(
        [sys.executable, "-m", "realm_jax", "plan", *args, "--json", str(out_json)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    figures = json.loads(out_json.read_text()) if out_json.exists() else None
    return p.returncode, p.stdout, p.stderr, figures


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


def test_smoke_plan_figures(tmp_path):
    """On 4 fake devices (data axis 4): replicated parameters are the whole model per device,
    Adam holds two copies of them, the index shards are a quarter of the padded corpus."""
    rc, out, err, fig = run_plan(tmp_path, *SMOKE, "--topology", "cpu:4", "--hbm_gib", "4")
    assert rc == 0, err
    assert "fits" in out and "REALM train step" in out and "refresh" in out
    head, (train, refresh) = fig["header"], fig["programs"]
    assert head["devices"] == 4 and head["mesh"] == {"data": 4, "model": 1}
    assert head["blocks_per_device"] == 125
    g = train["groups"]
    params = _param_bytes("configs/realm.py:smoke")
    assert g["parameters"] == params
    assert params * 2 <= g["optimizer state"] <= params * 2 + 1024  # mu, nu (+ counts)
    c = load_config("configs/realm.py:smoke")
    assert g["block embeddings shard"] == 125 * c.model.proj_size * 4
    assert g["token table shard"] == 125 * c.data.block_len * 4
    assert train["xla"]["temporaries"] > 0 and train["fits"]
    assert refresh["groups"]["token table shard"] == g["token table shard"]

    # FSDP: the hidden dimension of every weight split 4 ways (LayerNorm vectors too).
    rc, _, err, fsdp = run_plan(
        tmp_path, *SMOKE, "--topology", "cpu:4", "--config.mesh.fsdp=true", name="fsdp.json"
    )
    assert rc == 0, err
    sharded = fsdp["programs"][0]["groups"]["parameters"]
    assert sharded * 4 == pytest.approx(params, rel=0.02)


def test_remat_lowers_the_compiled_temporaries(tmp_path):
    """XLA's memory analysis, not RSS: the layers' scan under jax.checkpoint keeps only their
    inputs (the 4 x 256 step at the peer benchmark's shapes: 3.35 -> 0.89 GB on XLA:CPU)."""
    temps = {}
    for remat in ("false", "true"):
        rc, _, err, fig = run_plan(
            tmp_path,
            *SMOKE,
            "--topology",
            "cpu:1",
            f"--config.model.remat={remat}",
            "--config.train.batch_size=16",
            name=f"remat-{remat}.json",
        )
        assert rc == 0, err
        temps[remat] = fig["programs"][0]["xla"]["temporaries"]
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
        (("--hbm_gib=0.001",), "does not fit cpu:4's HBM"),
        (("--num_blocks=3",), "3 blocks for 4 devices"),
    ],
)
def test_a_plan_that_cannot_run_fails_clearly(tmp_path, args, message):
    rc, out, err, _ = run_plan(
        tmp_path, "--config", "configs/realm.py:smoke", "--topology", "cpu:4", *args
    )
    assert rc == 2, (out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("realm-jax plan: error: ") and message in last, err


def test_ict_and_qa_programs(tmp_path):
    rc, out, err, fig = run_plan(
        tmp_path,
        "--config",
        "configs/ict.py:smoke",
        "--topology",
        "cpu:2",
        "--num_blocks",
        "64",
        name="ict.json",
    )
    assert rc == 0, err
    assert [p["program"] for p in fig["programs"]] == ["ICT train step"]
    rc, out, err, fig = run_plan(
        tmp_path,
        "--config",
        "configs/orqa.py:smoke",
        "--topology",
        "cpu:2",
        "--num_blocks",
        "64",
        name="qa.json",
    )
    assert rc == 0, err
    names = [p["program"] for p in fig["programs"]]
    assert names == ["QA fine-tuning step", "refresh: embed the corpus"]
    assert all(np.isfinite(p["total"]) for p in fig["programs"])


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
    assert train["groups"]["token table shard"] == -(-plan.WIKIPEDIA_BLOCKS // 64) * 288 * 4
    if plan.libtpu_version() is not None:
        assert rc == 0 and all(p["fits"] for p in fig["programs"]), out
