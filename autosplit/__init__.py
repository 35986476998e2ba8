"""autosplit: train with any batch size on one accelerator, exactly."""

from autosplit.accumulate import Accumulated, accumulate_gradients, accumulate_iterator
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
from autosplit.probe import ProbeResult, probe
from autosplit.search import Trial
from autosplit.split import Split, split_batch
from autosplit.step import TrainStep

__version__ = "0.2.0"

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
    "accumulate_iterator",
    "check",
    "fit_large_batch",
    "probe",
    "split_batch",
]
