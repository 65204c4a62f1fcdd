"""`kvferry bench transfer` end to end (tiny sizes), its option checks, and the copy ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvferry.bench import BenchError, make_spec, measure_ceiling
from kvferry.cli.main import main
from kvferry.formats import EngineKVFormat, layout_of


def _run_json(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    assert main(["bench", "transfer", "--repeats", "2", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_default_shape_both_directions_reports_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _run_json(tmp_path, "--tokens", "512")
    assert [r["direction"] for r in doc["results"]] == ["d2h", "h2d"]
    for r in doc["results"]:
        assert r["format"] == "NL_X_TWO_NB_BS_NH_HS" and r["backend"] == "torch"
        assert r["bytes"] == 512 * 2 * 32 * 8 * 128 * 2  # tokens x K,V x layers x heads x head size x bf16
        assert r["ratio"] > 0 and r["gbps"] > 0 and r["ceiling_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["ceiling_gbps"])
        assert r["verified_blocks"] == 512 // 16 and len(r["seconds"]) == 2
    assert doc["config"]["model"] == "llama3-8b" and doc["config"]["block_size"] == 16
    assert doc["command"].startswith("kvferry bench transfer")
    assert {"cpu", "cpu_cores", "torch", "triton", "device", "python"} <= doc["machine"].keys()
    out = capsys.readouterr().out
    assert "NL_X_TWO_NB_BS_NH_HS" in out and "ratio" in out


def test_mla_model_defaults_and_partial_last_object(tmp_path: Path) -> None:
    doc = _run_json(tmp_path, "--model", "deepseek-v3-mla", "--tokens", "320", "--direction", "h2d")
    (r,) = doc["results"]
    assert r["format"] == "NL_X_NB_BS_HS" and doc["config"]["block_size"] == 64
    assert r["bytes"] == 320 * 61 * 576 * 2 and r["ratio"] > 0


def test_explicit_dims_several_formats_and_dtypes(tmp_path: Path) -> None:
    doc = _run_json(
        tmp_path,
        *("--layers", "3", "--heads", "2", "--head-size", "16", "--tokens", "64", "--chunk-size", "32"),
        *("--format", "NL_X_NB_BS_NH_TWO_HS,6,NL_X_NB_BSV_BSS", "--dtype", "fp32", "--direction", "d2h"),
    )
    got = {r["format"]: r for r in doc["results"]}
    assert list(got) == ["NL_X_NB_BS_NH_TWO_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_BSV_BSS"]
    assert got["NL_X_NB_BS_NH_TWO_HS"]["bytes"] == 64 * 3 * 2 * 2 * 16 * 4
    assert got["NL_X_NB_BSV_BSS"]["dtype"] == "uint8"  # a byte layout moves bytes whatever --dtype says
    assert doc["config"]["dims"] == {"nl": 3, "nh": 2, "hs": 16, "plane_widths": []}


def test_all_formats_of_an_mla_model() -> None:
    spec = make_spec(model="deepseek-v3-mla", formats="all")
    assert set(spec.formats) == {f for f in EngineKVFormat if layout_of(f).is_mla}
    assert EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS in spec.formats
    assert EngineKVFormat.NL_X_TWO_NB_BS_NH_HS not in spec.formats


def test_wrong_backend_is_caught_before_timing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("kvferry.kernels.torch_copy.copy_torch", lambda *args, **kwargs: None)
    assert main(["bench", "transfer", "--tokens", "64", "--repeats", "1"]) == 1
    assert "disagrees with the reference" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--tokens", "100"], "--tokens"),
        (["--chunk-size", "24"], "--chunk-size"),
        (["--format", "NOT_A_FORMAT"], "--format"),
        (["--format", "17"], "--format NL_X_NP_X_NB_BS_ONE_HS"),
        (["--layers", "0"], "--layers"),
        (["--repeats", "0"], "--repeats"),
        (["--backend", "torch", "--device", "cuda"], "--"),
    ],
)
def test_bad_options_are_named(args: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "cuda" in args and torch.cuda.is_available():
        args = [*args[:2], "--backend", "torch"]  # on a GPU machine: the torch backend refuses pinned objects
    assert main(["bench", "transfer", *args]) == 2
    assert names in capsys.readouterr().err


def test_make_spec_rejects_unknown_model() -> None:
    with pytest.raises(BenchError, match="--model"):
        make_spec(model="gpt-5")


def test_measure_ceiling_on_cpu() -> None:
    assert measure_ceiling("cpu", 1 << 20, "d2h", repeats=3) > 0
    with pytest.raises(ValueError, match="direction"):
        measure_ceiling("cpu", 1 << 20, "sideways")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_on_cuda(tmp_path: Path) -> None:
    doc = _run_json(tmp_path, "--device", "cuda", "--tokens", "1024")
    assert [r["backend"] for r in doc["results"]] == ["triton", "triton"]
    assert all(r["ratio"] > 0 for r in doc["results"])
    assert doc["machine"]["device"] != "cpu"
