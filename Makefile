# Two commands for a fresh clone with only Python 3.11: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit system-deps test-rabbitmq test-cluster test-chaos-long lint typecheck format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,otel]"
	touch $(STAMP)

venv: $(STAMP)

## demo: a sample batch (priorities, deadlines, injected 503/429 faults) through the pipeline;
## starts an embedded Redis, the simulator and a worker when none is running
demo: $(STAMP)
	$(BIN)/pipeline run examples/demo.jsonl -o results.jsonl

# The suite waits on worker nodes and the simulator far more than it computes: three pytest-xdist
# processes, each a session of its own (own key prefix, Celery queues, simulator and nodes),
# run it in ~4 min on 2 cores instead of ~14. A file's tests stay in one process (loadfile).
PYTEST_PARALLEL ?= -n 3 --dist loadfile

## test: lint, type check and the whole suite against a real Redis
test: system-deps $(STAMP) lint typecheck
	$(BIN)/pytest -q $(PYTEST_PARALLEL)

## test-unit: the tests that need no Redis, worker or network (seconds)
test-unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

## system-deps: the system packages the tests need beyond pip (chromium, libfaketime):
## installs them with apt-get when missing (root or passwordless sudo), else stops naming them
system-deps:
	.ci/system-deps

## test-rabbitmq: the end-to-end and gate suites with RabbitMQ as the Celery broker
test-rabbitmq: $(STAMP)
	PIPELINE_TEST_BROKER_URL=$${PIPELINE_TEST_BROKER_URL:-amqp://guest:guest@127.0.0.1:5672//} \
	  $(BIN)/pytest -q $(PYTEST_PARALLEL) tests/integration/test_pipeline.py \
	  tests/integration/test_release_paths.py tests/integration/test_gates_pipeline.py

## test-cluster: the core end-to-end, release-path, gate, scheduling and batch suites with the
## pipeline's state on a private Redis Cluster (3 primaries, 1 replica each; needs redis-cli)
CLUSTER_SUITES = tests/integration/test_pipeline.py tests/integration/test_release_paths.py \
  tests/integration/test_gates_pipeline.py tests/integration/gates \
  tests/integration/test_scheduling_e2e.py tests/integration/test_lookahead.py \
  tests/integration/test_ordering.py tests/integration/test_quota_dispatch.py \
  tests/integration/test_fair_share.py tests/integration/test_merge.py \
  tests/integration/test_over_admission.py tests/integration/test_cancel_abort.py \
  tests/integration/test_token_dispatch.py \
  tests/integration/batch
test-cluster: $(STAMP)
	PIPELINE_TEST_CLUSTER=1 $(BIN)/pytest -q $(PYTEST_PARALLEL) $(CLUSTER_SUITES)

## test-chaos-long: the chaos suite with its long variants (60 s of random worker kills, a node
## holding 200 calls cut off from Redis, a Redis wiped under 200 calls)
test-chaos-long: $(STAMP)
	PIPELINE_CHAOS_LONG=1 $(BIN)/pytest -q tests/chaos

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
