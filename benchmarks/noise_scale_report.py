"""The report of ``benchmarks.noise_scale``: its checks, notes, Markdown and plot,
computed from the measured numbers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import harness

if TYPE_CHECKING:
    from benchmarks.noise_scale import Settings

def checks_for(r: dict[str, Any]) -> list[dict[str, Any]]:
    over = r["overhead"]
    worst = max(c["norms_share_cold"] for c in over.values())
    training, prediction = r["training"], r["prediction"]
    rho = training["rank_correlation"]
    errors = prediction["errors"]
    largest = max((abs(e) for e in errors), default=float("nan"))
    return [
        {"id": "a", "status": harness.status(worst <= 0.01 and all(
            c["same_weights"] for c in over.values())),
         "summary": "the k squared norms cost at most 1% of the least large batch, read "
                    "from memory (from cache beside; the whole step on over off, within the "
                    "host's noise, after), the weights bitwise the same: " + ", ".join(
                        f"{k} {100 * c['norms_share_cold']:.2f}% "
                        f"({100 * c['norms_share']:.2f}%; {100 * c['cost']:+.1f}%)"
                        for k, c in over.items())},
        {"id": "b", "status": harness.status(rho < 0 if math.isfinite(rho) else None),
         "summary": f"the noise scale grows as the training loss falls (Spearman rho of "
                    f"loss and noise scale by epoch {rho:+.2f}; negative: it grows)"},
        {"id": "c", "status": harness.status(largest <= 0.25 if errors else None),
         "summary": f"S_min (1 + B_noise / B) with B_noise = "
                    f"{prediction['noise_scale']:.0f} measured and S_min fitted meets every "
                    f"B's tuned steps within 25% (largest {100 * largest:.0f}%)"},
    ]


def notes(r: dict[str, Any], s: Settings) -> list[str]:
    prediction = r["prediction"]
    out = [f"B_noise for the prediction: the noise scale pooled over the first "
           f"{r['training']['epochs_to_target']} epochs of the run at B = {s.batch_size}, up "
           f"to the first whose training loss reached {s.target_loss}."]
    if prediction.get("b_crit"):
        out.append(f"fitted freely, B_crit = {prediction['b_crit']:.0f} rows, "
                   f"{prediction['b_crit'] / prediction['noise_scale']:.2f}x the measured "
                   f"B_noise (the paper finds B_simple within a small factor of B_crit).")
    return out


def markdown(report: dict[str, Any]) -> str:
    r, s = report["results"], report["settings"]
    lines = [*harness.report_head("The gradient noise scale", report), "", "## Overhead", ""]
    lines += harness.md_table(
        ["case", "B", "m", "large batches on / off", "least s on", "least s off",
         "step on / off - 1 (least)", "(median)", "k norms, from memory", "from cache"],
        [[c["label"], str(c["batch_size"]), str(c["micro_batch_size"]),
          f"{c['large_batches']['on']} / {c['large_batches']['off']}",
          f"{c['least_seconds']['on']:.4f}", f"{c['least_seconds']['off']:.4f}",
          f"{100 * c['cost']:+.2f}%", f"{100 * c['cost_median']:+.2f}%",
          f"{100 * c['norms_share_cold']:.2f}%", f"{100 * c['norms_share']:.2f}%"]
         for c in r["overhead"].values()])
    training = r["training"]
    lines += ["", f"## Over training (digits, B = {s['batch_size']}, "
                  f"m = {s['micro_batch_size']}, SGD {s['learning_rate']})", ""]
    lines += harness.md_table(["epoch", "training loss", "noise scale (rows)"], [
        [str(i + 1), f"{loss:.4f}", f"{scale:.0f}"]
        for i, (loss, scale) in enumerate(zip(training["loss"], training["noise_scale"],
                                               strict=True))
        if i % max(1, len(training["loss"]) // 12) == 0 or i == len(training["loss"]) - 1])
    prediction = r["prediction"]
    lines += ["", f"## The prediction (steps to a training loss of {s['target_loss']})", ""]
    s_min = prediction["s_min"]
    rows = []
    for p in prediction["points"]:
        model = s_min * (1 + prediction["noise_scale"] / p["batch_size"]) if s_min else None
        rows.append([str(p["batch_size"]), str(p["learning_rate"]), str(p["steps"]),
                     f"{model:.0f}" if model else "-"])
    lines += harness.md_table(["B", "tuned learning rate", "steps", "S_min (1 + B_noise / B)"],
                              rows)
    return "\n".join(lines) + harness.report_tail(report, "noise_scale.png")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = report["results"]
    training, prediction = r["training"], r["prediction"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    epochs = range(1, len(training["loss"]) + 1)
    scales = [v if math.isfinite(v) and v > 0 else float("nan")
              for v in training["noise_scale"]]
    left.plot(epochs, scales, marker="o", markersize=3, label="noise scale (rows)")
    left.set_yscale("log")
    left.set_xlabel("epoch")
    left.set_ylabel("gradient noise scale B_simple (rows)")
    twin = left.twinx()
    twin.plot(epochs, training["loss"], color="gray", linestyle="--", label="training loss")
    twin.set_yscale("log")
    twin.set_ylabel("training loss (nats)")
    left.set_title("B_noise by epoch (digits MLP)")
    done = [p for p in prediction["points"] if p["steps"]]
    right.plot([p["batch_size"] for p in done], [p["steps"] for p in done], "o",
               label="measured (tuned learning rate)")
    if prediction["s_min"]:
        grid = [2 ** (i / 8) for i in range(0, 8 * 12)]
        grid = [b for b in grid if 0.5 * done[0]["batch_size"] <= b
                <= 2 * done[-1]["batch_size"]]
        right.plot(grid, [prediction["s_min"] * (1 + prediction["noise_scale"] / b)
                          for b in grid], label="S_min (1 + B_noise / B), B_noise measured")
        right.plot(grid, [prediction["s_min_free"] * (1 + prediction["b_crit"] / b)
                          for b in grid], linestyle=":", label="fitted freely (B_crit)")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch size B (rows)")
    right.set_ylabel("steps to the target loss")
    right.set_title("steps against McCandlish et al.'s model")
    right.legend()
    fig.legend(*left.get_legend_handles_labels(), loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


