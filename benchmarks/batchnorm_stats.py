"""How far are BatchNormalization's moving statistics from the full batch's under a split?

The question: after training with ``fit_large_batch(batch_size=B, micro_batch_size=B // k)``,
how far are the moving mean and variance of every BatchNormalization layer, and the
model's inference-mode loss and accuracy, from plain ``model.fit(batch_size=B)``'s, with
``batch_norm="pooled"`` (one update per large batch with the pooled statistics) and with
``batch_norm="micro"`` (Keras's update once per micro-batch)?

Method. Two small conv nets on 16x16x3 inputs, 10 classes, Adam (lr 1e-3), no Dropout,
BatchNormalization with momentum 0.9 (so that 20 updates carry the moving statistics
most of the way from their initial 0 and 1; Keras's default 0.99 would leave 82% of
the initial values after 20 steps):

- ``conv_bn``: three blocks Conv2D(16/32/64, 3, no bias) -> BatchNormalization -> ReLU
  (-> MaxPooling after the first two), GlobalAveragePooling, Dense(10);
- ``bn_first``: the same with one more BatchNormalization on the raw inputs. Its moving
  statistics depend on the data only, not on the weights: the clean signal.

Synthetic data: each class is a coarse random 4x4x3 pattern (upsampled to 16x16) plus
unit Gaussian noise, then shifted and scaled per channel (means 3, -2, 10; scales 2, 5,
0.5): learnable, and far from zero-mean/unit-variance, so the statistics matter. 20
large batches of training rows (one epoch, in order: ``shuffle=False`` everywhere) and
a held-out set drawn alike.

Every run starts from the same initial weights: the reference ``model.fit(batch_size=B,
shuffle=False)``, then ``fit_large_batch(batch_size=B, micro_batch_size=B // k,
batch_norm=mode, shuffle=False)`` for both modes and k = 1, 2, 4, 8, 16, B = 512; then the
same at k = 8 over 100 large batches, where every moving average has forgotten its
initial values (the short run's inference accuracy mostly measures that forgetting).

What is reported, against the reference after the 20 large batches:

- per BatchNormalization layer, the largest relative error over channels of
  ``moving_variance`` (|v - v_ref| / v_ref) and of ``moving_mean`` (|mu - mu_ref| /
  |mu_ref|, and |mu - mu_ref| / sqrt(v_ref), in standard deviations, since a mean near
  zero makes the relative error meaningless);
- the relative error of the trained weights, ||w - w_ref|| / ||w_ref|| over every
  trainable variable: the forward pass normalises each micro-batch by its own statistics
  in both split modes (ghost batch norm), so beyond the first layer the weights, and
  with them the activations whose statistics are pooled, differ from the reference by
  this much; the statistics' error reads against it;
- ``model.evaluate`` (inference mode: the moving statistics) on the held-out rows.

Units: relative errors (dimensionless, max over channels); loss = sparse categorical
cross-entropy; accuracy = fraction of held-out rows.

Reproduce (CPU; accuracy, not speed, so a busy machine is fine)::

    python -m benchmarks.batchnorm_stats          # ~3-5 min on 2 cores
    python -m benchmarks.batchnorm_stats --quick  # 8x8 inputs, B=128, k in {1, 4}

``--ks``, ``--steps`` and ``--models`` change the sweep, the training length and the
models.

The full run writes ``benchmarks/results/batchnorm_stats.{json,md,png}``; ``--quick``
writes files only with ``--out DIR``. The models, the data and one run against the
reference are ``benchmarks.batchnorm_runs``'s; this script keeps the settings, the checks,
the report and the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from benchmarks import harness, plots
from benchmarks.batchnorm_runs import MODELS, MODES, Settings, data, find, measure
from benchmarks.plots import Panel, Series

QUESTION = ("How far are BatchNormalization's moving statistics, and the model's "
            "inference-mode loss and accuracy, from the full-batch reference "
            "model.fit(batch_size=B) when the large batch is split into k micro-batches, "
            "with batch_norm=\"pooled\" and with batch_norm=\"micro\"?")
UNITS = ("relative errors against model.fit(batch_size=B) (max over channels; weights: "
         "||w - w_ref|| / ||w_ref||); held-out loss (cross-entropy) and accuracy (fraction)")
FLOOR = 1e-7  # where a plot's log scale meets an exact zero

FULL = Settings()
# Quick: bn_first only (its first layer is the robust fact, its others the deeper ones).
QUICK = replace(FULL, image=8, batch_size=128, steps=4, ks=(1, 4), main_k=4, eval_rows=256,
                filters=(8, 16, 16), long_steps=0, models=("bn_first",))


# ---------------------------------------------------------------- checks and report


def deeper(models: dict[str, Any]) -> str:
    """The model whose BatchNormalization layers after convs the tables read."""
    return "conv_bn" if "conv_bn" in models else next(iter(models))


def deeper_variance(run: dict[str, Any]) -> float:
    """The worst moving-variance error over the layers after a conv."""
    return max(e["variance_rel"] for layer, e in run["layers"].items() if layer != "bn_input")


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Computed from the measured errors (thresholds: float32 rounding vs a real gap)."""
    s, models = report["settings"], report["models"]
    out = []
    first = models.get("bn_first")
    if first is not None:
        split = [k for k in s["ks"] if k > 1]
        pooled = max(find(first, k, "pooled")["layers"]["bn_input"]["variance_rel"]
                     for k in s["ks"])
        pooled_mean = max(find(first, k, "pooled")["layers"]["bn_input"]["mean_in_std"]
                          for k in s["ks"])
        micro = min((find(first, k, "micro")["layers"]["bn_input"]["variance_rel"]
                     for k in split), default=float("nan"))
        ok = pooled <= 1e-4 and pooled_mean <= 1e-4 and micro >= 1e-3
        own = first["reference"]["bn_input_vs_float64"]["variance_rel"]
        out.append({"id": "first-layer", "status": harness.status(ok),
                    "pooled_variance_rel": pooled, "pooled_mean_in_std": pooled_mean,
                    "micro_variance_rel_min": micro,
                    "summary": f"BatchNormalization on the raw inputs: pooled's moving "
                               f"statistics at most {pooled:.1e} (variance) and "
                               f"{pooled_mean:.1e} std (mean) from model.fit's at every k "
                               f"(target <= 1e-4: float32 rounding; model.fit's own variance "
                               f"is {own:.1e} from the float64 statistics); micro's variance "
                               f"at least {micro:.1e} off at k > 1 (expected >= 1e-3)"})
    if 1 in s["ks"]:
        worst = max(max(find(m, 1, mode)["worst_variance_rel"], find(m, 1, mode)["weights_rel"])
                    for m in models.values() for mode in MODES)
        out.append({"id": "k1", "status": harness.status(worst <= 1e-4), "worst": worst,
                    "summary": f"k = 1 (no split): both modes within {worst:.1e} of model.fit "
                               f"in moving variance and weights (target <= 1e-4)"})
    name, k = deeper(models), s["main_k"]
    p, m = find(models[name], k, "pooled"), find(models[name], k, "micro")
    closer = deeper_variance(p) < deeper_variance(m)
    out.append({"id": "deeper", "status": harness.status(closer), "model": name,
                "pooled": deeper_variance(p), "micro": deeper_variance(m),
                "summary": f"{name} at k = {k}, BatchNormalization after convs: worst "
                           f"moving-variance error pooled {deeper_variance(p):.2e} vs micro "
                           f"{deeper_variance(m):.2e} (the weights differ from the "
                           f"reference's by {p['weights_rel']:.1e} / {m['weights_rel']:.1e})"})
    return out


def fmt(value: float) -> str:
    return f"{value:.1e}" if value < 0.01 else f"{value:.3f}"


def main_rows(model: dict[str, Any], k: int) -> list[list[str]]:
    ref = model["reference"]
    rows = [["model.fit(batch_size=B) [reference]", f"{ref['held_out_loss']:.4f}",
             f"{ref['held_out_accuracy']:.4f}", "0", "0", "0"]]
    for mode in MODES:
        r = find(model, k, mode)
        rows.append([f'fit_large_batch(m=B/{k}, batch_norm="{mode}")',
                     f"{r['held_out_loss']:.4f}", f"{r['held_out_accuracy']:.4f}",
                     fmt(r["worst_variance_rel"]), fmt(r["worst_mean_in_std"]),
                     fmt(r["weights_rel"])])
    return rows


MAIN_HEADER = ["run", "held-out loss", "held-out acc", "moving var err (worst layer)",
               "moving mean err (worst, std)", "weights rel err"]


def layer_rows(model: dict[str, Any], k: int) -> list[list[str]]:
    rows = []
    for layer in model["layers"]:
        cells = [layer]
        for mode in MODES:
            e = find(model, k, mode)["layers"][layer]
            cells += [fmt(e["variance_rel"]), fmt(e["mean_rel"]), fmt(e["mean_in_std"])]
        rows.append(cells)
    return rows


LAYER_HEADER = ["layer", "pooled: var rel", "mean rel", "mean (std)", "micro: var rel",
                "mean rel", "mean (std)"]


def sweep_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The errors against k: bn_input's (bn_first) and the deeper model's."""
    models = report["models"]
    name = deeper(models)
    header = ["k", "m"]
    if "bn_first" in models:
        header += ["bn_input var err: pooled", "micro", "pooled vs float64"]
    header += [f"{name} worst var err after a conv: pooled", "micro",
               f"{name} weights err: pooled", "micro", f"{name} held-out acc: pooled", "micro"]
    rows = []
    for k in report["settings"]["ks"]:
        cells = [str(k), str(report["settings"]["batch_size"] // k)]
        if "bn_first" in models:
            cells += [fmt(find(models["bn_first"], k, mode)["layers"]["bn_input"]
                          ["variance_rel"]) for mode in MODES]
            cells.append(fmt(find(models["bn_first"], k, "pooled")["bn_input_vs_float64"]
                             ["variance_rel"]))
        runs = [find(models[name], k, mode) for mode in MODES]
        cells += [fmt(deeper_variance(r)) for r in runs]
        cells += [fmt(r["weights_rel"]) for r in runs]
        cells += [f"{r['held_out_accuracy']:.4f}" for r in runs]
        rows.append(cells)
    return header, rows


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("BatchNormalization's moving statistics under a split", report)
    lines += ["", f"Inputs {s['image']}x{s['image']}x3, B = {s['batch_size']}, {s['steps']} "
              f"large batches (one epoch, in order), Adam lr {s['learning_rate']:g}, "
              f"BatchNormalization momentum {s['momentum']:g}, {s['eval_rows']} held-out rows. "
              f"The reference is model.fit(batch_size=B, shuffle=False) from the same initial "
              f"weights."]
    for name, model in report["models"].items():
        lines += ["", f"## {name}: {model['label']}, k = {s['main_k']}", ""]
        lines += harness.md_table(MAIN_HEADER, main_rows(model, s["main_k"]))
        lines += ["", "Per layer, relative to the reference:", ""]
        lines += harness.md_table(LAYER_HEADER, layer_rows(model, s["main_k"]))
    lines += ["", "## Moving-variance error against k", ""]
    if "bn_first" in report["models"]:
        own = report["models"]["bn_first"]["reference"]["bn_input_vs_float64"]
        lines += [f"bn_input's statistics depend on the data only: computed in float64 they "
                  f"are the yardstick for both; model.fit's own are {fmt(own['variance_rel'])} "
                  f"(variance) and {fmt(own['mean_in_std'])} std (mean) from them.", ""]
    lines += harness.md_table(*sweep_rows(report))
    for name, model in report["long"].items():
        lines += ["", f"## Longer: {name} after {s['long_steps']} large batches, "
                  f"k = {s['main_k']}", "", f"{s['long_steps'] * s['batch_size']} training "
                  f"rows drawn alike, everything else as above: the moving averages have "
                  f"forgotten their initial 0 and 1 ({s['momentum']:g}^{s['long_steps']} = "
                  f"{s['momentum'] ** s['long_steps']:.0e}).", ""]
        lines += harness.md_table(MAIN_HEADER, main_rows(model, s["main_k"]))
        lines += ["", "Per layer:", ""]
        lines += harness.md_table(LAYER_HEADER, layer_rows(model, s["main_k"]))
    return "\n".join(lines) + harness.report_tail(report, "batchnorm_stats.png")


def plot(report: dict[str, Any], path) -> None:
    s, models = report["settings"], report["models"]
    ks, name = list(s["ks"]), deeper(models)
    colors = {"pooled": "tab:blue", "micro": "tab:orange"}

    def errs(model: str, mode: str, key) -> list[float]:
        return [max(key(find(models[model], k, mode)), FLOOR) for k in ks]

    panels = []
    if "bn_first" in models:
        panels.append(Panel(
            "BN on the raw inputs (bn_first: bn_input)", "moving-variance relative error",
            [*(Series(f'batch_norm="{mode}"', ks,
                      errs("bn_first", mode, lambda r: r["layers"]["bn_input"]["variance_rel"]),
                      color=colors[mode]) for mode in MODES),
             Series('"pooled" vs float64 statistics', ks,
                    errs("bn_first", "pooled",
                         lambda r: r["bn_input_vs_float64"]["variance_rel"]),
                    color=colors["pooled"], marker="^"),
             Series("model.fit(B) vs float64 statistics", ks,
                    [max(models["bn_first"]["reference"]["bn_input_vs_float64"]
                         ["variance_rel"], FLOOR)] * len(ks), color="black", marker="")],
            xlabel="k = B / m", logy=True, xticks=ks))
    panels.append(Panel(
        f"BN after convs ({name}: worst layer)", "relative error",
        [*(Series(f'batch_norm="{mode}"', ks, errs(name, mode, deeper_variance),
                  color=colors[mode]) for mode in MODES),
         *(Series(f'weights, batch_norm="{mode}"', ks,
                  errs(name, mode, lambda r: r["weights_rel"]), color=colors[mode],
                  marker="s") for mode in MODES)],
        xlabel="k = B / m", logy=True, xticks=ks))
    ref = models[name]["reference"]["held_out_accuracy"]
    panels.append(Panel(
        f"{name}: held-out accuracy, inference mode", "accuracy",
        [Series(f'batch_norm="{mode}"', ks,
                [find(models[name], k, mode)["held_out_accuracy"] for k in ks],
                color=colors[mode]) for mode in MODES]
        + [Series(f"model.fit(B) reference {ref:.3f}", ks, [ref] * len(ks), color="black",
                  marker="")],
        xlabel="k = B / m", xticks=ks))
    plots.line_plot(path, [panels[:2], panels[2:]],
                    f"BatchNormalization moving statistics vs model.fit(batch_size="
                    f"{s['batch_size']}), {s['steps']} large batches; floor {FLOOR:g}")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("BatchNormalization's moving statistics and inference-mode quality "
                       "under a split: batch_norm='pooled' vs 'micro' vs model.fit at B.",
                       quick="8x8 inputs, B=128, 4 large batches, k in {1, 4}")
    p.add_argument("--ks", help="comma-separated k = B/m (default 1,2,4,8,16; quick 1,4)")
    p.add_argument("--steps", type=int,
                   help=f"large batches trained (default {FULL.steps}; quick {QUICK.steps})")
    p.add_argument("--models", help="comma-separated subset of conv_bn,bn_first")
    args = p.parse_args(argv)
    harness.at_least("steps", args.steps)
    s = QUICK if args.quick else FULL
    if args.steps:
        s = replace(s, steps=args.steps)
    if args.models:
        s = replace(s, models=tuple(harness.subset("models", args.models, MODELS)))
    if args.ks:
        try:
            ks = tuple(int(k) for k in args.ks.split(","))
        except ValueError:
            ks = ()
        if not ks or any(k < 1 or s.batch_size % k for k in ks):
            raise SystemExit(f"Expected `--ks` as divisors of B={s.batch_size}, e.g. 1,2,4,8. "
                             f"Received: {args.ks!r}.")
        s = replace(s, ks=tuple(sorted(set(ks))), main_k=max(ks))

    clock = harness.wall_clock()
    info = harness.machine_info(devices=True)
    harness.log(f"# {harness.machine_line(info)}")
    data_ = {"train": data(s.steps * s.batch_size, s, seed=s.seed),
             "held_out": data(s.eval_rows, s, seed=s.seed + 1)}
    models = {name: measure(name, s, data_, harness.log) for name in s.models}
    long: dict[str, Any] = {}
    if s.long_steps:
        harness.log(f"# longer: {s.long_steps} large batches at k = {s.main_k}")
        ls = replace(s, steps=s.long_steps, ks=(s.main_k,))
        data_["train"] = data(ls.steps * ls.batch_size, ls, seed=s.seed)
        long = {name: measure(name, ls, data_, harness.log) for name in s.models}
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("batchnorm_stats", argv),
        "units": UNITS, "machine": info, "settings": asdict(s), "models": models,
        "long": long}
    report["checks"] = checks(report)
    report["seconds"] = clock()
    for name, model in models.items():
        harness.log(f"\n{name}: {model['label']}, k = {s.main_k}")
        harness.log(harness.text_table(MAIN_HEADER, main_rows(model, s.main_k)))
        harness.log(harness.text_table(LAYER_HEADER, layer_rows(model, s.main_k)))
    for name, model in long.items():
        harness.log(f"\n{name} after {s.long_steps} large batches, k = {s.main_k}")
        harness.log(harness.text_table(MAIN_HEADER, main_rows(model, s.main_k)))
        harness.log(harness.text_table(LAYER_HEADER, layer_rows(model, s.main_k)))
    harness.log("\nmoving-variance error against k")
    harness.log(harness.text_table(*sweep_rows(report)))
    harness.conclude(harness.out_dir(args), "batchnorm_stats", report, markdown(report),
                     lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
