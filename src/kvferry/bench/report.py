"""Benchmark output: the machine it ran on, a rich table, and a JSON document."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from kvferry.bench.transfer_bench import BenchSpec, TransferResult


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
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = "cpu"
    return info


def results_table(spec: BenchSpec, results: list[TransferResult]) -> Table:
    dims = spec.dims
    title = (
        f"kvferry.transfer on {spec.model} (NL={dims.nl}, NH={dims.nh}, HS={dims.hs}), {spec.tokens} tokens, "
        f"block {spec.block_size}, chunk {spec.chunk_size}, {spec.device.type}, median of {spec.repeats}"
    )
    table = Table(title=title, title_justify="left")
    for name, justify in (
        ("format", "left"),
        ("dir", "left"),
        ("backend", "left"),
        ("dtype", "left"),
        ("MiB", "right"),
        ("GB/s", "right"),
        ("ceiling GB/s", "right"),
        ("ratio", "right"),
        ("ceiling", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        style = "green" if r.ratio >= 0.8 else "yellow" if r.ratio >= 0.5 else "red"
        table.add_row(
            f"{r.fmt.value} {r.fmt.name}",
            r.direction,
            r.backend,
            r.dtype,
            f"{r.nbytes / 2**20:.0f}",
            f"{r.gbps:.2f}",
            f"{r.ceiling_gbps:.2f}",
            f"[{style}]{r.ratio:.2f}[/{style}]",
            r.ceiling_method,
        )
    return table


def to_json(spec: BenchSpec, results: list[TransferResult], argv: list[str]) -> dict[str, Any]:
    """Everything needed to reproduce and compare a run."""
    return {
        "benchmark": "transfer",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(argv),
        "machine": machine_info(spec.device),
        "config": {
            "model": spec.model,
            "dims": asdict(spec.dims),
            "tokens": spec.tokens,
            "chunk_size": spec.chunk_size,
            "block_size": spec.block_size,
            "backend": spec.backend,
            "device": str(spec.device),
            "dtype": str(spec.dtype).removeprefix("torch."),
            "repeats": spec.repeats,
            "seed": spec.seed,
        },
        "results": [
            {
                "format": r.fmt.name,
                "format_id": r.fmt.value,
                "direction": r.direction,
                "backend": r.backend,
                "dtype": r.dtype,
                "tokens": r.tokens,
                "bytes": r.nbytes,
                "gbps": r.gbps,
                "ceiling_gbps": r.ceiling_gbps,
                "ratio": r.ratio,
                "ceiling_method": r.ceiling_method,
                "seconds": r.seconds,
                "ceiling_seconds": r.ceiling_seconds,
                "verified_blocks": r.verified_blocks,
            }
            for r in results
        ],
    }


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
