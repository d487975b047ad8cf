# Quick start: `make demo` runs the monitor on the bundled example; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH   = torch==2.13.0
OUT    ?= monitor_output

.PHONY: demo test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	-$(BIN)/msmon build-native  # the one-pass CPU statistics (a few seconds; monitors would build them on first use)
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(VENV)/.lint: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e '.[lint]'
	touch $@

# msmon db and msmon report: the [db] extra (DuckDB)
$(VENV)/.db: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e '.[db]'
	touch $@

# the guided path: a monitored 2-rank job, its anomalies across ranks, one HTML page of the run
demo: $(VENV)/.base $(VENV)/.db
	MONITOR_OUTPUT_DIR=$(OUT) $(BIN)/msmon run --config examples/monitor.json --nproc-per-node 2 \
		-- examples/train_tiny_gpt.py --steps 20
	$(BIN)/msmon analyse -d $(OUT)/anomaly_detected
	$(BIN)/msmon report -d $(OUT) -o $(OUT)/report.html
	@echo "Monitor output is in $(OUT)/ (CSV and TensorBoard per rank: $(BIN)/tensorboard --logdir $(OUT))."
	@echo "The report of the run: $(abspath $(OUT)/report.html)"

test: $(VENV)/.test
	$(BIN)/python -m pytest -q -ra --durations=25  # the slowest tests, for the CI budget (30 min)

# ruff (lint and format), mypy (types): settings in pyproject.toml; the import contract: the layers
# and the torch-free modules in .importlinter, no import cycle (tools/import_cycles.py), no framework
# package importing another (tools/framework_packages.py)
lint: $(VENV)/.lint
	$(BIN)/ruff check src tests benchmarks examples tools
	$(BIN)/ruff format --check src tests benchmarks examples tools
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python tools/import_cycles.py
	$(BIN)/python tools/framework_packages.py

# mypy alone
typecheck: $(VENV)/.lint
	$(BIN)/mypy

# `make bench REV=27a2ae3`: this checkout and REV taking turns in the same run (overhead.py --against)
bench: $(VENV)/.base
	$(BIN)/python benchmarks/overhead.py $(if $(REV),--against $(REV) --configs all_xy "wg+mv+param",)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
