"""The memory tests build no Keras model."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _seed():
    """Replaces conftest's: nothing here builds a Keras model, and clear_session costs ~0.3 s."""
    yield
