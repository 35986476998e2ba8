"""test_sequences.py in the slow lane as a whole: every test in it trains a model on
sequences (2-26 s each on 2 cores). A stand-in until the module carries its own
``pytestmark = pytest.mark.slow``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name == "test_sequences.py":
            item.add_marker(pytest.mark.slow)
