"""benchmarks/device_check.py (issue 58): its stage runner keeps going past skipped and failed
stages, its results file's schema, and the batch halving on an out-of-memory error. No
training: the stages here are fakes."""

import json
import os

import pytest

from benchmarks import device_check as dc


class Clock:
    """A fake monotonic clock: each stage call advances it by `step` seconds."""

    def __init__(self, step: float = 1.0):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        return self.t

    def tick(self) -> None:
        self.t += self.step


def stages(clock: Clock):
    def ok(budget):
        clock.tick()
        return {"budget_seen": budget, "step_time": 0.5, "mfu": 0.4}

    def skip(budget):
        raise dc.Skip("torch + transformers import nowhere")

    def boom(budget):
        clock.tick()
        raise dc.StageError("realm_jax exit 1: ValueError: no\nsecond line: the last one")

    return [("environment", ok), ("peer", skip), ("smoke", boom), ("world", ok)]


def test_the_runner_records_skipped_and_failed_stages_and_keeps_going():
    clock = Clock()
    budgets = {"environment": 30, "smoke": 50}
    recs = dc.run_stages(stages(clock), budgets, deadline=100.0, clock=clock)
    assert [(r["name"], r["status"]) for r in recs] == [
        ("environment", "done"),
        ("peer", "skipped"),
        ("smoke", "failed"),
        ("world", "done"),
    ]
    assert recs[0]["result"]["budget_seen"] == 30 and recs[0]["seconds"] == 1.0
    assert recs[1]["reason"] == "torch + transformers import nowhere"
    assert recs[2]["reason"] == "StageError: second line: the last one"
    assert recs[2]["result"] == {}
    assert recs[3]["budget_s"] == 60  # a stage without a budget of its own


def test_a_stage_gets_no_more_than_the_time_left_and_none_past_the_deadline():
    clock = Clock(step=40.0)
    recs = dc.run_stages(stages(clock), {}, deadline=70.0, clock=clock)
    assert recs[0]["result"]["budget_seen"] == 60  # min(60, 70 left)
    assert recs[2]["status"] == "failed"  # at t=40: 30 s left, runs
    assert recs[3]["status"] == "skipped"  # at t=80: past the deadline
    assert recs[3]["reason"] == "no time left within the overall limit"


def test_the_results_file_schema_and_summary(tmp_path):
    clock = Clock()
    recs = dc.run_stages(stages(clock), {}, deadline=100.0, clock=clock)
    recs[0]["result"] = {"jax": "0.10.2", "count": 1, "kind": "NVIDIA H200"}
    results = {"schema": dc.SCHEMA, "started": "2026-01-01 00:00 UTC", "wall_s": 3.0}
    results.update(commit="abc1234", quick=True, device="1 x NVIDIA H200", command="x")
    results["stages"] = recs
    json_path, md_path = dc.write_results(results, str(tmp_path / "out"))
    back = json.load(open(json_path))
    assert set(back) == {"schema", "started", "wall_s", "commit", "quick", "device"} | {
        "command",
        "stages",
    }
    for rec in back["stages"]:
        assert set(rec) == {"name", "status", "reason", "budget_s", "seconds", "result"}
        assert rec["status"] in ("done", "skipped", "failed")
    md = open(md_path).read()
    assert "| environment | done |" in md and "JAX 0.10.2, 1 x NVIDIA H200" in md
    assert "| peer | skipped |" in md and "| smoke | failed |" in md
    assert "MFU 0.4" in md and "(--quick)" in md


def test_the_batch_is_halved_on_out_of_memory_down_to_the_floor():
    calls = []

    def attempt(micro):
        calls.append(micro)
        if micro > 64:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating at {micro}")
        return {"micro_batch": micro}

    res, tried = dc.fit_batch(attempt, 512)
    assert calls == [512, 256, 128, 64] and res == {"micro_batch": 64}
    assert [t["micro_batch"] for t in tried] == [512, 256, 128]
    assert tried[0]["error"].startswith("RESOURCE_EXHAUSTED")

    calls.clear()
    with pytest.raises(RuntimeError, match="Out of memory"):  # 8 is the floor
        dc.fit_batch(lambda m: attempt(m * 100), 32)
    assert calls == [3200, 1600, 800]  # micro-batches 32, 16, 8


def test_other_errors_are_not_retried():
    calls = []

    def attempt(micro):
        calls.append(micro)
        raise ValueError("a shape error")

    with pytest.raises(ValueError):
        dc.fit_batch(attempt, 512)
    assert calls == [512]


def test_the_world_stage_finds_bert_or_says_random(tmp_path, monkeypatch):
    assert dc.find_bert("/some/folder") == ("/some/folder", "--bert")
    monkeypatch.setattr(dc, "REPO", str(tmp_path / "repo"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    bert, why = dc.find_bert()
    assert bert == "" and "random weights" in why
    os.makedirs(tmp_path / "hub" / "models--google--bert_uncased_L-2_H-128_A-2")
    assert dc.find_bert() == (dc.BERT_TINY_ID, "the HuggingFace cache")


def test_run_metrics_reads_speed_mfu_goodput_and_the_held_out_metric(tmp_path):
    m = {"step": 300, "complete": True, "mfu": 0.31, "goodput": 0.8}
    m["instruments"] = {"step_time": 0.05, "examples_per_sec": 320.0, "compile_seconds": 20.0}
    m["eval"] = {"title_recall@5": 0.4, "accuracy": 0.2, "loss": 3.0}
    (tmp_path / "metrics.json").write_text(json.dumps(m))
    out = dc.run_metrics(str(tmp_path), ("title_recall@5", "accuracy"))
    assert out["mfu"] == 0.31 and out["goodput"] == 0.8 and out["steps_per_s"] == 20.0
    assert out["eval"] == {"title_recall@5": 0.4, "accuracy": 0.2}
    assert out["tflops_per_device"] is None  # not in this run's instruments
