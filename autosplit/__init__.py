"""autosplit: train with any batch size on one accelerator, exactly."""

from autosplit.check import CheckReport, check
from autosplit.errors import (
    AutosplitError,
    BatchSizeError,
    DatasetError,
    MemoryLimitError,
    ModelNotReadyError,
    NothingFitsError,
    UnsupportedModelError,
    WorkerLostError,
)
from autosplit.fit import fit_large_batch
from autosplit.probe import ProbeResult, Trial, probe
from autosplit.step import Accumulated, Split, TrainStep, accumulate_gradients, split_batch

__version__ = "0.1.0"

__all__ = [
    "Accumulated",
    "AutosplitError",
    "BatchSizeError",
    "CheckReport",
    "DatasetError",
    "MemoryLimitError",
    "ModelNotReadyError",
    "NothingFitsError",
    "ProbeResult",
    "Split",
    "TrainStep",
    "Trial",
    "UnsupportedModelError",
    "WorkerLostError",
    "__version__",
    "accumulate_gradients",
    "check",
    "fit_large_batch",
    "probe",
    "split_batch",
]
