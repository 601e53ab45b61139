# kvoffload: the two quick-start commands are `make demo` and `make test`.
# Both do their own idempotent setup (hack/setup.sh).
SHELL := /bin/bash
ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
KVOFFLOAD_CACHE ?= $(if $(XDG_CACHE_HOME),$(XDG_CACHE_HOME),$(HOME)/.cache)/kvoffload
export KVOFFLOAD_CACHE
export PATH := $(ROOT)/.venv/bin:$(KVOFFLOAD_CACHE)/bin:$(PATH)
export PYTHONHASHSEED := 0
PY := $(ROOT)/.venv/bin/python
ARGS ?=

.PHONY: setup demo test lint typecheck scan pytest bench soak clean

setup:
	@hack/setup.sh all

## The main job: a local control plane, the chart, an annotated TensorRT-LLM Deployment, live metrics.
demo: setup
	@$(PY) -m hack.demo

## Every test, after lint, type checks and the security scanners. Pass pytest arguments with ARGS='-m connector'.
test: setup lint typecheck scan pytest

lint:
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check .
	@$(PY) -c "from importlinter.cli import lint_imports_command; lint_imports_command(['--no-cache'])"

typecheck:
	@$(PY) -m mypy common/src operator/src sidecar/src connector/src

## bandit on the code, checkov on the rendered chart; every finding fixed or waived in hack/scan-waivers.yaml.
scan:
	@$(PY) -m hack.scan

pytest:
	@$(PY) -m pytest $(ARGS)

bench: setup
	@$(PY) -m benchmarks.run $(ARGS)

## Reliability soak: every fault at its full count (docs/reliability.md); about 25 minutes.
soak: setup
	@$(PY) -m tests.reliability.soak $(ARGS)

clean:
	rm -rf .venv .cache .mypy_cache .ruff_cache .pytest_cache
