# Two entry points do all the set-up on a fresh machine with python3 and make:
#   make demo   -- trains a small model with fit_large_batch(batch_size=4096)
#   make test   -- ruff, mypy, the doctests, the docs built strict, then the whole test suite
#                  (slow tests included); CI's command
# make test-fast: ruff, mypy, the doctests and every test not marked slow (under 2 minutes
# on 2 cores), for the edit-and-test loop.
# make docs builds the documentation site into site/ (make docs-serve: a live preview).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck doctest docs docs-serve bench bench-quick bench-gpu clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,bench,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/autosplit demo

lint: $(STAMP)
	$(PY) -m ruff check autosplit tests benchmarks docs

# mypy over autosplit/ ([tool.mypy] in pyproject.toml): the modules behind
# autosplit.__all__ strict, the rest with check_untyped_defs (a few seconds).
typecheck: $(STAMP)
	$(PY) -m mypy

# Strict: a broken link or reference, a docstring that does not parse, or a name in
# autosplit.__all__ missing from docs/api.md fails the build (a few seconds).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

doctest: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q --doctest-modules autosplit

# PYTEST_ARGS: extra pytest arguments, e.g. --randomly-seed=N to replay a run's order.
test: lint typecheck doctest docs
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -ra -n 2 $(PYTEST_ARGS)

test-fast: lint typecheck doctest
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -ra -n 2 -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.overhead

bench-quick: $(STAMP)
	$(PY) -m pytest -q tests/bench

bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info site
