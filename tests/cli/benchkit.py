"""Running a `kvferry bench` subcommand in a test: its exit status, its JSON document, and its progress steps."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvferry.bench import harness
from kvferry.cli.main import main


@dataclass
class Progress:
    """What a run told its progress bar: the totals it announced and the steps it reported done."""

    totals: list[int] = field(default_factory=list)
    done: list[str] = field(default_factory=list)


def run_bench(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, *args: str
) -> tuple[dict[str, Any], Progress]:
    """`kvferry bench NAME ARGS --json ...`, which must succeed; returns its JSON document and its progress."""
    progress = Progress()

    class Recorded(harness.Steps):
        def expect(self, total: int) -> None:
            progress.totals.append(total)
            super().expect(total)

        def done(self, what: str) -> None:
            progress.done.append(what)
            super().done(what)

    monkeypatch.setattr(harness, "Steps", Recorded)
    out = tmp_path / f"{name}.json"
    assert main(["bench", name, *args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name
    assert doc["command"].startswith(f"kvferry bench {name}")
    assert {"cpu", "cpu_cores", "python", "torch", "device"} <= doc["machine"].keys()
    # the bar ends full: one total announced, and exactly that many steps reported
    assert len(progress.totals) == 1 and len(progress.done) == progress.totals[0]
    return doc, progress


class NoCopy:
    """A GPU bench's pinned memcpy on a machine without one: nothing copied, so nothing to time."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, to_host: bool) -> None:
        pass

    def start(self, to_host: bool) -> None:
        pass


def host_span(call: Callable[[], object]) -> float:
    """`kvferry.bench.timing.gpu_span` by the host's clock, for a GPU bench run on the CPU."""
    began = time.perf_counter()
    call()
    return time.perf_counter() - began
