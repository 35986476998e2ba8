"""Probe trials in a child process, where a kernel that crashes on an allocation failure
costs one trial and not the run.

Under TensorFlow's CPU cap (``TF_CPU_ALLOCATOR_USE_BFC``) an allocation can fail, and
TensorFlow does not always stop when one does; it then ends the process with SIGSEGV
instead of raising ``ResourceExhaustedError`` (TensorFlow 2.21):

- oneDNN's convolution and batch normalization kernels (``TF_ENABLE_ONEDNN_OPTS``) carry
  on with an output they never got (matrix products raise);
- with or without oneDNN, a ``tf.function``'s first run folds its constant subgraphs
  (``ConstantFold``), and the copy of a folded constant (``tensor::DeepCopy``) writes
  into an allocation that failed. A step traced for a new micro-batch size near the cap,
  as after an out-of-memory error, can end the process there.

The probe's
trials are where such failures are expected, so there they run in a child process
that loads a copy of the model (``model.save``) and a sample of the data, and runs the
same trials (:func:`autosplit.search.trials.child_trials`) at the sizes the parent's search
asks for. A child that dies during a trial makes that trial an out-of-memory one
(``Trial.crashed``); the next trial starts a new child. The parent's model is never
touched. OpenNMT-tf runs its batch-size search in child processes for the same reason.

The child holds what the parent holds: after it has built the model it allocates the
difference (a ballast tensor), so its trials meet the cap where the parent's would.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["IsolatedTrials", "IsolationError", "checked_micro_batch", "crash_prone_layers",
           "kernels_may_crash"]

_MARK = "autosplit-isolated "  # prefixes the child's answers on stdout


class IsolationError(RuntimeError):
    """The child process could not load the model or its data (before any trial)."""


def kernels_may_crash() -> bool:
    """Whether an allocation failure may end this process instead of raising.

    True on a machine without a GPU when TensorFlow's CPU allocator is capped
    (BFC with a limit, the only way to make a CPU run out of memory before the
    operating system does), whether or not oneDNN is on: TensorFlow's own set-up of a
    function's first run (constant folding) crashes on a failed allocation too. oneDNN
    is off by default on x86 CPUs without AVX512_VNNI, AVX512_BF16 or AMX (many AMD EPYC
    hosts), and there a capped run crashed in ``tensor::DeepCopy`` under ``ConstantFold``.
    """
    import tensorflow as tf

    from autosplit.memory.host import is_tf_bfc_capped

    return not tf.config.list_logical_devices("GPU") and is_tf_bfc_capped() is not None


class IsolatedTrials:
    """Trials of ``model`` run one by one in a child process (see the module docstring).

    Args:
        model: the compiled model; saved once (``model.save``), never changed.
        sample: ``(x, y, sample_weight)`` of the trial data, ``batch_size`` rows or fewer.
        batch_size: the large batch B.
        budget: the search's budget in bytes: a trial fits when its peak is within it.
        held_bytes: what this process's allocator holds; the child holds as much.
        jit_compile: the step's compilation, as resolved in this process.
        step_held: ``held_bytes`` includes a compiled step of this model (its sums and
            stash), which the child makes too (:func:`autosplit.search.trials.child_trials`).
        tokens: ``(buckets, length, outputs)``: trials in tokens, the sample's padded
            sequences cut by length with lengths rounded up to XLA's buckets where
            ``buckets`` (``Cut.buckets``), a length factor per output as ``outputs`` says
            (``Cut.outputs``), a trial at m of ``m * length`` tokens
            (``autosplit.search.trials.TrialRunner``).

    Raises:
        IsolationError: the model cannot be saved, or the child cannot load it.
    """

    def __init__(self, model: Any, sample: tuple, batch_size: int, budget: int,
                 held_bytes: int, jit_compile: bool, step_held: bool = False,
                 tokens: tuple[bool, int, tuple[int | None, ...]] | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="autosplit-trials-"))
        try:
            model.save(self.folder / "model.keras")
        except Exception as error:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise IsolationError(f"model.save failed: {type(error).__name__}: {error}") from error
        with open(self.folder / "data.pkl", "wb") as f:
            pickle.dump(_to_numpy(sample), f)
        (self.folder / "config.json").write_text(json.dumps(
            {"batch_size": batch_size, "budget": budget, "held_bytes": held_bytes,
             "jit_compile": jit_compile, "step_held": step_held, "tokens": tokens}))
        self.child: subprocess.Popen[str] | None = None
        self.crashes = 0
        self._start()  # the first child proves the model loads there

    def trial(self, m: int) -> Any:
        """One trial at ``m`` rows in the child; a child that dies makes it an OOM."""
        from autosplit.search.policy import Trial

        if self.child is None:
            self._start()
        assert self.child is not None and self.child.stdin is not None
        started = time.perf_counter()
        self.child.stdin.write(f"{m}\n")
        self.child.stdin.flush()
        answer = self._answer()
        if answer is None:
            self.crashes += 1
            self._reap()
            return Trial(m, False, True, None, time.perf_counter() - started, crashed=True)
        return Trial(**answer["trial"])

    def close(self) -> None:
        """End the child and remove the files."""
        if self.child is not None:
            assert self.child.stdin is not None
            self.child.stdin.close()
            try:
                self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.child.kill()
            self._reap()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> IsolatedTrials:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        env = dict(os.environ)
        # The child imports what this process can: the user's modules that define custom
        # layers, losses or models saved with the model.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._stderr = open(self.folder / "stderr.txt", "w")  # noqa: SIM115 - kept open
        self.child = subprocess.Popen(
            [sys.executable, "-m", "autosplit.search.isolation", str(self.folder)], env=env,
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        ready = self._answer()
        if ready is None or "error" in ready:
            why = ready["error"] if ready else f"it ended ({self._reap()}): {self._tail()}"
            self._reap()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise IsolationError(f"the child process could not load the model: {why}")

    def _answer(self) -> dict[str, Any] | None:
        """The child's next answer, or None when it ended first."""
        assert self.child is not None and self.child.stdout is not None
        for line in self.child.stdout:
            if line.startswith(_MARK):
                answer: dict[str, Any] = json.loads(line[len(_MARK):])
                return answer
        return None

    def _reap(self) -> str:
        """Wait for an ended child; how it ended."""
        code = None
        if self.child is not None:
            code = self.child.wait()
            for stream in (self.child.stdin, self.child.stdout):
                if stream is not None and not stream.closed:
                    stream.close()
            self._stderr.close()
            self.child = None
        return f"exit code {code}"

    def _tail(self) -> str:
        from autosplit.capped import is_noise

        lines = (self.folder / "stderr.txt").read_text().splitlines()
        return "\n".join([line for line in lines if not is_noise(line)][-10:])


def crash_prone_layers(model: Any) -> list[str]:
    """The layers of ``model`` whose oneDNN kernels end the process when an allocation
    fails: convolutions and batch normalization (TensorFlow 2.21; matrix products,
    pooling, softmax and layer normalization raise, ``docs/memory.md``)."""
    from autosplit.keras_hooks import internals as _keras

    return [layer.name for layer in _keras.flatten_layers(model)
            if any("Conv" in c.__name__ or "BatchNormalization" in c.__name__
                   for c in type(layer).__mro__)]


def checked_micro_batch(model: Any, sample: tuple, batch_size: int, micro_batch_size: int,
                        jit_compile: bool, on_oom: str) -> int:
    """The largest micro-batch up to ``micro_batch_size`` whose trial step ran in a child
    process: ``fit_large_batch`` with a given size starts there where
    :func:`kernels_may_crash` and the model has :func:`crash_prone_layers`, so that an
    out-of-memory error in its first steps, which training could not survive, costs a
    trial instead. Shrinks as recovery would
    (:func:`autosplit.search.policy.shrink_micro_batch`), with a warning each time.
    Once per model, batch size and size asked (kept with the model's compiled state).

    Returns ``micro_batch_size`` unchanged when the model cannot be run in a child
    (with a warning) and after a trial at it ran.

    Raises:
        tf.errors.ResourceExhaustedError: with ``on_oom="raise"``, after the first failure.
        NothingFitsError: not even one row ran.
    """
    from autosplit.memory.peak_meter import PeakMeter
    from autosplit.step.model_state import model_state

    state = model_state(model)
    key = (batch_size, micro_batch_size, jit_compile)
    if key not in state.checked:
        try:
            trials = IsolatedTrials(model, sample, batch_size, budget=2**62,
                                    held_bytes=PeakMeter("CPU:0").current_bytes(),
                                    jit_compile=jit_compile, step_held=bool(state.steps))
        except IsolationError as error:
            from autosplit.warn import warn_user

            warn_user(f"micro_batch_size={micro_batch_size} is not tried in a child process "
                      f"first ({error}): under TensorFlow's CPU cap a kernel "
                      "that runs out of memory ends this process instead of raising.")
            return micro_batch_size
        with trials:
            state.checked[key] = _largest_that_runs(trials, batch_size, micro_batch_size,
                                                    on_oom)
    return int(state.checked[key])


def _largest_that_runs(trials: IsolatedTrials, batch_size: int, micro_batch_size: int,
                       on_oom: str) -> int:
    import tensorflow as tf

    from autosplit.data.split import split_batch
    from autosplit.errors import NothingFitsError
    from autosplit.search.policy import shrink_micro_batch
    from autosplit.warn import warn_user

    rows = split_batch(batch_size, micro_batch_size).micro_batch_size
    while trials.trial(rows).oom:
        how = "ended its process" if trials.crashes else "ran out of memory"
        message = f"A trial step of micro-batches of {rows} rows {how} under TensorFlow's CPU cap"
        if on_oom == "raise":
            raise tf.errors.ResourceExhaustedError(None, None, message + ".")
        smaller = shrink_micro_batch(rows)
        if smaller < 1:
            raise NothingFitsError(message + ": not even a micro-batch of 1 example fits. "
                                   "Raise the cap or use a smaller model.")
        rows = split_batch(batch_size, smaller).micro_batch_size
        warn_user(f"{message}; training starts with micro-batches of {rows} rows.")
        trials.crashes = 0
    return rows


def _to_numpy(tree: Any) -> Any:
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda t: None if t is None else (t.numpy() if hasattr(t, "numpy") else t), tree)


def _say(out: IO[str], answer: dict[str, Any]) -> None:
    out.write(_MARK + json.dumps(answer) + "\n")
    out.flush()


def _child(folder: Path) -> None:
    """The child's side: load, hold what the parent holds, then one trial per line read."""
    import dataclasses

    import keras

    from autosplit.search.trials import child_trials

    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the model prints stays off the answers' channel
    config = json.loads((folder / "config.json").read_text())
    try:
        model = keras.saving.load_model(folder / "model.keras", compile=True)
        with open(folder / "data.pkl", "rb") as f:
            sample = pickle.load(f)
        runner = child_trials(model, sample, config["batch_size"], config["budget"],
                              config["jit_compile"], held_bytes=config["held_bytes"],
                              step_held=config["step_held"], tokens=config["tokens"])
    except Exception as error:
        # One line; of Keras's "could not be deserialized" the cause it encountered.
        text = " ".join(str(error).split()).partition("Exception encountered: ")
        _say(out, {"error": f"{type(error).__name__}: {(text[2] or text[0])[:300]}"})
        return
    _say(out, {"ready": True})
    for line in sys.stdin:
        trial = runner.trial(int(line))
        _say(out, {"trial": dataclasses.asdict(trial)})


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
