"""autosplit's benchmarks: one script per question, the machinery shared.

``harness`` (command line, capped children, timing, reports), ``plots`` (the reports'
line plots) and ``workloads`` (models, data, training methods) serve ``memory_scaling``,
``overhead``, ``probe_search`` and ``gpu_check``; ``batchnorm_runs`` holds
``batchnorm_stats``'s models, data and runs. Run a script as ``python -m benchmarks.<name>``
from the repository root; see ``benchmarks/README.md``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
