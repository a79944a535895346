# realm-jax: every target creates/updates .venv from requirements.txt first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOKE_DIR ?= runs/smoke

.PHONY: venv test smoke lint format bench clean squad-qa

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The main job on the bundled sample: prepare the data (idempotent), then trainer + refresher
# together on 2 fake CPU devices. Starts from scratch each time (prepared data is reused).
smoke: $(STAMP)
	rm -rf $(SMOKE_DIR)/checkpoints $(SMOKE_DIR)/index $(SMOKE_DIR)/tb
	$(PY) -m realm_jax prepare --config configs/realm.py:smoke --workdir $(SMOKE_DIR)
	$(PY) -m realm_jax local --config configs/realm.py:smoke --workdir $(SMOKE_DIR) --cpu_devices 2

lint: $(STAMP)
	$(VENV)/bin/ruff check realm_jax configs tests bench
	$(VENV)/bin/ruff format --check realm_jax configs tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format realm_jax configs tests bench
	$(VENV)/bin/ruff check --fix realm_jax configs tests bench

# The open-domain QA reference result (docs/results.md): the squad recipe's stages that are not
# done yet (prepare, ICT, REALM pre-training), ORQA fine-tuning, evaluation. Needs ../shared.
squad-qa: $(STAMP)
	$(PY) bench/squad_qa.py

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(SMOKE_DIR) .pytest_cache
