"""autosplit: train with any batch size on one accelerator, exactly.

The names below are imported on first use, so that ``import autosplit`` (and the
``autosplit`` program's parent process) does not load TensorFlow until it is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autosplit.warn import warn_user

__version__ = "0.2.0"

_EXPORTS = {
    "Accumulated": "autosplit.accumulate",
    "accumulate_gradients": "autosplit.accumulate",
    "accumulate_iterator": "autosplit.accumulate",
    "CheckReport": "autosplit.culprits",
    "check": "autosplit.equivalence",
    "ArgumentError": "autosplit.errors",
    "AutosplitError": "autosplit.errors",
    "BatchSizeError": "autosplit.errors",
    "DatasetError": "autosplit.errors",
    "MemoryLimitError": "autosplit.errors",
    "ModelNotReadyError": "autosplit.errors",
    "NothingFitsError": "autosplit.errors",
    "UnsupportedModelError": "autosplit.errors",
    "WorkerLostError": "autosplit.errors",
    "FitReport": "autosplit.training.report",
    "GradientNoiseScale": "autosplit.training.noise_report",
    "fit_large_batch": "autosplit.training.fit",
    "OomRecovery": "autosplit.training.recovery",
    "ProbeResult": "autosplit.search.probe",
    "probe": "autosplit.search.probe",
    "Trial": "autosplit.search.policy",
    "Split": "autosplit.data.split",
    "split_batch": "autosplit.data.split",
}

# Exported up to 0.2.0, internal since: still importable, with a DeprecationWarning.
_DEPRECATED = {
    "TrainStep": ("autosplit.step.train_step",
                  "autosplit.TrainStep is internal now (its constructor "
                  "takes the pipeline's element format) and leaves the package in a "
                  "future release: train with fit_large_batch, or write your own loop "
                  "with accumulate_gradients or accumulate_iterator."),
}

__all__ = [
    "Accumulated",
    "ArgumentError",
    "AutosplitError",
    "BatchSizeError",
    "CheckReport",
    "DatasetError",
    "FitReport",
    "GradientNoiseScale",
    "MemoryLimitError",
    "ModelNotReadyError",
    "NothingFitsError",
    "OomRecovery",
    "ProbeResult",
    "Split",
    "Trial",
    "UnsupportedModelError",
    "WorkerLostError",
    "__version__",
    "accumulate_gradients",
    "accumulate_iterator",
    "check",
    "fit_large_batch",
    "probe",
    "split_batch",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _DEPRECATED:
        module, message = _DEPRECATED[name]
        warn_user(message, DeprecationWarning)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'autosplit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from autosplit.accumulate import Accumulated, accumulate_gradients, accumulate_iterator
    from autosplit.culprits import CheckReport
    from autosplit.data.split import Split, split_batch
    from autosplit.equivalence import check
    from autosplit.errors import (
        ArgumentError,
        AutosplitError,
        BatchSizeError,
        DatasetError,
        MemoryLimitError,
        ModelNotReadyError,
        NothingFitsError,
        UnsupportedModelError,
        WorkerLostError,
    )
    from autosplit.search.policy import Trial
    from autosplit.search.probe import ProbeResult, probe
    from autosplit.training.fit import fit_large_batch
    from autosplit.training.noise_report import GradientNoiseScale
    from autosplit.training.recovery import OomRecovery
    from autosplit.training.report import FitReport
