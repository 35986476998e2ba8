"""The peak memory of one step on one device, read from TensorFlow's allocator.

:class:`PeakMeter` reads ``tf.config.experimental.get_memory_info`` on a GPU, or on
the CPU when TensorFlow's CPU allocator is BFC, and otherwise the process's resident
set and its high-water mark. The probe (``autosplit.search.probe``) measures every trial
step with it. Capped child processes, where the CPU allocator is BFC, are in
``autosplit.capped``.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from autosplit.memory.device_info import split_device
from autosplit.memory.host import bfc_enabled, status_bytes

__all__ = ["PeakMeter"]


class PeakMeter:
    """The peak memory of one device between :meth:`reset` and :meth:`peak_bytes`.

    Attributes:
        tf_device: The device measured, ``"GPU:0"`` or ``"CPU:0"``.
        source: Where the numbers come from. ``"tf-allocator"``:
            ``tf.config.experimental.get_memory_info`` on a GPU, or on the CPU when
            the process started with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (set before
            TensorFlow loads; see :func:`autosplit.capped.capped_cpu_env`); the
            figures are allocator chunks, so they include fragmentation.
            ``"rss-hwm"``: the process's resident set (``VmRSS``) and its high-water
            mark (``VmHWM``), reset by writing ``5`` to ``/proc/self/clear_refs``;
            they cover the whole process and are only repeatable when
            ``MALLOC_MMAP_THRESHOLD_`` is fixed, because glibc otherwise raises its
            mmap threshold as blocks are freed and keeps later ones in the heap.
        baseline_bytes: :meth:`current_bytes` at the last :meth:`reset`; a step used
            ``peak_bytes() - baseline_bytes`` on top of what was already held.

    Example:
        >>> meter = PeakMeter("CPU:0")  # doctest: +SKIP
        >>> meter.reset()  # doctest: +SKIP
        >>> run_step()  # doctest: +SKIP
        >>> step_bytes = meter.peak_bytes() - meter.baseline_bytes  # doctest: +SKIP
    """

    def __init__(self, tf_device: str = "CPU:0", *,
                 proc_root: str | os.PathLike[str] = "/proc") -> None:
        kind, index = split_device(tf_device)
        self.tf_device = f"{kind}:{index}"
        # Without BFC, get_memory_info("CPU:0") returns zeros instead of raising.
        tf_allocator = kind == "GPU" or bfc_enabled(os.environ)
        self.source = "tf-allocator" if tf_allocator else "rss-hwm"
        self.baseline_bytes = 0
        self._proc_root = Path(proc_root)

    def reset(self) -> None:
        """Starts a new measurement: the peak drops to what is in use now."""
        if self.source == "tf-allocator":
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats(self.tf_device)
        else:
            # "5" resets only the high-water mark (Linux >= 4.0).
            (self._proc_root / "self" / "clear_refs").write_text("5")
        self.baseline_bytes = self.current_bytes()

    def peak_bytes(self) -> int:
        """The most bytes in use since the last :meth:`reset`.

        Never below :attr:`baseline_bytes` or what is in use now. The kernel keeps a
        thread's RSS changes in a per-CPU cache, so ``VmHWM`` can trail ``VmRSS`` by
        a few pages; taken raw, a step could seem to peak below what it started with.
        """
        if self.source == "tf-allocator":
            peak = int(self._tf_info()["peak"])
        else:
            peak = status_bytes(self._proc_root, "VmHWM") or 0
        return max(peak, self.baseline_bytes, self.current_bytes())

    def current_bytes(self) -> int:
        """The bytes in use now."""
        if self.source == "tf-allocator":
            return int(self._tf_info()["current"])
        current = status_bytes(self._proc_root, "VmRSS")
        return current if current is not None else int(psutil.Process().memory_info().rss)

    def _tf_info(self) -> dict[str, int]:
        import tensorflow as tf

        return tf.config.experimental.get_memory_info(self.tf_device)

    def __repr__(self) -> str:
        return f"PeakMeter(tf_device={self.tf_device!r}, source={self.source!r})"
