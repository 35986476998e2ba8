"""Fixtures every test gets: fixed seeds, a fresh Keras session, its own probe cache.

The helpers the tests share are in common.py, beside this file."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest


def pytest_configure(config):
    # pytest-randomly shuffles the order and, by default, reseeds `random` and numpy
    # before each test's body, after _seed ran: Keras draws initial weights from
    # `random`, so every order seed would train other models. Only the order varies.
    if hasattr(config.option, "randomly_reset_seed"):
        config.option.randomly_reset_seed = False


def pytest_terminal_summary(terminalreporter, config):
    """The order seed at the end, where a failure is read (-q hides the header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(
            f"Test order: --randomly-seed={seed}. Replay it with "
            f"make test PYTEST_ARGS=--randomly-seed={seed} (add -n 0: one process)")


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield
    # Keras's global state reset; the full gc.collect() clear_session would add took a
    # second a test late in a run (TensorFlow's objects make the heap large), more than
    # most tests themselves. Python's own collector still runs.
    keras.backend.clear_session(free_memory=False)


@pytest.fixture(autouse=True)
def _probe_cache(tmp_path, monkeypatch):
    """Each test its own probe cache: a result one test stored is another's cache hit."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
