"""Sequences of varying length: what does cutting each large batch by length buy?

The question: on a heavy-tailed length distribution, and on translation pairs of two
lengths, how many real tokens per second does each way of training at one large batch B
and micro-batch m reach, how much of what it feeds is padding, and at what peak memory?

Data and models (``benchmarks/sequence_data.py``): token ids of IMDB-shaped lognormal
lengths, divided by ``--scale 4`` on 2 CPU cores, for a Transformer encoder classifier
(``transformer``), a masked GRU classifier (``gru``) and a causal language model
(``causal_lm``); and pairs shaped like WMT14 English-German after BPE (median 24 source
tokens, the target 1.05 times as long, longest 250), for a Transformer encoder-decoder
(``translation``), each part of a pair a length of its own.

Methods, each from the same weights, side by side (round-robin repeats):
- ``rows``: ``fit_large_batch(by_length=False)``: every micro-batch padded to its large
  batch's longest row (the exact path for any model);
- ``by_length``: ``fit_large_batch(by_length=True)``: each large batch's rows sorted by
  length, each micro-batch padded to its own longest row;
- ``tokens``: ``fit_large_batch(micro_batch_tokens=m x the longest row)``: the same cut
  by length, in micro-batches of up to the tokens m rows of the longest row hold (a
  pair's two lengths summed), so short rows come many to a micro-batch (the memory
  bound of m rows, not their count);
- ``keras_accumulation``: ``model.fit`` on ``padded_batch(m)`` with
  ``Adam(gradient_accumulation_steps=B/m)`` (each micro-batch padded to its own longest
  row, in the input's order; not exact for the LM's per-token mean);
- ``bare_loop``: one ``tf.function`` whose ``tf.while_loop`` pulls the same cut by length
  (autosplit's pipeline) from a ``tf.data`` iterator, sums the gradients and applies
  once: the least a step over that cut can cost; ``bare_loop_tokens`` the same over the
  cut in tokens, each large batch's loop ending at its end's marker.

Units: real tokens per second in the timed epoch (one warm-up epoch first); padding
share = 1 - real tokens / token cells fed; peak = TensorFlow's CPU allocator (BFC) peak
in the timed epoch, MiB (run as a script; imported into a process where TensorFlow is
already loaded, the process's resident high-water mark).

Reproduce::

    python -m benchmarks.sequences            # ~11 min on 2 cores
    python -m benchmarks.sequences --quick    # a smoke run, seconds
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks import harness
from benchmarks import sequence_data as data

QUESTION = ("On a heavy-tailed length distribution, how many real tokens per second does "
            "each way of training at one B and m reach, how much of what it feeds is "
            "padding, and at what peak memory?")
UNITS = ("real tokens per second in the timed epoch; padding share = 1 - real tokens / "
         "token cells fed; peak MiB of TensorFlow's CPU allocator in the timed epoch")
MODELS = ("transformer", "gru", "causal_lm", "translation")
METHODS = ("rows", "by_length", "tokens", "keras_accumulation", "bare_loop", "bare_loop_tokens")


@dataclass(frozen=True)
class Settings:
    rows: int = 2048
    batch_size: int = 256
    micro_batch_size: int = 32
    scale: int = 4
    repeats: int = 3
    models: tuple[str, ...] = MODELS


FULL = Settings()
QUICK = Settings(rows=256, batch_size=64, micro_batch_size=16, scale=16, repeats=1)


def lengths(settings: Settings, kind: str) -> list[Any]:
    return data.lengths(kind, settings.rows, settings.scale)


def budget(settings: Settings, kind: str) -> int:
    """The ``tokens`` method's budget: m rows of the corpus's costliest row."""
    return settings.micro_batch_size * data.longest(kind, lengths(settings, kind))


def cut_of(adapter, settings: Settings, kind: str, method: str):
    """The pipeline's ``Cut`` of a method: by length (in tokens), else as rows come."""
    from autosplit.data.sequences.cut import Cut

    if method == "rows":
        return Cut("longest", lengths=adapter.lengths())
    tokens = "tokens" in method
    return Cut("tokens" if tokens else "length", lengths=adapter.lengths(),
               buckets=method.endswith("_xla"), tokens=budget(settings, kind) if tokens else None)


def padding_share(kind: str, settings: Settings, method: str) -> tuple[float, int]:
    """(the share of padding among the token cells a method feeds, real tokens) per epoch;
    a method ending in ``_xla`` under XLA's buckets (``cut_stats`` then counts every row
    of a micro-batch's shape)."""
    import tensorflow as tf

    from autosplit.data.inputs import get_input
    from autosplit.data.pipeline import MicroBatches
    from autosplit.data.sequences.stats import cut_stats

    ds = examples(kind, settings)
    if method.startswith("keras_accumulation"):  # each input of a padded batch: a length of its own
        batches = [[t.numpy() for t in tf.nest.flatten(x)]
                   for x, *_ in ds.padded_batch(settings.micro_batch_size)]
        real = sum(int((t != 0).sum()) for b in batches for t in b)
        return 1 - real / sum(t.size for b in batches for t in b), real
    rows = settings.batch_size if "tokens" in method else settings.micro_batch_size
    adapter = get_input(ds)
    pipeline = MicroBatches(adapter, settings.batch_size, rows,
                            cut=cut_of(adapter, settings, kind, method))
    stats = cut_stats(pipeline, large_batches=-(-settings.rows // settings.batch_size))
    assert stats is not None  # the examples are a dataset, read more than once
    return stats.padding_share, stats.tokens


def examples(kind: str, settings: Settings):
    return data.examples(kind, lengths(settings, kind))


def bare_loop(model, kind: str, settings: Settings, epochs: int, meter, method: str
              ) -> list[dict[str, float]]:
    """The bare loop over autosplit's cut by length, or in tokens (see the module's
    docstring)."""
    import time

    import tensorflow as tf

    from autosplit.data.inputs import get_input
    from autosplit.data.pipeline import MicroBatches

    tokens = method == "bare_loop_tokens"
    rows = settings.batch_size if tokens else settings.micro_batch_size
    adapter = get_input(examples(kind, settings))
    cut = MicroBatches(adapter, settings.batch_size, rows,
                       cut=cut_of(adapter, settings, kind, method))
    k, steps = cut.per_batch, settings.rows // settings.batch_size
    variables, optimizer = model.trainable_variables, model.optimizer
    optimizer.build(variables)
    summed = type(model.loss)(from_logits=True, reduction="sum")

    @tf.function
    def step(iterator):
        def body(i, grads, more):
            x, y, w, valid = iterator.get_next()

            def added():
                with tf.GradientTape() as tape:
                    loss = summed(y, model(x.inputs, training=True), sample_weight=(
                        w if kind in ("causal_lm", *data.PAIRS) else valid)) / (
                        settings.batch_size)
                return [g + n for g, n in zip(grads, tape.gradient(loss, variables),
                                              strict=True)]

            if not tokens:
                return i + 1, added(), more
            rows = tf.shape(valid)[0]  # 0: the marker that ends the large batch
            return i + 1, tf.cond(rows > 0, added, lambda: grads), rows > 0

        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        _, grads, _ = tf.while_loop(lambda i, _, more: (i < k) & more, body,
                                    (tf.constant(0), zeros, tf.constant(True)),
                                    parallel_iterations=1)
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    records = []
    elements = cut.dataset()
    for epoch in range(epochs):
        meter.reset()
        start = time.perf_counter()
        iterator = iter(elements)
        for _ in range(steps):
            step(iterator)
        records.append({"seconds": time.perf_counter() - start, "peak": meter.peak_bytes(),
                        "epoch": epoch})
    return records


class _Timer:
    """Seconds and allocator peak of each epoch of ``model.fit``/``fit_large_batch``."""

    def __init__(self, meter) -> None:
        import keras

        outer = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                import time
                meter.reset()
                outer.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                import time
                outer.records.append({"seconds": time.perf_counter() - outer.start,
                                      "peak": meter.peak_bytes(), "epoch": epoch})

        self.records: list[dict[str, float]] = []
        self.callback = Callback()


def run(kind: str, method: str, settings: Settings) -> dict[str, Any]:
    """One method on one model: its timed (second) epoch."""
    import autosplit
    from autosplit.memory.peak_meter import PeakMeter

    meter = PeakMeter()
    m, b = settings.micro_batch_size, settings.batch_size
    rows = examples(kind, settings)
    if method.startswith("bare_loop"):
        records = bare_loop(data.build(kind), kind, settings, 2, meter, method)
    else:
        timer = _Timer(meter)
        if method == "keras_accumulation":
            data.build(kind, b // m).fit(rows.padded_batch(m), epochs=2, verbose=0,
                                         callbacks=[timer.callback])
        elif method == "tokens":
            autosplit.fit_large_batch(data.build(kind), rows, batch_size=b,
                                      micro_batch_tokens=budget(settings, kind), epochs=2,
                                      verbose=0, by_length=True, callbacks=[timer.callback],
                                      cache=False)
        else:
            autosplit.fit_large_batch(data.build(kind), rows, batch_size=b, micro_batch_size=m,
                                      epochs=2, verbose=0, by_length=method == "by_length",
                                      micro_batch_tokens=None, callbacks=[timer.callback],
                                      cache=False)
        records = timer.records
    timed = records[-1]
    return {"seconds": timed["seconds"], "peak_mib": timed["peak"] / 2**20}


def shares_and_runs(kind: str, settings: Settings, methods: Sequence[str],
                    run_one: Any) -> tuple[dict[str, tuple[float, int]], dict[str, list]]:
    """Each method's padding share (logged), then its ``run_one(kind, method, settings)``
    runs side by side, each counted in the epoch's real tokens."""
    shares = {method: padding_share(kind, settings, method) for method in methods}
    tokens = shares[methods[0]][1]
    harness.log(f"{kind}: {tokens:,} real tokens per epoch; padding share " + ", ".join(
        f"{method} {share:.2f}" for method, (share, _) in shares.items()))
    return shares, harness.round_robin({method: (lambda method=method: {
        **run_one(kind, method, settings), "samples": tokens}) for method in methods},
        settings.repeats)


def measure(settings: Settings) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in settings.models:
        shares, runs = shares_and_runs(kind, settings, METHODS, run)
        speed = harness.speed_summary(runs, "rows")
        results[kind] = {method: {
            "tokens_per_s": speed[method]["samples_per_s_median"],
            "vs_rows": speed[method]["ratio_paired"],
            "vs_bare_loop": harness.paired_ratio(
                speed[method]["samples_per_s_all"],
                speed["bare_loop_tokens" if "tokens" in method else "bare_loop"][
                    "samples_per_s_all"]),
            "padding_share": shares[method][0],
            "peak_mib": statistics.median(r["peak_mib"] for r in runs[method])}
            for method in METHODS}
    return results


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for kind, by in results.items():
        length, tokens = by["by_length"], by["tokens"]
        out += [
            {"id": f"{kind}-tokens-speed", "status": harness.status(tokens["vs_rows"] >= 2.0),
             "summary": f"{kind}: in tokens {tokens['vs_rows']:.2f}x the tokens/s of the row "
                        f"cut, {tokens['tokens_per_s'] / length['tokens_per_s']:.2f}x by "
                        "length's (target >= 2 the row cut's)"},
            {"id": f"{kind}-tokens-bare", "status": harness.status(
                tokens["vs_bare_loop"] >= 0.9),
             "summary": f"{kind}: in tokens {tokens['vs_bare_loop']:.2f} of the bare loop's "
                        "tokens/s on the same cut (target >= 0.9)"},
            {"id": f"{kind}-tokens-peak", "status": harness.status(
                tokens["peak_mib"] <= by["rows"]["peak_mib"]),
             "summary": f"{kind}: peak {tokens['peak_mib']:.0f} MiB in tokens, "
                        f"{by['rows']['peak_mib']:.0f} MiB for m rows padded to their large "
                        "batch's longest (target: at most that)"},
            {"id": f"{kind}-tokens-padding", "status": harness.status(
                tokens["padding_share"] <= by["rows"]["padding_share"] / 2),
             "summary": f"{kind}: padding share {tokens['padding_share']:.2f} in tokens, "
                        f"{by['rows']['padding_share']:.2f} by rows (target <= half)"}]
        out += [
            {"id": f"{kind}-speed", "status": harness.status(length["vs_rows"] >= 2.0),
             "summary": f"{kind}: by length {length['vs_rows']:.2f}x the tokens/s of the row "
                        "cut (target >= 2)"},
            {"id": f"{kind}-bare", "status": harness.status(length["vs_bare_loop"] >= 0.9),
             "summary": f"{kind}: by length {length['vs_bare_loop']:.2f} of the bare loop's "
                        "tokens/s on the same cut (target >= 0.9)"},
            {"id": f"{kind}-padding", "status": harness.status(
                length["padding_share"] <= by["rows"]["padding_share"] / 2),
             "summary": f"{kind}: padding share {length['padding_share']:.2f} by length, "
                        f"{by['rows']['padding_share']:.2f} by rows (target <= half)"}]
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = harness.report_head("Sequences: the cut by length", report)
    header = ["model", "method", "tokens/s", "vs rows", "vs bare loop", "padding share",
              "peak MiB"]
    rows = [[kind, method, f"{r['tokens_per_s']:,.0f}", f"{r['vs_rows']:.2f}",
             f"{r['vs_bare_loop']:.2f}", f"{r['padding_share']:.2f}", f"{r['peak_mib']:.0f}"]
            for kind, by in report["results"].items() for method, r in by.items()]
    lines += ["", *harness.md_table(header, rows)]
    return "\n".join(lines) + harness.report_tail(report)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(QUESTION, quick="256 rows, B=64, m=16, lengths / 16",
                       repeats=FULL.repeats)
    p.add_argument("--scale", type=int, help="divide IMDB's lengths by this (default 4)")
    p.add_argument("--models", help=f"a comma-separated subset of {', '.join(MODELS)}")
    args = p.parse_args(argv)
    harness.at_least("repeats", args.repeats)
    if "tensorflow" not in sys.modules:  # the CPU allocator's peak per epoch (else: RSS)
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    s = QUICK if args.quick else FULL
    s = replace(s, repeats=args.repeats or s.repeats, scale=args.scale or s.scale,
                models=tuple(harness.subset("models", args.models, MODELS)) if args.models
                else s.models)
    clock, info = harness.wall_clock(), harness.machine_info()
    harness.log(f"# {harness.machine_line(info)}")
    results = measure(s)
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("sequences", argv), "units": UNITS,
        "machine": info, "settings": asdict(s), "results": results, "checks": checks(results),
        "notes": ["tokens: a budget of m rows of the costliest row, " + ", ".join(
            f"{kind} {budget(s, kind):,}" for kind in s.models) + " tokens per micro-batch; "
            f"the other methods run m = {s.micro_batch_size} rows."]}
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "sequences", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
