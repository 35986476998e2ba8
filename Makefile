# Two entry points do all the set-up on a fresh machine with python3 and make:
#   make demo   -- trains a small model with fit_large_batch(batch_size=4096)
#   make test   -- ruff, the doctests, then the whole test suite (slow tests included)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint doctest bench bench-quick bench-gpu clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/autosplit demo

lint: $(STAMP)
	$(PY) -m ruff check autosplit tests benchmarks

doctest: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q --doctest-modules autosplit

# PYTEST_ARGS: extra pytest arguments, e.g. --randomly-seed=N to replay a run's order.
test: lint doctest
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -ra -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.overhead

bench-quick: $(STAMP)
	$(PY) -m pytest -q tests/test_benchmarks.py

bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
