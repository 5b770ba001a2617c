# tfdag — two commands do all set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench docs install clean stack-up stack-down

# constraints.txt pins every package to the versions the tests last passed with (regenerate it with
# `$(BIN)/python .ci/constraints.py > constraints.txt` after changing pyproject.toml), so two fresh machines match.
$(STAMP): pyproject.toml constraints.txt pipeline_lib/core/_native.c pipeline_lib/core/_native_statistics.c pipeline_lib/core/_native_csv.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt --upgrade setuptools wheel
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,bench]'
	@# pip skips the C extension quietly where it cannot build it (optional = true in pyproject.toml): say which, with
	@# native.py's warning and fix. Without it the stamp stays unwritten, so the next make tries again; under CI=true
	@# (.ci/run) the install fails.
	@if $(BIN)/python -c "import logging, sys; logging.basicConfig(format='tfdag: %(levelname)s: %(message)s'); \
	    from pipeline_lib.core import native; sys.exit(native.module is None)"; then \
	  echo "tfdag: C extension built (pipeline_lib.core._native)"; touch $(STAMP); \
	elif [ "$${CI:-}" = true ]; then \
	  echo "tfdag: CI=true requires the C extension: failing the install" >&2; exit 1; \
	fi

install: $(STAMP)

## Run the whole pipeline on the bundled digits data with embedded defaults (storage under ./.tfdag/).
demo: $(STAMP)
	$(BIN)/tfdag run examples/digits.yaml
	@echo
	@echo "Open the MLflow UI on this store:"
	@echo "  $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/.tfdag/mlflow.db --host 127.0.0.1 --port 5000"

## Run the test suite (unit, multi-replica, multi-worker, flow and server tests) in 2 processes (pytest-xdist; tests
## sharing a session fixture stay in one process, see tests/conftest.py) and print the 25 slowest tests.
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=25
test: $(STAMP)
	./.ci/install-test-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests

## The docs site (mkdocs-material) in site/: the CLI and config references generated from the code, built strict
## (a broken link, anchor or page fails the build).
docs: $(STAMP)
	$(BIN)/python docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## Benchmarks: ratios against baselines measured in the same run; writes bench/results.json.
bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf .tfdag $(VENV)
