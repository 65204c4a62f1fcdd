"""A benchmark's curves as data (`Chart`), and their picture (`--plot PATH`, with matplotlib: the `plot` extra).

A benchmark that has a curve worth drawing (a ratio against the request's size, TTFT with and without a hit against
the prompt's length) puts a `Chart` of its own results in its `Outcome`; `kvferry bench NAME --plot PATH` writes it
as an image (PNG, SVG or PDF: the extension decides).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvferry.bench.harness import BenchError


@dataclass(frozen=True)
class Series:
    """One line of a chart: `y[i]` at `x[i]`."""

    label: str
    x: list[float]
    y: list[float]


@dataclass(frozen=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: list[Series]
    x_log: bool = False  # sizes that grow by factors read best on a log axis
    y_from_zero: bool = True


def add_plot_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--plot PATH`: `what` names the curve, for --help."""
    parser.add_argument("--plot", metavar="PATH", help=f"also draw {what} into this image (.png, .svg, .pdf)")


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install -e '.[plot]'")


def write_chart(chart: Chart, path: str | Path) -> None:
    """Draw `chart` into `path` (any directory it needs is made), without a display."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no window, and no display needed
    from matplotlib import pyplot
    from matplotlib.ticker import ScalarFormatter

    figure, axes = pyplot.subplots(figsize=(8, 4.8), layout="constrained")
    try:
        for s in chart.series:
            axes.plot(s.x, s.y, marker="o", label=s.label)
        if chart.x_log:
            axes.set_xscale("log", base=2)
            axes.xaxis.set_major_formatter(ScalarFormatter())  # 512, not 2^9
        if chart.y_from_zero:
            axes.set_ylim(bottom=0)
        axes.set_title(chart.title, fontsize="medium")
        axes.set(xlabel=chart.x_label, ylabel=chart.y_label)
        axes.grid(True, alpha=0.3)
        axes.legend()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=120)
    finally:
        pyplot.close(figure)
