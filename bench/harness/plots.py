"""Plots shared by the benchmarks (matplotlib, imported only when drawing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import cycle
from pathlib import Path


def cdf_plot(series: Mapping[str, Sequence[float]], path: Path, *, title: str, xlabel: str) -> None:
    """One empirical CDF per labelled series, on a log x axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for label, values in series.items():
        ordered = sorted(values)
        if ordered:
            axes.step(
                ordered,
                [(i + 1) / len(ordered) for i in range(len(ordered))],
                where="post",
                label=label,
                linewidth=1.2,
            )
    axes.set(xlabel=xlabel, ylabel="fraction of requests", title=title, xscale="log")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def grouped_bars(
    panels: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path, *, title: str
) -> None:
    """One panel per entry of `panels` (panel title -> group -> series -> value): bars of
    each series side by side in each group, on a log y axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes_list = plt.subplots(len(panels), 1, figsize=(10, 4 * len(panels)), squeeze=False)
    for axes, (panel, groups) in zip(axes_list[:, 0], panels.items()):
        series = list(dict.fromkeys(name for values in groups.values() for name in values))
        width = 0.8 / max(len(series), 1)
        for i, name in enumerate(series):
            axes.bar(
                [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))],
                [values.get(name, 0.0) for values in groups.values()],
                width,
                label=name,
            )
        axes.set_xticks(range(len(groups)), list(groups), fontsize=8)
        axes.set(title=panel, yscale="log")
        axes.grid(True, axis="y", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def time_series(
    panels: Mapping[str, tuple[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]],
    path: Path,
    *,
    title: str,
    xlabel: str,
    marks: Mapping[str, float] | None = None,
) -> None:
    """One panel per entry of `panels` (panel title -> (y label, series -> (x, y))), one
    above the other on a shared x axis; `marks` (label -> x) are dashed vertical lines on
    every panel, such as the end of a warm-up. As a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes_list = plt.subplots(
        len(panels), 1, figsize=(10, 3.5 * len(panels)), sharex=True, squeeze=False
    )
    for axes, (panel, (ylabel, series)) in zip(axes_list[:, 0], panels.items()):
        for label, (xs, ys) in series.items():
            axes.plot(xs, ys, label=label, linewidth=1.2)
        for (label, x), style in zip((marks or {}).items(), cycle(("--", ":", "-."))):
            axes.axvline(x, color="dimgrey", linestyle=style, linewidth=1, label=label)
        axes.set(title=panel, ylabel=ylabel)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    axes_list[-1, 0].set_xlabel(xlabel)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
