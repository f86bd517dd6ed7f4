# Two commands for a fresh clone with only Python 3.11: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

## demo: a sample batch (priorities, deadlines, injected 503/429 faults) through the pipeline;
## starts an embedded Redis, the simulator and a worker when none is running
demo: $(STAMP)
	$(BIN)/pipeline run examples/demo.jsonl -o results.jsonl

## test: lint, type check and the whole suite against a real Redis
test: $(STAMP) lint typecheck
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check pipeline tasks tests bench celeryconfig.py
	$(BIN)/ruff format --check pipeline tasks tests bench celeryconfig.py

typecheck: $(STAMP)
	$(BIN)/mypy pipeline tasks

format: $(STAMP)
	$(BIN)/ruff format pipeline tasks tests bench celeryconfig.py
	$(BIN)/ruff check --fix pipeline tasks tests bench celeryconfig.py

clean:
	rm -rf $(VENV) results.jsonl pipeline-worker.log .mypy_cache .ruff_cache .pytest_cache
