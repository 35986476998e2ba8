"""Line plots for the benchmarks' reports: a grid of panels, one legend below, a PNG.

Part of the machinery every benchmark shares, beside ``benchmarks.harness`` (the command
line, capped children, timing, tables and the report's files) and ``benchmarks.workloads``:
a script describes each panel as a :class:`Panel` of :class:`Series` and hands a call of
:func:`line_plot` to ``harness.conclude`` as its ``plot``.

Matplotlib (the ``bench`` extra) is imported only when a plot is drawn, with the Agg
backend: no display needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Series:
    """One line of a plot; ``failed`` x values are drawn as crosses at ``failed_y``."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str | None = None
    marker: str = "o"
    failed: Sequence[float] = ()
    failed_y: float | None = None


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: Sequence[Series]
    xlabel: str = "batch size B (examples)"
    logy: bool = False
    hline: tuple[float, str] | None = None  # (y, label), e.g. the memory cap
    xticks: Sequence[int] = field(default_factory=tuple)


def line_plot(path: Path, rows: Sequence[Sequence[Panel]], title: str) -> None:
    """A grid of panels (x on a log2 scale), one legend below, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    cols = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(7.5 * cols, 4.6 * len(rows)),
                             squeeze=False)
    handles: dict[str, Any] = {}
    for r, panels in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(panels):
                ax.axis("off")
                continue
            panel = panels[c]
            for s in panel.series:
                (line,) = ax.plot(s.xs, s.ys, linestyle="-", marker=s.marker, color=s.color,
                                  markersize=5, linewidth=1.5, label=s.label)
                handles.setdefault(s.label, line)
                if s.failed and s.failed_y is not None:
                    (cross,) = ax.plot(s.failed, [s.failed_y] * len(s.failed), linestyle="none",
                                       marker="x", markersize=10, markeredgewidth=2.5,
                                       color=line.get_color(), label=f"{s.label}: OOM")
                    handles.setdefault(f"{s.label}: OOM", cross)
            if panel.hline is not None:
                h = ax.axhline(panel.hline[0], color="black", linestyle="-.", linewidth=1.2,
                               label=panel.hline[1])
                handles.setdefault("cap", h)
            ax.set_xscale("log", base=2)
            if panel.xticks:
                ax.set_xticks(list(panel.xticks))
                ax.set_xticklabels([str(x) for x in panel.xticks])
            if panel.logy:
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            else:
                ax.set_ylim(bottom=0)
                ax.yaxis.set_major_formatter(ticker.FuncFormatter(
                    lambda v, _: f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"))
            ax.grid(True, which="both", alpha=0.3)
            ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
    labels = ["memory cap (see each panel)" if k == "cap" else k for k in handles]
    fig.legend(list(handles.values()), labels, loc="lower center", ncol=3, fontsize=8,
               frameon=False)
    fig.suptitle(title)
    legend_rows = -(-len(handles) // 3)
    fig.tight_layout(rect=(0, (0.2 + 0.2 * legend_rows) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
