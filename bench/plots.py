"""Plots shared by the end-to-end scenarios (matplotlib, imported only when drawing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def cdf_plot(series: Mapping[str, Sequence[float]], path: Path, *, title: str,
             xlabel: str) -> None:
    """One empirical CDF per labelled series, on a log x axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for label, values in series.items():
        ordered = sorted(values)
        if ordered:
            axes.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                      where="post", label=label, linewidth=1.2)
    axes.set(xlabel=xlabel, ylabel="fraction of requests", title=title, xscale="log")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
