"""Every test here trains a real program (the Keras examples, keras_hub models, long runs,
recompiles, tf.distribute): all of them in the slow lane, run by make test, not by
make test-fast."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
