"""``autosplit`` command line: ``demo``, ``probe`` and ``check``. Thin: parse, call the
library, print.

Exit codes: 0 success (for ``check``: the split is exact), 1 ``check`` found the split
not exact, 2 usage error (bad arguments, unknown model, bad memory string), 3 nothing
fits (not even one example).

With ``--memory-limit`` the work runs in a child process under a real cap
(``autosplit.capped.run_capped``): on the CPU through TensorFlow's BFC allocator capped
at the limit (``TF_CPU_BFC_MEM_LIMIT_IN_MB``, so the limit means the memory TensorFlow
may allocate, as on a GPU), on a GPU through a logical-device memory limit. A crash
under the cap cannot take the CLI down. Run as the ``autosplit`` program, the work
always happens in such a child, whose TensorFlow start-up lines (oneDNN notices, CUDA
stubs, ``cuInit`` on a machine without a GPU) are hidden unless ``--verbose``; real
errors always show. Probe progress (one line per trial) goes to stdout, or to stderr
with ``--json`` so that stdout stays one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autosplit.training.fit import FitReport

EXIT_OK, EXIT_NOT_EXACT, EXIT_USAGE, EXIT_NOTHING_FITS = 0, 1, 2, 3
_CHILD_ENV = "AUTOSPLIT_CHILD"


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="also show TensorFlow's own start-up log lines")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and synthetic-data arguments shared by ``probe`` and ``check``."""
    parser.add_argument("--model", required=True,
                        help="mlp, cnn, transformer, mobilenet_v2, resnet50, module:function "
                        "(returns a compiled model), or a file saved by model.save "
                        "(model.keras)")
    parser.add_argument("--input-shape", default=None,
                        help="one example's shape, e.g. 224,224,3 (read from a saved model "
                        "when not given)")
    parser.add_argument("--batch-size", type=int, required=True,
                        help="the effective batch B to train with")
    parser.add_argument("--classes", type=int, default=10,
                        help="classes of the synthetic labels when the model's output "
                        "does not say (default 10)")


def _parser() -> argparse.ArgumentParser:
    from autosplit import __version__

    parser = argparse.ArgumentParser(
        prog="autosplit", description="Exact large-batch training for Keras on one device.")
    parser.add_argument("--version", action="version", version=f"autosplit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small model with fit_large_batch(batch_size=4096)")
    demo.add_argument("--batch-size", type=int, default=4096,
                      help="the effective batch B (default 4096)")
    demo.add_argument("--examples", type=int, default=16384,
                      help="synthetic training examples (default 16384)")
    demo.add_argument("--epochs", type=int, default=3, help="epochs to train (default 3)")
    demo.add_argument("--memory-limit", default="80MiB",
                      help="real cap for the demo's child process ('none' for no cap)")
    _add_common(demo)

    probe = sub.add_parser("probe", help="find the largest micro-batch that fits")
    _add_model_arguments(probe)
    probe.add_argument("--memory-limit", default=None, help="e.g. 2GiB, 512MB, or bytes")
    probe.add_argument("--headroom", type=float, default=0.1,
                       help="fraction of the budget left free (default 0.1)")
    probe.add_argument("--objective", choices=("memory", "speed"), default="memory",
                       help="memory: the largest micro-batch that fits (default); speed: "
                       "a smaller one when it runs more than 5%% faster")
    probe.add_argument("--json", action="store_true", help="print the result as JSON")
    probe.add_argument("--no-cache", action="store_true",
                       help="search afresh; neither read nor store the cached result")
    probe.add_argument("--report", action="store_true",
                       help="also print the memory model's prediction for a range of sizes")
    probe.add_argument("--lengths", default=None, metavar="MEDIAN,LONGEST",
                       help="probe on token ids of lognormal lengths (e.g. 178,2000) for a "
                       "model that takes any length (--model lm): micro-batches are then "
                       "sized in tokens")
    _add_common(probe)

    check = sub.add_parser("check", help="is the split step exact for this model? (exit 1 if not)")
    _add_model_arguments(check)
    check.add_argument("--micro-batch-size", type=int, required=True,
                       help="rows per micro-batch, as you mean to train")
    check.add_argument("--tolerance", type=float, default=1e-4,
                       help="largest relative gradient difference called exact (1e-4)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_common(check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autosplit`` console script.

    ``main()`` (the program) does the work in a child process with a quiet stderr;
    ``main([...])`` (tests, scripts) does it in this process unless ``--memory-limit``
    asks for a cap.
    """
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    from autosplit.units import parse_memory

    try:
        memory_limit = getattr(args, "memory_limit", None)
        limit = None if str(memory_limit).lower() in ("none", "0") else parse_memory(
            memory_limit, name="--memory-limit")
        if args.command in ("probe", "check"):
            from autosplit.builtin_models import ANY_LENGTH, MODELS, is_saved_model, parse_shape

            saved = is_saved_model(args.model)
            if args.input_shape is not None or not (saved or args.model in ANY_LENGTH):
                parse_shape(args.input_shape)
            if getattr(args, "lengths", None) is not None:
                _parse_lengths(args.lengths)
            if args.model not in MODELS and ":" not in args.model and not saved:
                raise ValueError(
                    f"Expected `--model` to be one of {sorted(MODELS)}, 'module:function' or "
                    f"a saved model file (.keras). Received: {args.model!r}.")
            if args.batch_size < 1:
                raise ValueError("Expected `--batch-size` to be a positive integer. "
                                 f"Received: {args.batch_size}.")
        if args.command == "check" and args.micro_batch_size < 1:
            raise ValueError("Expected `--micro-batch-size` to be a positive integer. "
                             f"Received: {args.micro_batch_size}.")
    except ValueError as exc:
        print(f"autosplit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if os.environ.get(_CHILD_ENV) != "1" and (limit is not None or program):
        return _run_child(argv, limit, verbose=args.verbose)
    if args.command == "demo":
        return _demo(args)
    if args.command == "check":
        return _check(args)
    return _probe(args, limit)


def _run_child(argv: list[str], limit: int | None, *, verbose: bool) -> int:
    """Re-run this command in a child process (under a real cap when ``limit``)."""
    from autosplit.capped import run_capped

    env = {_CHILD_ENV: "1"}
    if verbose:
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    run = run_capped(["-m", "autosplit", *argv], limit, env=env, quiet=not verbose)
    if run.returncode < 0:
        print(f"autosplit: the child process died with signal {-run.returncode}",
              file=sys.stderr)
        return 1
    return run.returncode


def _configure_gpu_cap() -> None:
    """In the child: cap the first GPU through a logical device, before TF starts."""
    from autosplit.capped import GPU_LIMIT_ENV

    limit = os.environ.get(GPU_LIMIT_ENV)
    if not limit:
        return
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(limit) // 2**20)])


def _probe(args: argparse.Namespace, limit: int | None) -> int:
    _configure_gpu_cap()
    from autosplit.errors import AutosplitError, NothingFitsError
    from autosplit.search.probe import format_trial, probe
    from autosplit.units import format_bytes

    try:
        model, shape = _load(args)
    except ValueError as exc:
        print(f"autosplit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    data = (_synthetic_stream(model, shape, args.batch_size, args.classes)
            if args.lengths is None else
            _synthetic_sequences(model, _parse_lengths(args.lengths), args.batch_size))
    progress = sys.stderr if args.json else sys.stdout

    started = False

    def on_trial(trial, budget):
        nonlocal started
        if not started:
            print(f"probing {args.model} for batch {args.batch_size} "
                  f"(budget {format_bytes(budget)}):", file=progress, flush=True)
            started = True
        print(format_trial(trial, budget), file=progress, flush=True)

    try:
        result = probe(model, data, batch_size=args.batch_size, memory_limit=limit,
                       objective=args.objective,
                       headroom=args.headroom, cache=not args.no_cache, on_trial=on_trial)
    except NothingFitsError as exc:
        if args.json:
            print(json.dumps({"error": "nothing_fits", "message": str(exc),
                              "bytes_per_example": exc.bytes_per_example,
                              "budget_bytes": exc.budget_bytes}))
        else:
            print(f"autosplit: {exc}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    except (AutosplitError, ValueError) as exc:
        print(f"autosplit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(result.to_json())
    else:
        print(format_result(result, report=args.report))
    return EXIT_OK


_POOL = 256  # distinct synthetic examples the probe's stream repeats


def _load(args: argparse.Namespace) -> tuple[Any, tuple[int, ...]]:
    """The model ``--model`` names and one example's shape (none for token ids of any
    length)."""
    from autosplit.builtin_models import ANY_LENGTH, load_model, parse_shape, saved_input_shape

    shape = None if args.input_shape is None else parse_shape(args.input_shape)
    model = load_model(args.model, shape)
    if args.model in ANY_LENGTH:
        return model, ()
    if shape is None:  # a saved model: load_model refuses any other without a shape
        return model, saved_input_shape(model)
    return model, shape


def _parse_lengths(text: str) -> tuple[int, int]:
    """``"178,2000"`` -> (median, longest), with a clear error otherwise."""
    try:
        median, longest = (int(part) for part in text.split(","))
    except ValueError:
        median = longest = 0
    if not 1 <= median <= longest:
        raise ValueError("Expected `--lengths` as MEDIAN,LONGEST, two positive integers with "
                         f"the median at most the longest, e.g. 178,2000. Received: {text!r}.")
    return median, longest


def _synthetic_sequences(model: Any, lengths: tuple[int, int], batch_size: int) -> Any:
    """A ``tf.data`` stream of ``batch_size`` rows of token ids of lognormal lengths
    (sigma 0.8, a text corpus's shape; at least 2, at most the longest), with targets
    and a ``sample_weight`` of ones per token for a model whose output has a length
    axis (a language model), else a class per row. Padded by length where the probe
    cuts by length; fixed seed."""
    import numpy as np
    import tensorflow as tf

    from autosplit.builtin_models import synthetic_targets

    rng = np.random.default_rng(0)
    median, longest = lengths
    vocabulary = int(model.inputs[0].shape[-1] or 0) or 1000
    output = model.outputs[0]
    vocabulary = int(output.shape[-1]) if len(output.shape) == 3 else vocabulary
    sizes = np.clip(rng.lognormal(np.log(median), 0.8, batch_size), 2, longest).astype(int)
    rows = [rng.integers(1, vocabulary, n).astype("int32") for n in sizes]
    if len(output.shape) == 3:  # one target per token, every token weighed
        return tf.data.Dataset.from_generator(
            lambda: ((r, np.roll(r, -1), np.ones(len(r), "float32")) for r in rows),
            output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                              tf.TensorSpec([None], tf.float32)))
    targets = np.asarray(synthetic_targets(model, batch_size, 10, rng))
    return tf.data.Dataset.from_generator(
        lambda: zip(rows, targets, strict=True),
        output_signature=(tf.TensorSpec([None], tf.int32),
                          tf.TensorSpec(targets.shape[1:], targets.dtype)))


def _synthetic_stream(model: Any, shape: tuple[int, ...], batch_size: int,
                      classes: int) -> Any:
    """A ``tf.data`` stream of ``batch_size`` examples, cycling through a pool of 256.

    Nothing of B rows exists: the probe's memory (and so its answer) is the same at any
    B, as in training, where the pipeline holds a few micro-batches only.
    """
    import tensorflow as tf

    x, y = _synthetic_batch(model, shape, min(batch_size, _POOL), classes)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().take(batch_size)


def _synthetic_batch(model: Any, shape: tuple[int, ...], batch_size: int,
                     classes: int) -> tuple:
    """Normal inputs of ``shape`` and targets that suit the model's loss, fixed seed."""
    import numpy as np

    from autosplit.builtin_models import synthetic_targets

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, *shape)).astype("float32")
    return x, synthetic_targets(model, batch_size, classes, rng)


def _check(args: argparse.Namespace) -> int:
    from autosplit.equivalence import check
    from autosplit.errors import AutosplitError

    try:
        model, shape = _load(args)
        x, y = _synthetic_batch(model, shape, args.batch_size, args.classes)
        report = check(model, x, y, micro_batch_size=args.micro_batch_size,
                       tolerance=args.tolerance)
    except (AutosplitError, ValueError) as exc:
        print(f"autosplit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(report.to_json() if args.json else report.format())
    return EXIT_OK if report.exact else EXIT_NOT_EXACT


def format_result(result, *, report: bool = False) -> str:
    """A table of the trials and the choice, for people."""
    from autosplit.units import format_bytes

    def size(n):
        return "-" if n is None else format_bytes(int(n))

    device = result.device
    lines = [
        f"device      {device['kind']} {device['name']} ({device['tf_device']}), "
        f"available {size(device['available_bytes'])}, limit by {device['limit_source']}",
        f"budget      {size(result.budget_bytes)} ({result.headroom:.0%} headroom kept), "
        f"peaks read from {result.peak_source}"
        + ("  [cached result]" if result.from_cache else ""),
        "",
        f"{'micro-batch':>11}  {'result':<6}  {'peak':>11}  {'predicted':>11}  {'seconds':>7}"
        + ("" if result.tokens is None else
           f"  (rows of {result.reference_length} tokens)"),
    ]
    for t in result.trials:
        outcome = "OOM" if t.oom else ("fits" if t.fits else "over")
        lines.append(f"{t.micro_batch_size:>11}  {outcome:<6}  {size(t.peak_bytes):>11}  "
                     f"{size(result.predict_peak(t.micro_batch_size)):>11}  {t.seconds:>7.2f}")
    chosen = (f"micro_batch_size={result.micro_batch_size}, "
              f"accumulation_steps={result.accumulation_steps}")
    if result.tokens is not None:
        chosen = (f"micro_batch_tokens={result.tokens} ({result.micro_batch_size} rows of "
                  f"the costliest row sampled, {result.reference_length} tokens)")
    lines += [
        "",
        f"chosen      {chosen} for batch_size={result.batch_size}",
        f"why         {result.reason()}",
        f"peak        predicted {size(result.predicted_peak_bytes)}, "
        f"measured {size(result.measured_peak_bytes)}; {result.ooms} OOM trial(s), "
        f"{len(result.trials)} trials, {result.seconds:.1f} s",
    ]
    if report and result.per_example_bytes is not None:
        measured = {t.micro_batch_size: t.peak_bytes for t in result.trials}
        lines += ["", "memory model: peak = "
                  f"{size(result.fixed_bytes)} + {size(result.per_example_bytes)} x m",
                  f"{'micro-batch':>11}  {'predicted':>11}  {'measured':>11}  {'error':>7}"]
        sizes, m = set(measured), 1
        while m <= result.batch_size:
            sizes.add(m)
            m *= 2
        for m in sorted(sizes):
            predicted, real = result.predict_peak(m), measured.get(m)
            error = f"{(predicted - real) / real:+.1%}" if real else ""
            lines.append(f"{m:>11}  {size(predicted):>11}  {size(real):>11}  {error:>7}")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    _configure_gpu_cap()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import autosplit

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    features, classes = 128, 10
    teacher = rng.normal(size=(features, classes)).astype("float32")
    x = rng.normal(size=(args.examples, features)).astype("float32")
    y = np.argmax(x @ teacher + 0.5 * rng.normal(size=(args.examples, classes)), axis=1)
    model = keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(classes),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    loss_before = model.evaluate(x, y, batch_size=1024, verbose=0, return_dict=True)["loss"]
    from autosplit.capped import GPU_LIMIT_ENV

    cap = os.environ.get(GPU_LIMIT_ENV)
    print(f"autosplit demo: {args.examples} synthetic examples, MLP {features}-1024-1024-"
          f"{classes}, target batch {args.batch_size}"
          + (f", real memory cap {int(cap) // 2**20} MiB" if cap else ", no memory cap"))
    history = autosplit.fit_large_batch(model, x, y, batch_size=args.batch_size,
                                        epochs=args.epochs, cache=False)
    loss_after = model.evaluate(x, y, batch_size=1024, verbose=0, return_dict=True)["loss"]
    print(_demo_summary(history.autosplit, int(model.optimizer.iterations), loss_before,
                        loss_after))
    return EXIT_OK


def _demo_summary(report: FitReport, iterations: int, loss_before: float, loss_after: float) -> str:
    """The demo's last words, from its ``history.autosplit`` (a ``FitReport``)."""
    found = (f"found by {len(report.probe.trials)} trials of the real step"
             if report.probe is not None else report.micro_batch_reason)
    recovered = "".join(f"\n  out of memory       step {r.step}: {r.failed} -> {r.retry} rows"
                        for r in report.oom_recoveries)
    return ("\nsummary\n"
            f"  target batch        {report.batch_size}\n"
            f"  micro-batch         {report.micro_batch_size} ({found})\n"
            f"  accumulation steps  {report.accumulation_steps}\n"
            f"  optimizer steps     {iterations}\n"
            f"  loss before/after   {loss_before:.4f} -> {loss_after:.4f}" + recovered)


if __name__ == "__main__":
    raise SystemExit(main())
