"""Is this batch size worth it? The gradient noise scale, what it costs, and what it predicts.

McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018) model the steps
and the examples that training to a given loss takes at batch B: ``S = S_min (1 +
B_noise / B)`` and ``E = E_min (1 + B / B_noise)``. ``fit_large_batch`` measures
``B_simple``, their estimate of ``B_noise``, from the micro-batches' gradients
(``autosplit/step/noise_scale.py``). Three measurements:

1. **overhead** (round-robin, side by side in one run): ``fit_large_batch`` with
   ``noise_scale=True`` against ``noise_scale=False`` on the MLP 784-1024-1024-10
   (B = 4096, m = 256, arrays) and the encoder on token ids (B = 8192, m = 512, a
   ``tf.data`` of examples) of ``benchmarks.overhead``; the weights end bitwise equal.
   The k squared norms a large batch adds are timed alone, as a share of the least
   large batch off: read from memory (the bound, which the target reads) and from cache
   (the micro-step's gradients were just written: the truth lies between). The whole
   step, on against off (every timed large batch; the least and the median), is
   reported beside: on 2 cores of a shared host it moves by a few percent from one
   repeat to the next, more than the norms cost. Target: at most 1% of the step time,
   for the estimate to be on by default;
2. **over training**: scikit-learn's ``load_digits`` (1,797 8x8 images, the ``bench``
   extra), an MLP 64-128-128-10 with SGD at B = 128 in micro-batches of 16: the noise
   scale of each epoch against the training loss. The paper finds that it grows as the
   loss falls; whether it does here is reported, as a rank correlation;
3. **the prediction**: ``B_noise`` is the noise scale pooled over that run's epochs up
   to a target training loss (a ratio of the means). At B in
   ``{B_noise/4, B_noise, 4 B_noise, 16 B_noise}``, each with its learning rate tuned on
   a grid, the large batches taken until the loss on the whole training set reaches
   the target; those counts against the model's ``S_min (1 + B_noise / B)``, with
   ``S_min`` fitted (least squares in log steps), and ``B_crit`` fitted freely beside it.

Units: samples/s and their ratio (paired per repeat); the noise scale in rows (the
examples the loss averages over); steps = optimizer applies (large batches).

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.noise_scale            # ~8 min on 2 cores
    python -m benchmarks.noise_scale --quick    # a smoke run
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks import harness
from benchmarks.noise_scale_report import checks_for, markdown, notes, plot

QUESTION = ("What does the gradient noise scale cost per step, how does it move over "
            "training on a real data set, and how well does McCandlish et al.'s model, "
            "fed with it, predict the steps to a fixed training loss at B_noise/4 ... "
            "16 B_noise?")
UNITS = ("seconds per large batch (the least and the median, on and off); noise scale in "
         "rows; steps = optimizer applies to the target training loss")


@dataclass(frozen=True)
class Settings:
    overhead_cases: tuple[str, ...] = ("mlp784", "encoder")
    overhead_scale: int = 1  # 1: the full sizes; >1 divides B, m and the rows (quick)
    overhead_epochs: int = 2  # timed, after a warm-up
    repeats: int = 5
    hidden: tuple[int, ...] = (128, 128)
    batch_size: int = 128  # the run over training
    micro_batch_size: int = 16
    learning_rate: float = 0.1
    epochs: int = 60
    target_loss: float = 0.3  # the prediction's training loss (cross-entropy, nats)
    learning_rates: tuple[float, ...] = (0.03, 0.055, 0.1, 0.17, 0.3, 0.55, 1.0, 1.7, 3.0)
    max_steps: int = 3000
    factors: tuple[float, ...] = (0.25, 1.0, 4.0, 16.0)


FULL = Settings()
QUICK = replace(FULL, overhead_cases=("mlp784",), overhead_scale=8, overhead_epochs=1,
                repeats=1, epochs=6, learning_rates=(0.3, 1.0), max_steps=200,
                target_loss=1.0)


# ---------------------------------------------------------------- overhead

_CASES = {  # (model, B, m, rows, input)
    "mlp784": ("mlp784", 4096, 256, 16384, "arrays"),
    "encoder": ("encoder", 8192, 512, 16384, "examples"),
}


def batch_timer() -> Any:
    """A callback that times every large batch after the first epoch (a warm-up)."""
    import time

    import keras

    class BatchTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._epoch = 0

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self._epoch = epoch

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if self._epoch >= 1:
                self.seconds.append(time.perf_counter() - self._t0)

    return BatchTimer()


def _overhead_run(case: str, noise_scale: bool, s: Settings, weights: Any) -> dict[str, Any]:
    import tensorflow as tf

    import autosplit
    from benchmarks import workloads

    spec, x, y, batch, micro = _overhead_case(case, s)
    model = workloads.build_model(spec, weights=weights)
    timer = batch_timer()
    data: dict[str, Any] = ({"x": x, "y": y} if _CASES[case][4] == "arrays"
                            else {"x": tf.data.Dataset.from_tensor_slices((x, y))})
    autosplit.fit_large_batch(model, **data, batch_size=batch, micro_batch_size=micro,
                              epochs=1 + s.overhead_epochs, callbacks=[timer], shuffle=False,
                              verbose=0, cache=False, noise_scale=noise_scale)
    seconds = sum(timer.seconds)
    return {"seconds": seconds, "samples": batch * len(timer.seconds),
            "batches": timer.seconds, "weights": [w.tobytes() for w in model.get_weights()]}


def norm_seconds(model: Any, *, cold: bool, calls: int = 20, per_call: int = 32) -> float:
    """One micro-batch's squared norm over tensors of every trainable variable's shape
    (``noise_scale.micro_terms``' work), alone: the least time over ``calls`` of a
    ``tf.function`` that computes ``per_call`` of them one after another, divided by
    ``per_call`` (a call's own overhead spread out). ``cold``: each norm over another
    of 8 sets of tensors (together past the CPU's caches), as a gradient read from
    memory; else the same set each time, as a gradient still in cache (the micro-step's
    gradients were just written: the truth lies between)."""
    import time

    import tensorflow as tf

    sets = [[tf.random.normal(v.shape) for v in model.trainable_variables]
            for _ in range(8 if cold else 1)]

    @tf.function
    def norms() -> Any:
        total = tf.constant(0.0)
        for i in range(per_call):
            with tf.control_dependencies([total]):  # one after another
                total = total + tf.add_n([2.0 * tf.nn.l2_loss(t) for t in sets[i % len(sets)]])
        return total

    norms().numpy()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        norms().numpy()
        best = min(best, time.perf_counter() - start)
    return best / per_call


def _overhead_case(case: str, s: Settings) -> tuple[Any, Any, Any, int, int]:
    from benchmarks import workloads

    key, batch, micro, rows, _ = _CASES[case]
    spec = (workloads.mlp_spec(784, (1024, 1024)) if key == "mlp784" else workloads.ENCODER)
    x, y = workloads.data_for(spec, rows // s.overhead_scale)
    return spec, x, y, batch // s.overhead_scale, micro // s.overhead_scale


def measure_overhead(s: Settings) -> dict[str, Any]:
    """Per case: every timed large batch of each repeat, on and off, side by side; the
    cost as the least time on over the least time off (the host's noise only adds
    time), the median beside it; and the norms' own time, k per large batch, over the
    least large batch off."""
    from benchmarks import workloads

    out: dict[str, Any] = {}
    for case in s.overhead_cases:
        spec, _, _, batch, micro = _overhead_case(case, s)
        model = workloads.build_model(spec)
        weights = model.get_weights()
        harness.log(f"overhead: {case}")
        runs = harness.round_robin(
            {flag: (lambda flag=flag, case=case, weights=weights: _overhead_run(
                case, flag == "on", s, weights)) for flag in ("on", "off")}, s.repeats)
        times = {flag: [t for run in runs[flag] for t in run["batches"]] for flag in runs}
        least = {flag: min(values) for flag, values in times.items()}
        median = {flag: statistics.median(values) for flag, values in times.items()}
        k = -(-batch // micro)
        hot, cold = (k * norm_seconds(model, cold=c) for c in (False, True))
        out[case] = {"label": spec.label, "batch_size": batch, "micro_batch_size": micro,
                     "large_batches": {flag: len(v) for flag, v in times.items()},
                     "least_seconds": least, "median_seconds": median,
                     "cost": least["on"] / least["off"] - 1,
                     "cost_median": median["on"] / median["off"] - 1,
                     "norms_share": hot / least["off"], "norms_share_cold": cold / least["off"],
                     "same_weights": runs["on"][0]["weights"] == runs["off"][0]["weights"]}
    return out


# ---------------------------------------------------------------- digits


def digits() -> tuple[Any, Any]:
    """scikit-learn's 8x8 digits, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype("float32"), data.target.astype("int32")


def mlp(s: Settings, learning_rate: float) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,))]
                             + [keras.layers.Dense(w, activation="relu") for w in s.hidden]
                             + [keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def stop_at_loss(x: Any, y: Any, target: float, most: int) -> Any:
    """A callback that reads the loss on the whole training set after every large batch
    and stops training once it reaches ``target`` (or after ``most`` steps): its
    ``steps`` and whether it ``reached`` the target."""
    import keras
    import tensorflow as tf

    class StopAtLoss(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.steps, self.reached = 0, False

        def on_train_begin(self, logs: dict | None = None) -> None:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model = self.model
            self._loss = tf.function(lambda: loss(y, model(x, training=False)))

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.steps += 1
            self.reached = float(self._loss()) <= target
            if self.reached or self.steps >= most:
                self.model.stop_training = True

    return StopAtLoss()


def measure_training(s: Settings) -> dict[str, Any]:
    """B_noise by epoch at B, with the epoch's training loss."""
    import autosplit

    x, y = digits()
    model = mlp(s, s.learning_rate)
    history = autosplit.fit_large_batch(model, x, y, batch_size=s.batch_size,
                                        micro_batch_size=s.micro_batch_size, epochs=s.epochs,
                                        verbose=0, noise_scale=True)
    report = history.autosplit.gradient_noise_scale
    return {"loss": history.history["loss"], "noise_scale": list(report.by_epoch),
            "noise": list(report.noise_by_epoch), "signal": list(report.signal_by_epoch)}


def pooled_to(training: dict[str, Any], target: float) -> tuple[float, int]:
    """The noise scale pooled over the epochs up to the first whose loss reaches
    ``target`` (a ratio of the means), and that epoch's number (1-based)."""
    upto = next((i + 1 for i, loss in enumerate(training["loss"]) if loss <= target),
                len(training["loss"]))
    noise = [n for n in training["noise"][:upto] if not math.isnan(n)]
    signal = [g for g in training["signal"][:upto] if not math.isnan(g)]
    return sum(noise) / sum(signal), upto


def steps_to(s: Settings, batch_size: int, learning_rate: float) -> dict[str, Any]:
    import autosplit

    x, y = digits()
    model = mlp(s, learning_rate)
    stop = stop_at_loss(x, y, s.target_loss, s.max_steps)
    epochs = -(-s.max_steps // -(-len(x) // batch_size))
    autosplit.fit_large_batch(model, x, y, batch_size=batch_size,
                              micro_batch_size=min(batch_size, 128), epochs=epochs,
                              callbacks=[stop], verbose=0, noise_scale=False)
    return {"steps": stop.steps if stop.reached else None}


def measure_prediction(s: Settings, noise_scale: float) -> dict[str, Any]:
    rows = len(digits()[0])
    sizes = sorted({min(rows, max(1, round(f * noise_scale))) for f in s.factors})
    points = []
    for batch in sizes:
        grid = {lr: steps_to(s, batch, lr)["steps"] for lr in s.learning_rates}
        reached = {lr: n for lr, n in grid.items() if n is not None}
        best = min(reached, key=lambda lr: reached[lr]) if reached else None
        harness.log(f"  B = {batch:>5}: steps by learning rate {grid}")
        points.append({"batch_size": batch, "by_learning_rate": {str(k): v for k, v in
                                                                 grid.items()},
                       "learning_rate": best, "steps": reached.get(best) if best else None})
    return {"noise_scale": noise_scale, "points": points, **fitted(points, noise_scale)}


def fitted(points: Sequence[dict[str, Any]], noise_scale: float) -> dict[str, Any]:
    """``S_min`` of ``S = S_min (1 + B_noise / B)`` by least squares in log steps, each
    point's relative error, and ``(S_min, B_crit)`` fitted freely on a grid of B_crit."""
    done = [(p["batch_size"], p["steps"]) for p in points if p["steps"]]
    if len(done) < 2:
        return {"s_min": None, "errors": [], "b_crit": None}

    def best_s_min(b_noise: float) -> tuple[float, float]:
        logs = [math.log(n) - math.log1p(b_noise / b) for b, n in done]
        centre = statistics.fmean(logs)
        return math.exp(centre), sum((v - centre) ** 2 for v in logs)

    s_min, _ = best_s_min(noise_scale)
    errors = [n / (s_min * (1 + noise_scale / b)) - 1 for b, n in done]
    grid = [noise_scale * 2 ** (i / 8) for i in range(-48, 49)]
    b_crit = min(grid, key=lambda b: best_s_min(b)[1])
    return {"s_min": s_min, "errors": errors, "b_crit": b_crit,
            "s_min_free": best_s_min(b_crit)[0]}


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho of two sequences (ties by order), over the pairs both finite."""
    pairs = [(u, v) for u, v in zip(a, b, strict=True) if math.isfinite(u) and math.isfinite(v)]
    if len(pairs) < 3:
        return float("nan")

    def ranks(values: Sequence[float]) -> list[int]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0] * len(values)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    ra, rb = ranks([u for u, _ in pairs]), ranks([v for _, v in pairs])
    n = len(pairs)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(QUESTION, quick="a small MLP, a few epochs", repeats=FULL.repeats)
    args = p.parse_args(argv)
    s, clock, info = harness.begin(args, FULL, QUICK)
    results: dict[str, Any] = {"overhead": measure_overhead(s)}
    harness.log("over training: digits")
    training = measure_training(s)
    training["rank_correlation"] = rank_correlation(training["loss"], training["noise_scale"])
    noise_scale, training["epochs_to_target"] = pooled_to(training, s.target_loss)
    results["training"] = training
    harness.log(f"the prediction: B_noise = {noise_scale:.1f} rows")
    results["prediction"] = measure_prediction(s, noise_scale)
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("noise_scale", argv), "units": UNITS,
        "machine": info, "settings": asdict(s), "results": results}
    report["checks"] = checks_for(results)
    report["notes"] = notes(results, s)
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "noise_scale", report, markdown(report),
                     lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
