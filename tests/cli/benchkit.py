"""Running a `kvferry bench` subcommand in a test: its exit status, its JSON document, and its progress steps."""

from __future__ import annotations

import json
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
