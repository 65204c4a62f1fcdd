"""`kvferry bench cache | pool | tiers | server | codec-accuracy` end to end in tiny configurations, and their option
checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvferry.cli.main import main
from tests.cli.benchkit import run_bench

ROOT = Path(__file__).resolve().parents[2]


def test_pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc, progress = run_bench(monkeypatch, tmp_path, "pool", "--ops", "2000", "--capacity-mib", "64")
    rows = {r["case"]: r for r in doc["results"]}
    assert list(rows) == ["chunk_pairs", "random_churn", "allocator_pairs"] == progress.done
    assert rows["chunk_pairs"]["ops"] == rows["allocator_pairs"]["ops"] == 2000
    assert all(r["ops_per_s"] > 0 for r in rows.values())
    assert doc["config"]["capacity_bytes"] == 64 << 20
    out = capsys.readouterr().out
    assert "random_churn" in out and "ops/s" in out and "results written to" in out


def test_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    doc, _ = run_bench(monkeypatch, tmp_path, "cache", "--repeats", "2")
    assert torch.get_num_threads() == threads  # one thread while it ran, then the caller's again
    results = doc["results"]
    assert set(results["lookup"]) == {
        "lookup_128k_numpy_us",
        "lookup_128k_tensor_us",
        "lookup_128k_list_us",
        "lookup_128k_locked_us",
        "lookup_miss_us",
    }
    assert all(v > 0 for v in results["lookup"].values())
    assert [(r["chunks"], r["geometry_given"]) for r in results["overhead"]] == [
        (n, g) for g in (True, False) for n in (1, 16, 64)
    ]
    for row in results["overhead"]:
        assert row["api_store_us"] > 0 and row["bare_retrieve_us"] > 0
        assert set(row["store_overhead_per_chunk_us"]) == {"interleaved_min", "interleaved_median", "in_call_median"}
    assert results["calibration_10M_steps_s"] > 0
    out = capsys.readouterr().out
    assert "lookup_128k_list_us" in out and "store ovh/chunk" in out and "calibration" in out


def test_tiers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--total-mib", "4", "--reps", "1", "--objects", "qwen2.5-0.5b", "--dir", str(tmp_path))
    doc, _ = run_bench(monkeypatch, tmp_path, "tiers", *args)
    rows = doc["results"]["rows"]
    tiers = {r["tier"] for r in rows}
    assert "disk (buffered)" in tiers
    if shutil.which("redis-server"):
        assert "redis" in tiers and doc["config"]["redis"] == "local redis-server"
    for r in rows:
        assert r["object"] == "qwen2.5-0.5b" and r["count"] == 2  # at least two objects, even below --total-mib
        assert r["tier_GBps"] > 0 and r["ratio"] > 0
    assert doc["results"]["checksum_xxh3_1_thread_GBps"]["qwen2.5-0.5b"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["tiers.json"]  # its working directory removed
    assert "plain 4 thr" in capsys.readouterr().out


def test_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--requests", "20", "--transfers", "4", "--pool-gb", "0.25")
    doc, _ = run_bench(monkeypatch, tmp_path, "server", *args)
    cases = doc["results"]["cases"]
    assert list(cases) == [
        "floor",
        "ping",
        "lookup",
        "lookup_x32",
        "store_1chunk",
        "retrieve_1chunk",
        "store_16chunk",
        "retrieve_16chunk",
    ]
    assert cases["ping"]["p50_us"] > 0 and cases["lookup_x32"]["req_per_s"] > 0
    for name in ("store_1chunk", "retrieve_16chunk"):
        assert cases[name]["gbps"] > 0 and cases[name]["engine_us"] > 0
    assert doc["results"]["chunk_bytes"] == 2 * 24 * 256 * 2 * 64 * 2  # qwen2.5-0.5b: K,V x layers x tokens x heads
    store = doc["results"]["cases"]["store_16chunk"]
    assert 0 < store["ratio"] < 2 and 0 < store["engine_ratio"] < 2 and store["ceiling_us"] > 0
    assert "retrieve_16chunk" in capsys.readouterr().out


def test_server_over_its_unix_socket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    doc, _ = run_bench(
        monkeypatch, tmp_path, "server", "--requests", "20", "--transfers", "2", "--pool-gb", "0.25", "--ipc"
    )
    cases = doc["results"]["cases"]
    assert doc["config"]["ipc"] is True
    assert cases["floor"]["p50_us"] > 0 and cases["retrieve_16chunk"]["p50_us"] > 0


def test_server_with_curve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    doc, _ = run_bench(
        monkeypatch, tmp_path, "server", "--requests", "20", "--transfers", "2", "--pool-gb", "0.25", "--curve"
    )
    assert doc["config"]["curve"] is True
    assert doc["results"]["cases"]["lookup"]["p50_us"] > 0 and doc["results"]["cases"]["store_16chunk"]["gbps"] > 0


def test_server_with_events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The server publishes its KV events over its Unix socket's run too; a subscriber in another process followed
    them: the chunks it holds at the end are the pool's (the run's stores, less what LRU evicted)."""
    args = ("--requests", "20", "--transfers", "2", "--pool-gb", "0.25", "--ipc", "--events")
    doc, _ = run_bench(monkeypatch, tmp_path, "server", *args)
    events = doc["results"]["events"]
    assert doc["config"]["events"] is True and events["gaps"] == 0 and events["last_seq"] >= 0
    assert events["held"]["server"]["CPU"] > 16  # the lookup case's 16 chunks at least


def test_server_engines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = ("--engines", "2", "--rounds", "3", "--think-ms", "0", "--pool-gb", "0.25", "--ipc")
    doc, _ = run_bench(monkeypatch, tmp_path, "server-engines", *args)
    assert doc["config"]["ipc"] is True
    ops = doc["results"]["ops"]
    assert list(ops) == ["lookup", "store_1chunk", "retrieve_1chunk"]
    for row in ops.values():
        assert row["alone_p50_us"] > 0 and row["together_worst_p99_us"] >= row["together_worst_p50_us"] > 0
        assert row["slowdown_p50"] > 0
    assert doc["config"]["engines"] == 2


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["pool", "--ops", "0"], "--ops"),
        (["pool", "--capacity-mib", "16"], "--capacity-mib"),
        (["cache", "--repeats", "0"], "--repeats"),
        (["tiers", "--objects", "gpt-5"], "--objects"),
        (["tiers", "--reps", "0"], "--reps"),
        (["tiers", "--dir", "/nonexistent/kvferry"], "--dir"),
        (["tiers", "--redis-url", "redis://127.0.0.1:1"], "--redis-url"),
        (["tiers", "--redis-url", "http://x"], "--redis-url"),
        (["tiers", "--mooncake", "redis://127.0.0.1:1"], "--mooncake"),
        (["tiers", "--mooncake", "mooncake://127.0.0.1:1"], "--mooncake"),
        (["server", "--transfers", "0"], "--transfers"),
        (["server", "--pool-gb", "0"], "--pool-gb"),
        (["server", "--curve", "--ipc"], "--curve"),
        (["server", "--busy-poll-us", "-1"], "--busy-poll-us"),
        (["vllm-gpu", "--no-server", "--busy-poll-us", "500"], "--busy-poll-us"),
        (["sglang-gpu", "--no-server", "--busy-poll-us", "500"], "--busy-poll-us"),
        (["server-engines", "--engines", "0"], "--engines"),
        (["server-engines", "--rounds", "100001"], "--rounds"),
    ],
)
def test_bad_options_exit_2_naming_them(args: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert f"kvferry bench {args[0]}: error:" in err and named in err


def test_codec_accuracy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc, progress = run_bench(monkeypatch, tmp_path, "codec-accuracy")
    token, chunk = doc["results"]["rows"]
    assert progress.done == [token["scales"], chunk["scales"]] and token["scales"].startswith("per token and head")
    for what in ("k", "v", "attention"):  # finer scales: smaller errors, each a few percent at most
        assert 0 < token[what] < chunk[what] < 0.1
    assert "attention output" in capsys.readouterr().out


def test_codec_greedy_refuses_layers_the_model_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec-greedy", "--layers", "2", "--exact-layers", "0,2"]) == 2
    assert "--exact-layers [2] are not layers of a 2-layer model" in capsys.readouterr().err
