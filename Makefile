# rein: developer and CI entry points. The venv and the Kafka jars are cached outside the checkout
# (${REIN_CACHE:-~/.cache/rein}); the test fixtures start and stop Kafka and Redis themselves.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

# Path of the cached venv for this dependency spec (computed only; `make venv` creates it).
VENV := $(shell bash deploy/venv.sh --path)
PY := $(VENV)/bin/python
# mypy's incremental cache, kept beside the venv so a fresh clone checks in ~1 s instead of ~38 (mypy revalidates
# each module by its content hash and drops a cache written by another mypy version).
MYPY_CACHE := $(VENV)-mypy-cache
# Whole-run limit for pytest (per-test limits come from pytest-timeout in pyproject.toml).
# SIGTERM first (tests/conftest.py stops the broker and Redis on it), SIGKILL a minute later.
TEST_TIMEOUT ?= 70m
TESTS ?= tests
# Parallel pytest workers (pytest-xdist): the suite mostly waits on processes, so more workers than cores;
# the whole-stack scenarios still run one at a time (tests/support/schedule.py). 0: one process.
TEST_WORKERS ?= 4
PYTEST_ARGS ?=
# What `make demo` trains: tiny (the built-in policy), smollm2 (converted once by deploy/smollm2.sh),
# or a path to a Hugging Face directory or a .gguf file. DEMO_ARGS: more flags (python -m ops.demo --help).
MODEL ?= tiny
DEMO_ARGS ?=

.PHONY: venv infra test lint demo clean clean-cache

venv:
	@bash deploy/venv.sh >/dev/null

infra:
	bash deploy/kafka.sh fetch
	bash deploy/redis.sh install

# The run writes bytecode (into the checkout's ignored __pycache__ dirs) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): every Python process of the run would otherwise compile rein's modules again,
# and each worker rewrite every test module's asserts again, about 3 CPU-s of its 11 s collection (docs/development.md).
test: venv infra
	PYTHONDONTWRITEBYTECODE= timeout --signal=TERM --kill-after=60s $(TEST_TIMEOUT) $(PY) -m pytest -n $(TEST_WORKERS) \
	    $(TESTS) $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --cache-dir "$(MYPY_CACHE)" shared services ops bench
	@# Only shared/settings.py reads the environment (tests and bench are exempt, as in ruff's TID251 config,
	@# ops/local/ports.py, a standard-library script the deploy scripts run before any venv exists, and
	@# ops/local/warm.py, whose forked children take a service's environment in place of the server's).
	@if git ls-files -co --exclude-standard -- '*.py' \
	    | grep -vE '^(shared/settings\.py|ops/local/(ports|warm)\.py|tests/|bench/)' \
	    | xargs -r grep -nE 'os\.(environ|getenv)|from os import .*\b(environ|getenv)\b'; then \
	    echo "lint: read the environment only in shared/settings.py" >&2; exit 1; \
	fi

demo: venv infra
	$(PY) -m ops.demo --model "$(MODEL)" $(DEMO_ARGS)

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

# Drops this spec's cached venv, its mypy cache and the pinned Kafka jars (the next run rebuilds them).
clean-cache:
	rm -rf "$(VENV)" "$(VENV).lock" "$(MYPY_CACHE)" "$${REIN_CACHE:-$$HOME/.cache/rein}/kafka-$$(bash deploy/kafka.sh version)"
