"""Child processes under a real memory cap, for the CLI, the tests and the benchmarks.

:func:`capped_cpu_env` and :func:`run_capped` start a child process in which
TensorFlow's CPU allocator has a hard cap: it raises a genuine
``ResourceExhaustedError`` there and the process lives on, as on a GPU. The child
hands its result back with :func:`write_result`. ``autosplit --memory-limit``, the
tests and the benchmarks all start their capped children through :func:`run_capped`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from autosplit.units import MIB, memory_error, parse_memory

__all__ = ["CappedRun", "capped_cpu_env", "is_noise", "run_capped", "write_result"]

RESULT_ENV = "AUTOSPLIT_RESULT"
GPU_LIMIT_ENV = "AUTOSPLIT_GPU_MEMORY_LIMIT_BYTES"


def capped_cpu_env(limit_bytes: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process in which TensorFlow has a hard CPU cap.

    TensorFlow's BFC allocator then raises ``tf.errors.ResourceExhaustedError`` when
    a step would go past ``limit_bytes`` (after about 10 s of retries), and the
    process goes on. ``RLIMIT_AS`` is never used as a cap: TensorFlow reserves large
    virtual ranges and dies with ``std::bad_alloc`` under it instead of raising.
    The variables are read when TensorFlow creates its CPU allocator, so they only
    work for a process that has not run TensorFlow yet: pass the result to
    ``subprocess.run(..., env=...)``.

    Args:
        limit_bytes: The cap in bytes, rounded up to whole MiB.
        base: The environment to copy; ``os.environ`` when ``None``. Not modified.

    Returns:
        A copy of ``base`` with ``TF_CPU_ALLOCATOR_USE_BFC=true``,
        ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, ``MALLOC_MMAP_THRESHOLD_=65536`` (so the
        ``rss-hwm`` fallback of :class:`~autosplit.memory.peak_meter.PeakMeter` is
        repeatable) and ``TF_CPP_MIN_LOG_LEVEL=2`` unless ``base`` already sets a level.

    Raises:
        MemoryLimitError: ``limit_bytes`` is not a positive size.

    Example:
        >>> env = capped_cpu_env(parse_memory("2GiB"))  # doctest: +SKIP
        >>> subprocess.run([sys.executable, "train.py"], env=env, check=True)  # doctest: +SKIP
    """
    limit = parse_memory(limit_bytes, name="limit_bytes")
    if limit is None:
        raise memory_error("limit_bytes", limit_bytes)
    env = dict(os.environ if base is None else base)
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(-(-limit // MIB))
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


# TensorFlow's C++ start-up chatter on stderr: absl's pre-init banner, INFO and WARNING
# lines, and the CUDA stubs' errors on a machine without a GPU. Anything else
# (a real error, a Python traceback) passes through.
_NOISE = [re.compile(p) for p in (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
    r"^[IW]\d{4} \d\d:\d\d:\d\d",
    r"^E\d{4} .*(cuda_platform|cuda_diagnostics|cuda_dnn|cuda_fft|cuda_blas|cuInit|"
    r"Unable to register)",
    r"^To enable the following instructions: .*rebuild TensorFlow",
)]


def is_noise(line: str) -> bool:
    """Whether a stderr line is TensorFlow start-up chatter, not an error.

    >>> is_noise("I0000 00:00:1796014245.425577    2085 port.cc:153] oneDNN custom ...")
    True
    >>> is_noise("Traceback (most recent call last):")
    False
    """
    return any(p.search(line) for p in _NOISE)


class CappedRun(NamedTuple):
    """How a capped child process ended."""

    returncode: int  # negative: killed by that signal
    result: Any  # the JSON the child wrote with write_result(), or None
    stdout: str | None  # captured output (capture=True), else None
    stderr: str | None  # captured stderr (capture=True), noise dropped when quiet
    seconds: float


def run_capped(argv: Sequence[str], limit_bytes: int | str | None, *,
               timeout: float | None = None,
               env: Mapping[str, str] | None = None, quiet: bool = True,
               capture: bool = False) -> CappedRun:
    """Run ``python <argv>`` in a child process under a real TensorFlow memory cap.

    On the CPU the cap is TensorFlow's BFC allocator (:func:`capped_cpu_env`); a GPU
    child reads ``AUTOSPLIT_GPU_MEMORY_LIMIT_BYTES`` and caps its first GPU with a
    logical device (``autosplit.cli`` does). A crash under the cap ends the child,
    never the caller. The child reports back with :func:`write_result`.

    Args:
        argv: the interpreter's arguments: ``["-m", "autosplit", "probe", ...]`` or
            ``["script.py", "arg"]``.
        limit_bytes: the cap (bytes or a string like ``"72MiB"``); None runs the child
            uncapped (for the quiet relay alone).
        timeout: seconds before the child is killed (``subprocess.TimeoutExpired``).
        env: extra environment variables for the child.
        quiet: drop TensorFlow's start-up lines from the child's stderr
            (:func:`is_noise`); errors still pass.
        capture: collect stdout and stderr instead of passing them through.

    Returns:
        A :class:`CappedRun`.

    Example:
        >>> run = run_capped(["train.py"], "2GiB", timeout=600)  # doctest: +SKIP
        >>> run.returncode, run.result  # doctest: +SKIP
    """
    limit = parse_memory(limit_bytes, name="limit_bytes")
    if limit is None:
        child_env = dict(os.environ)
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    else:
        child_env = capped_cpu_env(limit)
        child_env.setdefault(GPU_LIMIT_ENV, str(limit))
    child_env.update(env or {})
    handle, path = tempfile.mkstemp(prefix="autosplit-", suffix=".json")
    os.close(handle)
    child_env[RESULT_ENV] = path
    started = time.perf_counter()
    try:
        # The context closes both pipes (and waits) however the run ends.
        with subprocess.Popen([sys.executable, *argv], env=child_env, text=True,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.PIPE) as process:
            kept: list[str] = []
            out: list[str] = []

            def relay() -> None:
                assert process.stderr is not None  # stderr=PIPE
                for line in process.stderr:
                    if quiet and is_noise(line):
                        continue
                    if capture:
                        kept.append(line)
                    else:
                        sys.stderr.write(line)
                        sys.stderr.flush()

            def collect() -> None:
                assert process.stdout is not None  # stdout=PIPE with capture
                out.append(process.stdout.read())

            # Both pipes are read on threads, so `timeout` holds while the child writes
            # nothing (a read of stdout here would wait for the child's end).
            readers = [threading.Thread(target=fn, daemon=True)
                       for fn in ((relay, collect) if capture else (relay,))]
            for reader in readers:
                reader.start()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise
            finally:
                for reader in readers:
                    reader.join(timeout=5)
        stdout = "".join(out) if capture else None
        text = Path(path).read_text()
        result = json.loads(text) if text.strip() else None
    finally:
        Path(path).unlink(missing_ok=True)
    return CappedRun(process.returncode, result, stdout, "".join(kept) if capture else None,
                     time.perf_counter() - started)


def write_result(data: Any) -> None:
    """In a child of :func:`run_capped`: hand ``data`` (JSON-serialisable) back."""
    path = os.environ.get(RESULT_ENV)
    if not path:
        raise RuntimeError(f"Expected to run under autosplit.capped.run_capped (${RESULT_ENV} "
                           "is not set). Received: a process started some other way.")
    Path(path).write_text(json.dumps(data))
