"""`kvferry bench ... --plot PATH`: the curve drawn from the run's own results, and a clear refusal without
matplotlib (the `plot` extra)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from kvferry.bench import vllm_ttft_bench
from kvferry.bench.plot import write_chart
from kvferry.cli.main import main

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (pip install -e '.[plot]')"
)
SMALL = ("--layers", "2", "--heads", "2", "--head-size", "16", "--chunk-size", "32", "--repeats", "1")


@needs_matplotlib
def test_transfer_plots_the_ratio_against_the_request_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, out = tmp_path / "plots" / "transfer.png", tmp_path / "transfer.json"
    args = ["bench", "transfer", *SMALL, "--tokens", "64,256", "--json", str(out), "--plot", str(png)]
    assert main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"plot written to {png}" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [(r["direction"], r["tokens"]) for r in doc["results"]] == [
        ("d2h", 64),
        ("h2d", 64),
        ("d2h", 256),
        ("h2d", 256),
    ]
    assert doc["config"]["tokens"] == [64, 256]


@needs_matplotlib
def test_the_ttft_chart_draws_both_curves_from_the_results(tmp_path: Path) -> None:
    by_length = [
        {"prompt_tokens": 1024, "ttft_miss_s": 1.2, "ttft_hit_s": 0.2, "speedup": 6.0},
        {"prompt_tokens": 4096, "ttft_miss_s": 4.9, "ttft_hit_s": 0.5, "speedup": 9.8},
    ]
    args = argparse.Namespace(prompts=3, layers=1, dtype="float32", server=False, foreground_loads=False)
    chart = vllm_ttft_bench._chart(args, {"parameters": 5e6}, by_length)
    assert [(s.label, s.x, s.y) for s in chart.series] == [
        ("without a hit", [1024.0, 4096.0], [1.2, 4.9]),
        ("with a kvferry hit", [1024.0, 4096.0], [0.2, 0.5]),
    ]
    svg = tmp_path / "ttft.svg"
    write_chart(chart, svg)
    text = svg.read_text()
    assert "without a hit" in text and "with a kvferry hit" in text


def test_without_matplotlib_plot_exits_2_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(["bench", "transfer", *SMALL, "--tokens", "64", "--plot", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err and "pip install -e '.[plot]'" in captured.err
    assert not captured.out and not (tmp_path / "t.png").exists()


@needs_matplotlib
def test_a_plot_that_cannot_be_written_fails_after_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")  # a file where the plot's directory would be
    assert main(["bench", "transfer", *SMALL, "--tokens", "64", "--plot", str(tmp_path / "file" / "t.png")]) == 1
    captured = capsys.readouterr()
    assert "ratio" in captured.out and "cannot write the plot" in captured.err


def test_a_bad_size_list_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "transfer", "--tokens", "64,lots"])
    assert exited.value.code == 2
    assert "not a comma-separated list of whole numbers" in capsys.readouterr().err
