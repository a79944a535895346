"""What each compiled program communicates on a pod, read from XLA's optimized HLO on 4 fake
CPU devices, held to ../shared/DESIGN.md "What each program should communicate": the bound is
computed from the config by hand (plan.comm_bound: one gradient reduction, tensor-parallel
activations, the search's per-shard top-k, the candidates' tokens, the loss's per-row figures),
independently of the HLO it judges. No all-to-all; no gather of a vocabulary table; no
collective that puts the index or the token table on one device; none in the MLM loss's
vocabulary loop (issue 58: the step held 9 all-to-alls and 5 vocabulary gathers, 88.6 MB a
step at smoke size on 2x2, where it now moves 38.3 MB)."""

import jax
import pytest

from realm_jax import hlo_audit, plan, sharding
from realm_jax.config import load_config

NUM_BLOCKS = 1000  # padded to 1000 rows on 4 devices: a size no other array has
VOCAB = 30522


def _audit(spec: str, shape, which: int = 0, overrides=()):
    """(program, its communication audit) on the first 4 fake devices."""
    config = load_config(spec, [f"mesh.shape={shape}", *overrides])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
    program = plan.PROGRAMS[config.task](config, mesh, NUM_BLOCKS)[which]
    return program, plan.analyse(program, None, config, mesh)["communication"]


def _check_design(name: str, comm: dict, shape) -> None:
    found = comm["_found"]
    kinds = {c.kind for c in found}
    assert "all-to-all" not in kinds, [c.describe() for c in found if c.kind == "all-to-all"]
    m = shape[1]
    vocab_sizes = {VOCAB} | ({VOCAB // m} if VOCAB % m == 0 else set())
    # a reduction of its gradient only; the refresh (forward only) may gather the table once
    # a run, outside its loop, where XLA finds that cheaper than each chunk's lookups' sums
    once = name.startswith("refresh")
    moved = [
        c
        for c in hlo_audit.having_dim(found, vocab_sizes)
        if c.kind != "all-reduce" and (c.in_loop or not once or c.count > 1)
    ]
    assert not moved, [c.describe() for c in moved]
    index = hlo_audit.having_dim(found, [sharding.padded_rows(NUM_BLOCKS, _mesh(shape))])
    assert not index, [c.describe() for c in index]
    bound = comm["bound"]
    assert comm["total_bytes"] <= bound["bound"], (name, comm["total_bytes"], bound)


def _mesh(shape):
    return jax.make_mesh(
        shape,
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:4],
    )


# 2x2 (both axes) in make test; the one-axis meshes in the system tier (30 s each)
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((4, 1), marks=pytest.mark.system),
        (2, 2),
        pytest.param((1, 4), marks=pytest.mark.system),
    ],
)
def test_realm_train_step_communicates_what_the_design_needs(shape):
    program, comm = _audit("configs/realm.py:smoke", shape)
    _check_design(program.name, comm, shape)
    assert comm["in_loops"] == 0, comm["largest"]  # nothing inside the loss's vocabulary loop
    if shape[0] > 1:  # the gradient reduction is there, over the data axis, whole
        grads = max(comm["_found"], key=lambda c: c.bytes)
        assert grads.kind == "all-reduce" and grads.group_size == shape[0]
        assert grads.bytes >= plan._bytes_per_device(program.groups["parameters"])


@pytest.mark.system  # train.frozen_step is off by default: make test compiles no such step
def test_frozen_embedders_step_communicates_less_than_the_full_step():
    """The variant for the steps before train.embedders_frozen_steps (plan compiles it last):
    within the design's bound, nothing in the loss's loop, and the reader's gradient reduced
    alone: it moves less than the full step."""
    frozen_steps = ["train.embedders_frozen_steps=2", "train.frozen_step=true"]
    program, comm = _audit("configs/realm.py:smoke", (2, 2), -1, frozen_steps)
    assert program.name == "REALM train step (embedders frozen)"
    _check_design(program.name, comm, (2, 2))
    assert comm["in_loops"] == 0, comm["largest"]
    _, full = _audit("configs/realm.py:smoke", (2, 2), 0, frozen_steps)
    assert comm["total_bytes"] < full["total_bytes"], (comm["total_bytes"], full["total_bytes"])


@pytest.mark.parametrize(
    "spec, which",
    [("configs/realm.py:smoke", 1), ("configs/ict.py:smoke", 0)],
    ids=["refresh", "ict"],
)
def test_refresh_and_ict_communicate_what_the_design_needs(spec, which):
    program, comm = _audit(spec, (2, 2), which)
    _check_design(program.name, comm, (2, 2))


def test_qa_step_communicates_what_the_design_needs():
    """The span head's start and end projections each split over 'model' as weights
    (model/realm.py StartEnd): split as activations they sat on different shards and met
    through 3 all-to-alls and 2 collective-permutes a step."""
    program, comm = _audit("configs/orqa.py:smoke", (2, 2))
    _check_design(program.name, comm, (2, 2))


@pytest.mark.slow  # make test-slow: the TPU compiler (libtpu, .venv-plan) for a v4 slice
def test_realm_train_step_on_a_tpu_topology(tmp_path):
    """The same audit of the TPU compiler's program (v4:2x2x1, 4 devices as a 2x2 mesh): no
    all-to-all, within the bound, and the gradient reduced about once: TPU's compiler joins
    the partial reductions XLA:CPU keeps apart; only the word-embedding table, reduced inside
    the loss and again for its input lookup, goes twice (28.6 MiB against 36.5 on CPU)."""
    if plan.libtpu_version() is None:
        pytest.skip("libtpu is not installed (make test-slow runs in .venv-plan, which has it)")
    from tests.support.plan_runs import run_plan

    args = ["--config", "configs/realm.py:smoke", "--num_blocks", str(NUM_BLOCKS)]
    rc, out, err, fig = run_plan(
        tmp_path,
        *args,
        "--topology",
        "v4:2x2x1",
        "--config.mesh.shape=(2,2)",
        "--programs",
        "train",
    )
    assert rc == 0, err
    comm = fig["programs"][0]["communication"]
    assert "all-to-all" not in comm["by_kind"] and comm["within_bound"], comm
    params = fig["programs"][0]["groups"]["parameters"]
    largest = int(comm["largest"][0].split(" B:")[0].replace(",", ""))  # the gradients'
    assert params * 0.95 <= largest <= params * 1.05, comm["largest"]
