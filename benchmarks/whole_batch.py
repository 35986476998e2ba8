"""In-batch negatives: what does the whole-batch step cost, and what does B = 4096 buy?

A CLIP-style dual encoder (two towers of Dense layers, L2-normalised embeddings) learns
to match the two views of synthetic pairs with an in-batch softmax: each row's
``a_i`` against every ``b_j`` of the batch, the loss DPR and CLIP take in one
direction. Such a loss compares the batch's rows, so autosplit trains it with the
whole-batch step (``autosplit/step/whole_batch.py``: the outputs first, the loss over
the whole batch, then the gradients).

Three measurements:

1. **cost** (in this process, round-robin, no cap): the same towers with a per-row loss
   (each pair's squared distance), trained at the same B and m by the summed step and by
   the whole-batch step (the same loss in a ``Loss`` with its own ``__call__``, which
   takes that step): two forward passes and one backward pass per micro-batch, where
   the summed step runs one of each; the two end on the same weights;
2. **recall** (each run in its own child under a real memory cap): recall@1 on held-out
   pairs (each ``a`` among every held-out ``b``) after the same epochs, for
   ``fit_large_batch(batch_size=B)`` (the probe picks m under the cap), plain
   ``model.fit`` at the largest batch that fits under the cap (B, B/2, ... tried until
   one trains), and Keras's ``Adam(gradient_accumulation_steps=B // m)`` with
   ``model.fit(batch_size=m)`` at autosplit's m, whose negatives are each micro-batch's;
3. **memory** (each point in its own child, under a cap far above it): peak TensorFlow
   allocator memory of ``fit_large_batch`` at a fixed m and of ``model.fit`` at B, for
   B = 512 ... 4096.

Units: seconds per large batch and their ratio (paired per repeat); recall@1 in [0, 1];
MiB (2**20 bytes) of TensorFlow's CPU allocator (BFC).

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.whole_batch            # ~6 min on 2 cores
    python -m benchmarks.whole_batch --quick    # a smoke run
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import harness, plots
from benchmarks.harness import MIB, OOM
from benchmarks.plots import Panel, Series

QUESTION = ("For in-batch negatives, what does the whole-batch step cost against the summed "
            "step at the same m, and what does an exact B = 4096 buy in held-out recall@1 "
            "against model.fit at the largest batch that fits and Keras's "
            "gradient_accumulation_steps, under the same memory cap?")
UNITS = ("seconds per large batch (ratio whole-batch / summed, paired per repeat); recall@1 "
         "on held-out pairs; peak MiB of TensorFlow's CPU allocator (BFC)")
RECALL_METHODS = ("autosplit", "keras_largest", "keras_accumulation")
SHORT = {"autosplit": "autosplit @B (whole-batch step)", "keras_largest":
         "model.fit @ largest fitting", "keras_accumulation": "Keras accumulation @m"}


@dataclass(frozen=True)
class Settings:
    rows: int = 16384  # training pairs
    test_rows: int = 2048  # held-out pairs, each a among all held-out b
    features: int = 256
    latent: int = 32
    noise: float = 1.0  # of each view, against views of unit scale
    hidden: tuple[int, ...] = (1024, 1024)
    embed: int = 64
    temperature: float = 0.1
    batch_size: int = 4096
    cost_micro_batch_size: int = 512
    memory_micro_batch_size: int = 256
    memory_batch_sizes: tuple[int, ...] = (512, 1024, 2048, 4096)
    epochs: int = 10
    learning_rate: float = 2e-3
    cap_mib: int = 200
    repeats: int = 3  # timed repeats of the cost measurement
    child_timeout_s: int = 1200


FULL = Settings()
QUICK = replace(FULL, rows=1024, test_rows=256, features=32, latent=8, hidden=(64,),
                embed=16, batch_size=256, cost_micro_batch_size=64,
                memory_micro_batch_size=64, memory_batch_sizes=(128, 256), epochs=2,
                cap_mib=1024, repeats=1)


# ---------------------------------------------------------------- the workload


def pairs(s: Settings, rows: int, seed: int) -> tuple[Any, Any]:
    """Two noisy non-linear views of a shared latent; one draw of the views' maps."""
    import numpy as np

    maps = np.random.default_rng(1234)
    w_a, w_b = (maps.normal(size=(s.latent, s.features)) / np.sqrt(s.latent)
                for _ in range(2))
    r = np.random.default_rng(seed)
    z = r.normal(size=(rows, s.latent))
    a = np.tanh(z @ w_a) + s.noise * r.normal(size=(rows, s.features))
    b = np.tanh(z @ w_b) + s.noise * r.normal(size=(rows, s.features))
    return a.astype("float32"), b.astype("float32")


def _halves(y_pred: Any, embed: int) -> tuple[Any, Any]:
    return y_pred[:, :embed], y_pred[:, embed:]


def in_batch_softmax(embed: int, temperature: float) -> Any:
    """Each row's ``a`` against every ``b`` of the batch: one value per row."""
    import keras

    def loss(y_true, y_pred):
        a, b = _halves(y_pred, embed)
        logits = keras.ops.matmul(a, keras.ops.transpose(b)) / temperature
        labels = keras.ops.arange(keras.ops.shape(logits)[0])
        return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)

    loss.__name__ = "in_batch_softmax"
    return loss


def alignment(embed: int) -> Any:
    """A per-row loss on the same outputs: each pair's squared distance."""
    import keras

    def loss(y_true, y_pred):
        a, b = _halves(y_pred, embed)
        return keras.ops.sum(keras.ops.square(a - b), axis=1)

    loss.__name__ = "alignment"
    return loss


def own_call(fn: Any) -> Any:
    """``fn`` as a ``Loss`` whose own ``__call__`` returns the batch's mean: the same
    value, which autosplit computes over the whole batch (the whole-batch step)."""
    import keras

    class OwnCall(keras.losses.Loss):
        def __call__(self, y_true, y_pred, sample_weight=None):
            return keras.ops.mean(fn(y_true, y_pred))

    return OwnCall(name=f"{fn.__name__}_own_call")


def dual_encoder(s: Settings, loss: Any, *, accumulation: int = 1) -> Any:
    import keras

    keras.utils.set_random_seed(0)

    def tower(name: str, inp: Any) -> Any:
        h = inp
        for i, width in enumerate(s.hidden):
            h = keras.layers.Dense(width, activation="relu", name=f"{name}_{i}")(h)
        h = keras.layers.Dense(s.embed, name=f"{name}_out")(h)
        return keras.layers.UnitNormalization(name=f"{name}_norm")(h)

    a, b = keras.Input((s.features,), name="a"), keras.Input((s.features,), name="b")
    out = keras.layers.Concatenate()([tower("a", a), tower("b", b)])
    model = keras.Model([a, b], out)
    extra = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    model.compile(keras.optimizers.Adam(s.learning_rate, **extra), loss)
    return model


def recall_at_1(model: Any, s: Settings) -> float:
    import numpy as np

    a, b = pairs(s, s.test_rows, seed=99)
    out = model.predict([a, b], batch_size=512, verbose=0)
    ea, eb = out[:, :s.embed], out[:, s.embed:]
    return float(np.mean(np.argmax(ea @ eb.T, axis=1) == np.arange(s.test_rows)))


def _targets(rows: int) -> Any:
    import numpy as np

    return np.zeros((rows, 1), "float32")  # the loss reads the rows' order only


# ---------------------------------------------------------------- 1. cost


def cost_run(step: str, s: Settings) -> dict[str, Any]:
    """One timed training by the summed or the whole-batch step: a warm-up epoch, then
    the rest timed (``workloads.EpochMeter``)."""
    import autosplit
    from benchmarks.workloads import EpochMeter

    loss = alignment(s.embed)
    model = dual_encoder(s, loss if step == "summed" else own_call(loss))
    a, b = pairs(s, s.rows, seed=0)
    timer = EpochMeter(None, samples_per_epoch=s.rows)
    history = autosplit.fit_large_batch(
        model, [a, b], _targets(s.rows), batch_size=s.batch_size,
        micro_batch_size=s.cost_micro_batch_size, epochs=3, shuffle=False, verbose=0,
        callbacks=[timer])
    return {"seconds": sum(r["seconds"] for r in timer.records),
            "samples": sum(r["samples"] for r in timer.records),
            "large_batches": sum(r["applies"] for r in timer.records),
            "step": history.autosplit.step, "weights": model.get_weights()}


def measure_cost(s: Settings) -> dict[str, Any]:
    import numpy as np

    runs = harness.round_robin({step: (lambda step=step: cost_run(step, s))
                                for step in ("summed", "whole_batch")}, s.repeats)
    per_batch = {k: [r["seconds"] / r["large_batches"] for r in v] for k, v in runs.items()}
    moved = max(float(np.max(np.abs(w - v)) / max(float(np.max(np.abs(w))), 1e-12))
                for w, v in zip(runs["summed"][0]["weights"], runs["whole_batch"][0]["weights"],
                                strict=True))
    return {"seconds_per_large_batch": {k: statistics.median(v) for k, v in per_batch.items()},
            "ratio": harness.paired_ratio(per_batch["whole_batch"], per_batch["summed"]),
            "steps": {k: v[0]["step"] for k, v in runs.items()},
            "weights_relative_difference": moved}


# ---------------------------------------------------------------- 2. and 3. children


def child(task: dict[str, Any]) -> dict[str, Any]:
    """One training in this (capped) process: its recall@1 and allocator peak."""
    import tensorflow as tf

    import autosplit
    from autosplit.memory.peak_meter import PeakMeter

    s = Settings(**{k: tuple(v) if isinstance(v, list) else v
                    for k, v in task["settings"].items()})
    rows = task.get("rows", s.rows)
    method, batch, micro = task["method"], task["batch_size"], task.get("micro_batch_size")
    loss = in_batch_softmax(s.embed, s.temperature)
    model = dual_encoder(s, loss, accumulation=batch // micro if method == "keras_accumulation"
                         else 1)
    a, b = pairs(s, rows, seed=0)
    meter = PeakMeter("CPU:0")
    out: dict[str, Any] = {"method": method, "batch_size": batch}
    try:
        meter.reset()
        if method == "autosplit":
            history = autosplit.fit_large_batch(
                model, [a, b], _targets(rows), batch_size=batch, micro_batch_size=micro or "auto",
                epochs=task["epochs"], verbose=0)
            out.update(micro_batch_size=history.autosplit.micro_batch_size,
                       step=history.autosplit.step,
                       oom_recoveries=len(history.autosplit.oom_recoveries))
        else:
            fit_batch = micro if method == "keras_accumulation" else batch
            model.fit([a, b], _targets(rows), batch_size=fit_batch, epochs=task["epochs"],
                      verbose=0)
        out.update(status="ok", peak_mib=meter.peak_bytes() / MIB, applies=int(
            model.optimizer.iterations))
        if task.get("recall"):
            out["recall_at_1"] = recall_at_1(model, s)
    except (tf.errors.ResourceExhaustedError, autosplit.NothingFitsError) as error:
        out.update(status=OOM, error=harness.error_text(error))
    return out


def _run(task: dict[str, Any], cap_mib: int, s: Settings, say: harness.Log) -> dict[str, Any]:
    result = harness.run_child("whole_batch", {**task, "settings": asdict(s)}, cap_mib,
                               timeout=s.child_timeout_s)
    result.setdefault("method", task["method"])
    result.setdefault("batch_size", task["batch_size"])
    shown = f"recall@1 {result['recall_at_1']:.3f}  " if "recall_at_1" in result else ""
    peak = f"peak {result['peak_mib']:.1f} MiB" if "peak_mib" in result else result["status"]
    micro = result.get("micro_batch_size", task.get("micro_batch_size"))
    say(f"  {task['method']:<19} B={task['batch_size']:<5} m={micro}  {shown}{peak}")
    return result


def measure_recall(s: Settings, say: harness.Log) -> dict[str, Any]:
    base = {"epochs": s.epochs, "recall": True}
    ours = _run({**base, "method": "autosplit", "batch_size": s.batch_size}, s.cap_mib, s, say)
    tried, largest = [], None
    batch = s.batch_size
    while batch >= 16 and largest is None:  # model.fit: B, B/2, ... until one trains
        result = _run({**base, "method": "keras_largest", "batch_size": batch}, s.cap_mib, s, say)
        tried.append({"batch_size": batch, "status": result["status"]})
        largest = result if result["status"] == "ok" else None
        batch //= 2
    micro = ours.get("micro_batch_size") or s.memory_micro_batch_size
    accumulation = _run({**base, "method": "keras_accumulation", "batch_size": s.batch_size,
                         "micro_batch_size": micro}, s.cap_mib, s, say)
    return {"autosplit": ours, "keras_largest": largest, "keras_tried": tried,
            "keras_accumulation": accumulation}


def measure_memory(s: Settings, say: harness.Log) -> dict[str, list[dict[str, Any]]]:
    """Peaks against B, one child a point, under a cap far above them (4 GiB)."""
    out: dict[str, list[dict[str, Any]]] = {"autosplit": [], "keras": []}
    for batch in s.memory_batch_sizes:
        common = {"epochs": 1, "rows": 2 * max(s.memory_batch_sizes), "batch_size": batch}
        out["autosplit"].append(_run({**common, "method": "autosplit",
                                      "micro_batch_size": s.memory_micro_batch_size}, 4096, s, say))
        out["keras"].append(_run({**common, "method": "keras_largest"}, 4096, s, say))
    return out


# ---------------------------------------------------------------- the report


def checks_for(r: dict[str, Any], s: Settings) -> list[dict[str, Any]]:
    cost, recall = r["cost"], r["recall"]
    ours, largest, accumulation = (recall[k] for k in RECALL_METHODS)
    moved = cost["weights_relative_difference"]
    took = "whole batch" in cost["steps"]["whole_batch"] and "summed" in cost["steps"]["summed"]
    checks = [
        {"id": "steps", "status": harness.status(took),
         "summary": "the per-row loss took the summed step; in a Loss of its own __call__, the "
                    "whole-batch step"},
        {"id": "same-weights", "status": harness.status(moved <= 1e-4),
         "summary": f"the two steps end {moved:.1e} apart "
                    "(relative, Adam: target <= 1e-4)"},
        {"id": "cost", "status": harness.status(cost["ratio"] <= 1.4),
         "summary": f"the whole-batch step costs {cost['ratio']:.2f}x the summed step at "
                    f"B={s.batch_size}, m={s.cost_micro_batch_size} (target <= 1.4x)"}]
    trained = ours["status"] == "ok"
    fits = largest is not None and largest["batch_size"] < s.batch_size
    checks.append({"id": "trains-under-cap", "status": harness.status(trained and fits),
                   "summary": f"under {s.cap_mib} MiB autosplit trains B={s.batch_size} "
                              f"({ours['status']}); model.fit's largest is "
                              f"{largest['batch_size'] if largest else 'none'}"})
    if trained and largest is not None and accumulation.get("recall_at_1") is not None:
        gain = ours["recall_at_1"] - max(largest["recall_at_1"], accumulation["recall_at_1"])
        checks.append({"id": "recall", "status": harness.status(gain > 0),
                       "summary": f"recall@1 {ours['recall_at_1']:.3f} at B={s.batch_size} "
                                  f"against {largest['recall_at_1']:.3f} (model.fit at "
                                  f"{largest['batch_size']}) and "
                                  f"{accumulation['recall_at_1']:.3f} (Keras accumulation, "
                                  f"negatives of m={ours.get('micro_batch_size')}); target: "
                                  "above both"})
    return checks


def notes(r: dict[str, Any], s: Settings) -> list[str]:
    recall = r["recall"]
    ours, largest = recall["autosplit"], recall["keras_largest"]
    out = ["Every peak counts the inputs the process holds (two views of the rows, float32), "
           "the weights and Adam's state; autosplit's counts its probe's trial steps too."]
    if ours.get("applies") and largest is not None and largest.get("applies"):
        out.append(f"Equal epochs, not equal updates: B={s.batch_size} applies "
                   f"{ours['applies']} updates where model.fit at {largest['batch_size']} "
                   f"applies {largest['applies']}; Keras's accumulation applies as many as "
                   f"autosplit, each from micro-batches whose in-batch softmax sees their "
                   f"own {ours.get('micro_batch_size')} rows, not the batch's {s.batch_size}.")
    return out


def _cell(result: dict[str, Any] | None, key: str, fmt: str) -> str:
    if result is None:
        return "none fits"
    return format(result[key], fmt) if result.get(key) is not None else result["status"]


def markdown(report: dict[str, Any]) -> str:
    r, s = report["results"], report["settings"]
    cost, recall = r["cost"], r["recall"]
    lines = harness.report_head("In-batch negatives: the whole-batch step", report)
    lines += ["", "## Cost", "", *harness.md_table(
        ["step (per-row loss)", "s per large batch"],
        [[k, f"{v:.3f}"] for k, v in cost["seconds_per_large_batch"].items()]),
        "", f"Ratio whole-batch / summed at B={s['batch_size']}, "
            f"m={s['cost_micro_batch_size']}: {cost['ratio']:.2f} (paired per repeat); the "
            f"weights {cost['weights_relative_difference']:.1e} apart."]
    rows = []
    for key in RECALL_METHODS:
        res = recall[key]
        batch = res["batch_size"] if res else "-"
        negatives = (recall["autosplit"].get("micro_batch_size", "-")
                     if key == "keras_accumulation" else batch)
        rows.append([SHORT[key], str(batch), str(negatives), _cell(res, "recall_at_1", ".3f"),
                     _cell(res, "peak_mib", ".1f")])
    tried = ", ".join(f"{t['batch_size']}: {t['status']}" for t in recall["keras_tried"])
    lines += ["", f"## Recall under a {s['cap_mib']} MiB cap, {s['epochs']} epochs", "",
              *harness.md_table(["method", "B", "negatives per row", "recall@1", "peak MiB"],
                                rows),
              "", f"model.fit tried: {tried}. autosplit's micro-batch: "
                  f"{recall['autosplit'].get('micro_batch_size')}."]
    memory = r["memory"]
    lines += ["", f"## Peak memory against B (m={s['memory_micro_batch_size']} for autosplit)",
              "", *harness.md_table(
                  ["B", "autosplit MiB", "model.fit MiB"],
                  [[str(a["batch_size"]), _cell(a, "peak_mib", ".1f"), _cell(k, "peak_mib", ".1f")]
                   for a, k in zip(memory["autosplit"], memory["keras"], strict=True)])]
    return "\n".join(lines) + harness.report_tail(report, "whole_batch.png")


def plot(report: dict[str, Any], path: Path) -> None:
    memory = report["results"]["memory"]

    def series(key: str, label: str, color: str, marker: str) -> Series:
        ok = [p for p in memory[key] if p.get("status") == "ok"]
        return Series(label, [p["batch_size"] for p in ok], [p["peak_mib"] for p in ok],
                      color=color, marker=marker)

    plots.line_plot(path, [[Panel("Peak allocator memory, in-batch softmax", "peak MiB", [
        series("autosplit", "autosplit (whole-batch step, fixed m)", "tab:blue", "s"),
        series("keras", "model.fit @B", "tab:red", "o")])]],
        "In-batch negatives: memory against B")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(QUESTION, quick="towers of 64, B=256", repeats=FULL.repeats,
                       children=True)
    args = p.parse_args(argv)
    if args.child:
        return harness.serve_child(args.child, child)
    # oneDNN's fused matmul ends the process on a failed allocation under a CPU cap
    # (docs/memory.md): the children run without it, where TensorFlow raises instead.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    s, clock, info = harness.begin(args, FULL, QUICK)
    harness.log("cost: the summed and the whole-batch step, side by side")
    results: dict[str, Any] = {"cost": measure_cost(s)}
    harness.log(f"recall: each run in a child under {s.cap_mib} MiB")
    results["recall"] = measure_recall(s, harness.log)
    harness.log("memory: peaks against B")
    results["memory"] = measure_memory(s, harness.log)
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("whole_batch", argv), "units": UNITS,
        "machine": info, "settings": asdict(s), "results": results}
    report["checks"] = checks_for(results, s)
    report["notes"] = notes(results, s)
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "whole_batch", report, markdown(report),
                     lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
