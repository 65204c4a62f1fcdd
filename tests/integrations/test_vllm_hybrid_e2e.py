"""KvferryConnector on a real vLLM (the CPU build) serving a hybrid model with its hybrid KV cache manager on: a
tiny random-weight Gemma 3 (two sliding-window layers over 128 tokens, two full-attention ones) written here.

Engines run in processes of their own (vllm_hybrid_driver.py): a reference without kvferry; one with the cache
embedded; through a kvferry server, one in vLLM's multiprocess layout and one with two tensor-parallel ranks; a
state-space hybrid (Qwen3-Next's gated delta-net, its linear-attention state moved as objects of its own),
embedded and through a server (in the engine's process and in vLLM's multiprocess layout). Each runs a 1000-token
prompt (a miss), again (a hit of its 768 tokens of whole chunks, six windows long), and another prompt sharing
those 768 tokens; the state-space hybrid also a chat's next turn. vLLM's own prefix cache is off (the state-space
hybrid's is on, as its state needs, and emptied before the hit), so every reused token comes from
kvferry; greedy tokens must equal the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.client import KvferryClient
from tests.integrations.vllm_driver import start_server
from tests.integrations.vllm_e2e.kit import MARKS
from tests.ports import free_ports

pytestmark = MARKS

HERE = Path(__file__).resolve().parent
HIT, WINDOW, LAYERS = 768, 128, 4
GDN_PROMPT = 1000  # the driver's main prompt's tokens


def gdn_block(reference: dict[str, Any]) -> int:
    """The state-space hybrid's block size under vLLM's prefix caching: vLLM picks it from its page sizes, which
    depend on the machine (384 on one CPU, 256 on another); embedded mode's chunk follows it (one chunk a block)."""
    return int(reference["groups"][0]["block_size"])


def gdn_hit(reference: dict[str, Any]) -> int:
    """The main prompt's hit: its last block boundary, where vLLM keeps the state."""
    block = gdn_block(reference)
    return (GDN_PROMPT - 1) // block * block


DRIVER_TIMEOUT_S = 400


def run_driver(phase: str, tmp: Path, *extra: str) -> dict[str, Any]:
    out = tmp / f"{phase}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(HERE / "vllm_hybrid_driver.py"), phase, "--model", str(tmp / "model")]
    proc = subprocess.run([*cmd, "--out", str(out), *extra], capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    assert proc.returncode == 0 and out.exists(), (
        f"{phase} driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    report = json.loads(out.read_text())
    report["output"] = proc.stdout + proc.stderr
    return report


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-hybrid")
    run_driver("model", path)
    return path


@pytest.fixture(scope="module")
def reference(tmp: Path) -> dict[str, Any]:
    return run_driver("reference", tmp)


@pytest.fixture(scope="module")
def gdn_reference(tmp: Path) -> dict[str, Any]:
    return run_driver("gdn-reference", tmp)


def _check_runs(report: dict[str, Any], reference: dict[str, Any]) -> None:
    main, other = (run["tokens"] for run in reference["runs"])
    assert [run["tokens"] for run in report["runs"]] == [main, main, other]  # as without kvferry, token for token
    assert [run["cached"] for run in report["runs"]] == [[0], [HIT], [HIT]]  # vLLM's counter: hits from kvferry
    assert "Turning off hybrid kv cache manager" not in report["output"]
    assert "hybrid model: group=0:sliding_window:128 (2 layers" in report["output"]


def test_embedded_hits_a_prefix_after_the_window_slid(tmp: Path, reference: dict[str, Any]) -> None:
    report = run_driver("embedded", tmp)
    assert [g["kind"] for g in report["groups"]] == ["SlidingWindowSpec", "FullAttentionSpec"]  # HMA on
    _check_runs(report, reference)
    assert report["scheduler_counters"]["lookup_hit_tokens"] == 2 * HIT  # kvferry's counters agree
    assert report["worker_counters"]["tokens_loaded"] == 2 * HIT
    assert report["worker_counters"]["load_failures"] == report["worker_counters"]["store_failures"] == 0
    assert report["requests_held"] == report["tracked"] == report["scheduler_locks"] == 0  # nothing leaked
    # Per hit the full layers load every token, the sliding ones the blocks in the window at the hit's end only
    per_layer = report["bytes_per_token_all_layers"] // LAYERS
    assert report["bytes"]["loaded"] == 2 * (2 * HIT + 2 * WINDOW) * per_layer


@pytest.mark.parametrize("layout", [["--multiprocessing"], ["--tp", "2"]], ids=["multiprocess", "tp2"])
def test_server_mode_with_the_scheduler_apart_from_the_kv(
    tmp: Path, reference: dict[str, Any], layout: list[str]
) -> None:
    (port,) = free_ports(1)
    server = start_server(port, tmp / f"server-{port}.log")
    try:
        report = run_driver("server", tmp, "--server-url", f"tcp://127.0.0.1:{port}", *layout)
    finally:
        server.terminate()
        server.wait(timeout=30)
    _check_runs(report, reference)
    ranks = 2 if "--tp" in layout else 1  # every rank registers its heads of each group
    assert report["output"].count("hybrid model: group=0:sliding_window:128") == ranks


def test_a_state_space_hybrid_hits_with_its_linear_attention_state(tmp: Path, gdn_reference: dict[str, Any]) -> None:
    """Qwen3-Next's gated delta-net layers keep a state (vLLM's MambaSpec group, "align" mode under its prefix
    caching): the hit loads the full layers' chunks and the state at the hit's end, and greedy tokens are those of a
    run without kvferry; the same hit with the state zeroed instead gives other tokens (so the check can fail). The
    connector is set to load in the foreground, and loads in the background all the same (a model of several KV
    cache groups can report a failed load only there)."""
    report = run_driver("gdn", tmp, "--foreground")
    lost = run_driver("gdn-lost", tmp, "--foreground")
    assert "loads in the background" in report["output"]
    assert [(g["kind"], g["mamba_cache_mode"]) for g in report["groups"]] == [("MambaSpec", "align"),
                                                                            ("FullAttentionSpec", None)]  # fmt: skip
    assert report["groups"][0]["block_size"] == gdn_block(gdn_reference)  # a chunk holds one state
    assert "hybrid model: group=0:mamba (2 layers" in report["output"]
    _check_gdn_hit(report, gdn_reference)
    main = gdn_reference["runs"][0]["tokens"]
    assert lost["runs"][1]["cached"] == [gdn_hit(gdn_reference)] and lost["runs"][1]["tokens"] != main


def test_a_state_space_hybrid_hits_through_a_server(tmp: Path, gdn_reference: dict[str, Any]) -> None:
    """The same through a kvferry server: the worker registers the state group once the server told its chunk size,
    and the server's own counters show the hit's two attention chunks and one state read back."""
    (port,) = free_ports(1)
    server = start_server(port, tmp / f"server-{port}.log", chunk_size=gdn_block(gdn_reference))
    url = f"tcp://127.0.0.1:{port}"
    try:
        report = run_driver("gdn-server", tmp, "--server-url", url)
        with KvferryClient(url, timeout_s=10) as client:
            cache = client.stats()["cache"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "server mode (tcp://127.0.0.1" in report["output"] and "group=0:mamba (2 layers" in report["output"]
    _check_gdn_hit(report, gdn_reference)
    chunks = gdn_hit(gdn_reference) // gdn_block(gdn_reference) + 1  # the attention chunks and the state at the hit
    assert (cache["stored_chunks"], cache["retrieved_chunks"]) == (chunks, chunks)


def test_a_state_space_hybrid_hits_through_a_server_in_vllm_s_multiprocess_layout(
    tmp: Path, gdn_reference: dict[str, Any]
) -> None:
    """vLLM's default layout (its engine core and worker in processes of their own): there vLLM's CPU platform puts
    the scheduler's block size back to 128 after start, so its prefill chunks would end between Mamba boundaries and
    it would hand over no state (`state_settings`); kvferry puts the Mamba block size back, and the hit is the
    in-process one: vLLM's counter, the server's, greedy tokens. Its default retention interval gets a warning."""
    (port,) = free_ports(1)
    server = start_server(port, tmp / f"server-{port}.log", chunk_size=gdn_block(gdn_reference))
    url = f"tcp://127.0.0.1:{port}"
    try:
        report = run_driver("gdn-server", tmp, "--server-url", url, "--multiprocessing")
        with KvferryClient(url, timeout_s=10) as client:
            cache = client.stats()["cache"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert f"scheduler block size was 128, not the Mamba block size {gdn_block(gdn_reference)}" in report["output"]
    assert "prefix_cache_retention_interval is 0 (its default)" in report["output"]
    assert report["prefix_cache_reset"]  # the second run's hit can only be kvferry's
    main = gdn_reference["runs"][0]["tokens"]
    assert [run["tokens"] for run in report["runs"]] == [main, main]
    assert [run["cached"] for run in report["runs"]] == [[0], [gdn_hit(gdn_reference)]]  # vLLM's: kvferry's hit
    chunks = gdn_hit(gdn_reference) // gdn_block(gdn_reference) + 1  # the attention chunks and the state at the hit
    assert (cache["stored_chunks"], cache["retrieved_chunks"]) == (chunks, chunks)


def _check_gdn_hit(report: dict[str, Any], reference: dict[str, Any]) -> None:
    assert report["prefix_cache_reset"]  # the second run's hit can only be kvferry's
    main = reference["runs"][0]["tokens"]
    assert [run["tokens"] for run in report["runs"]] == [main, main]
    hit = gdn_hit(reference)
    assert [run["cached"] for run in report["runs"]] == [[0], [hit]]  # vLLM's counter: kvferry's hit
    assert report["scheduler_counters"]["hit_tokens_taken"] == hit  # kvferry's counters agree
    assert report["worker_counters"]["tokens_loaded"] == hit
    assert report["worker_counters"]["load_failures"] == report["worker_counters"]["store_failures"] == 0
    assert report["requests_held"] == report["tracked"] == report["scheduler_locks"] == 0  # nothing leaked


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "default"])
def test_a_chat_s_next_turn_hits_the_state_vllm_kept_while_generating(
    tmp: Path, gdn_reference: dict[str, Any], dense: bool
) -> None:
    """Turn 1 (700 tokens, 80 generated) crosses the boundary at 768 while generating. vLLM retaining every block's
    state (prefix_cache_retention_interval = its block size) hands that state over, kvferry stores it and the
    output's attention chunks at the finish: turn 2 hits 768 tokens, past turn 1's prompt, and its greedy tokens are
    those of vLLM's own prefix cache hitting the same state. With vLLM's default (0: the prompt's last boundary
    only) it hands over none past turn 1's prompt's last boundary: the hit stops there, and greedy tokens are those
    of a run computing every token."""
    block = gdn_block(gdn_reference)
    retention = block if dense else None
    # Dense: the boundary turn 1 crossed while generating (700 + 80 tokens); default: turn 1's prompt's last one.
    hit = (700 + 80) // block * block if dense else 700 // block * block
    kept = ["--retention", str(retention)] if retention is not None else []
    report = run_driver("gdn-chat", tmp, *kept)
    assert [turn["cached"] for turn in gdn_reference["chat"]] == [[0], [0]]  # the reference computes every token
    expected = gdn_reference["chat"]
    if dense:  # a state vLLM computed while generating, a token a step, differs in its last bits from the one a
        # prefill computes (another kernel): the tokens after a hit on it are those of vLLM's own hit on it
        own = run_driver("gdn-chat-reference", tmp, *kept)
        assert [turn["cached"] for turn in own["chat"]] == [[0], [hit]]  # vLLM's own prefix cache hits there
        assert own["chat"][0]["tokens"] == expected[0]["tokens"]
        expected = own["chat"]
    assert [turn["tokens"] for turn in report["chat"]] == [turn["tokens"] for turn in expected]
    assert report["chat"][0]["prefix_cache_reset"]  # turn 2's hit can only be kvferry's
    assert ("prefix_cache_retention_interval is 0" in report["output"]) == (retention is None)  # the start warning
    assert [turn["cached"] for turn in report["chat"]] == [[0], [hit]]  # vLLM's counter (turn 1's prompt: 700)
    assert report["scheduler_counters"]["hit_tokens_taken"] == report["worker_counters"]["tokens_loaded"] == hit
    assert report["worker_counters"]["load_failures"] == report["worker_counters"]["store_failures"] == 0
    assert report["requests_held"] == report["tracked"] == report["scheduler_locks"] == 0  # nothing leaked


def test_hma_holds_more_tokens_than_every_layer_holding_the_whole_context(tmp: Path) -> None:
    report = run_driver("capacity", tmp)
    assert len(report["hma"]["groups"]) == 2 and len(report["no_hma"]["groups"]) == 1
    assert report["hma"]["tokens"] > 1.5 * report["no_hma"]["tokens"]  # vLLM's own count, with kvferry on
