"""Sequences of varying length: what does cutting each large batch by length buy?

The question: on a heavy-tailed length distribution, how many real tokens per second
does each way of training at one large batch B and micro-batch m reach, how much of
what it feeds is padding, and at what peak memory?

Data: token ids of lognormal length shaped like the IMDB reviews of
``keras.datasets.imdb`` (median 178 tokens, mean 239, longest about 2,500: a lognormal
of median 178 and sigma 0.77 has that mean), clipped to [8, 2,500]. On 2 CPU cores the
default run divides every length by ``--scale 4`` (median 44, longest 625), which keeps
the distribution's shape and so its padding shares; ``--scale 1`` is IMDB's own.

Models (vocabulary 2,000, width 32, Adam):
- ``transformer``: Embedding(mask_zero) -> MultiHeadAttention (2 heads, its padding mask)
  -> feed-forward -> masked mean -> Dense(1), a binary classifier;
- ``gru``: Embedding(mask_zero) -> GRU(32) -> Dense(1);
- ``causal_lm``: Embedding -> causal MultiHeadAttention -> Dense(vocabulary), next-token
  cross-entropy weighted by a ``sample_weight`` mask of the real tokens.

Methods, each from the same weights, side by side (round-robin repeats):
- ``rows``: ``fit_large_batch(by_length=False)``: every micro-batch padded to its large
  batch's longest row (the exact path for any model);
- ``by_length``: ``fit_large_batch(by_length=True)``: each large batch's rows sorted by
  length, each micro-batch padded to its own longest row;
- ``tokens``: ``fit_large_batch(micro_batch_tokens=m x the longest row)``: the same cut
  by length, in micro-batches of up to the tokens m rows of the longest row hold, so
  short rows come many to a micro-batch (the memory bound of m rows, not their count);
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

QUESTION = ("On a heavy-tailed length distribution, how many real tokens per second does "
            "each way of training at one B and m reach, how much of what it feeds is "
            "padding, and at what peak memory?")
UNITS = ("real tokens per second in the timed epoch; padding share = 1 - real tokens / "
         "token cells fed; peak MiB of TensorFlow's CPU allocator in the timed epoch")
MODELS = ("transformer", "gru", "causal_lm")
METHODS = ("rows", "by_length", "tokens", "keras_accumulation", "bare_loop", "bare_loop_tokens")
VOCAB, WIDTH = 2000, 32
IMDB_MEDIAN, IMDB_SIGMA, IMDB_LONGEST = 178, 0.77, 2500


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


def lengths(settings: Settings, seed: int = 0) -> list[int]:
    import numpy as np

    r = np.random.default_rng(seed)
    drawn = r.lognormal(np.log(IMDB_MEDIAN), IMDB_SIGMA, settings.rows)
    clipped = np.clip(drawn, 8, IMDB_LONGEST) / settings.scale
    return [max(int(n), 2) for n in clipped]


def examples(kind: str, sizes: Sequence[int], seed: int = 0):
    """The rows as a ``tf.data`` dataset of examples, each as long as it is."""
    import numpy as np
    import tensorflow as tf

    r = np.random.default_rng(seed)
    seqs = [r.integers(1, VOCAB, n).astype("int32") for n in sizes]
    if kind == "causal_lm":
        return tf.data.Dataset.from_generator(
            lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32")) for s in seqs),
            output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                              tf.TensorSpec([None], tf.float32))).cache()
    return tf.data.Dataset.from_generator(
        lambda: ((s, np.float32(s[0] % 2)) for s in seqs),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32))).cache()


def build(kind: str, accumulation: int | None = None):
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    if kind == "gru":
        embedded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(tokens)
        hidden = keras.layers.GRU(WIDTH)(embedded)
        outputs = keras.layers.Dense(1)(hidden)
    else:
        lm = kind == "causal_lm"
        embedded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=not lm)(tokens)
        attended = keras.layers.MultiHeadAttention(2, WIDTH // 2)(
            embedded, embedded, use_causal_mask=lm)
        # a layer (not `+`), so that the padding mask reaches the pooling
        hidden = keras.layers.LayerNormalization()(keras.layers.Add()([embedded, attended]))
        hidden = keras.layers.Dense(WIDTH * 2, activation="relu")(hidden)
        hidden = keras.layers.Dense(WIDTH)(hidden)
        outputs = (keras.layers.Dense(VOCAB)(hidden) if lm else
                   keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden)))
    model = keras.Model(tokens, outputs)
    loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True) if kind == "causal_lm"
            else keras.losses.BinaryCrossentropy(from_logits=True))
    model.compile(keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accumulation), loss)
    return model


def budget(settings: Settings) -> int:
    """The ``tokens`` method's budget: m rows of the corpus's longest row."""
    return settings.micro_batch_size * max(lengths(settings))


def length_cut(settings: Settings, method: str):
    """The pipeline's ``LengthCut`` of a method that cuts by length."""
    from autosplit.data.lengths import LengthCut

    return LengthCut(tokens=budget(settings) if "tokens" in method else None)


def padding_share(kind: str, settings: Settings, method: str) -> tuple[float, int]:
    """(the share of padding among the token cells a method feeds, real tokens) per epoch."""
    from autosplit.data.cut_stats import cut_stats
    from autosplit.data.inputs import get_input
    from autosplit.data.pipeline import MicroBatches

    ds = examples(kind, lengths(settings))
    if method == "keras_accumulation":
        batches = [x.numpy() for x, *_ in ds.padded_batch(settings.micro_batch_size)]
        real = sum(int((b != 0).sum()) for b in batches)
        return 1 - real / sum(b.size for b in batches), real
    rows = settings.batch_size if "tokens" in method else settings.micro_batch_size
    cut = MicroBatches(get_input(ds), settings.batch_size, rows,
                       by_length=None if method == "rows" else length_cut(settings, method))
    stats = cut_stats(cut, large_batches=-(-settings.rows // settings.batch_size))
    assert stats is not None  # the examples are a dataset, read more than once
    return stats.padding_share, stats.tokens


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
    cut = MicroBatches(get_input(examples(kind, lengths(settings))), settings.batch_size,
                       rows, by_length=length_cut(settings, method))
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
                        w if kind == "causal_lm" else valid)) / settings.batch_size
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
    data = cut.dataset()
    for epoch in range(epochs):
        meter.reset()
        start = time.perf_counter()
        iterator = iter(data)
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
    data = examples(kind, lengths(settings))
    if method.startswith("bare_loop"):
        records = bare_loop(build(kind), kind, settings, 2, meter, method)
    else:
        timer = _Timer(meter)
        if method == "keras_accumulation":
            build(kind, b // m).fit(data.padded_batch(m), epochs=2, verbose=0,
                                    callbacks=[timer.callback])
        elif method == "tokens":
            autosplit.fit_large_batch(build(kind), data, batch_size=b,
                                      micro_batch_tokens=budget(settings), epochs=2, verbose=0,
                                      by_length=True, callbacks=[timer.callback], cache=False)
        else:
            autosplit.fit_large_batch(build(kind), data, batch_size=b, micro_batch_size=m,
                                      epochs=2, verbose=0, by_length=method == "by_length",
                                      micro_batch_tokens=None, callbacks=[timer.callback],
                                      cache=False)
        records = timer.records
    timed = records[-1]
    return {"seconds": timed["seconds"], "peak_mib": timed["peak"] / 2**20}


def measure(settings: Settings) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in settings.models:
        shares = {method: padding_share(kind, settings, method) for method in METHODS}
        tokens = shares["rows"][1]
        harness.log(f"{kind}: {tokens:,} real tokens per epoch; padding share " + ", ".join(
            f"{method} {share:.2f}" for method, (share, _) in shares.items()))
        runs = harness.round_robin({method: (lambda kind=kind, method=method, tokens=tokens: {
            **run(kind, method, settings), "samples": tokens}) for method in METHODS},
            settings.repeats)
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
        "notes": [f"tokens: a budget of m rows of the longest row, {budget(s):,} tokens "
                  f"per micro-batch; the other methods run m = {s.micro_batch_size} rows."]}
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "sequences", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
