"""What the vLLM benchmarks share: a random-weight Llama written to disk (no hub), the connector's settings, and
a vLLM engine run in a child process of its own.

The engine runs in a fresh process (`run_child`) so that its environment (set before vLLM is imported), its
threads and its memory end with it: vLLM's background threads can stall an interpreter's exit, so the child ends
with `os._exit` once it has printed its result. It reports on stdout, one line each: a step done, then its result
as JSON; everything else it prints (vLLM's logs) is kept to explain a failure.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvferry.bench.harness import BenchError, Steps, child_env

_STEP = "KVFERRY-BENCH-STEP "
_RESULT = "KVFERRY-BENCH-RESULT "
CHILD_TIMEOUT_S = 3600.0  # an engine process still running after this is stuck: it is killed


def write_llama(
    path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, dtype: str
) -> int:
    """A random-weight Llama (seed 0, head size 64) saved as a Hugging Face checkpoint; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


VOCAB = 32000


def llama_shape(layers: int, hidden: int) -> dict[str, int]:
    """The benchmarks' Llama of `layers` x `hidden` (a multiple of 256): heads of 64, 4 query heads per KV head."""
    if hidden % 256:
        raise BenchError(f"--hidden must be a multiple of 256 (heads of 64, 4 per KV head), got {hidden}")
    return {"layers": layers, "hidden": hidden, "heads": hidden // 64, "kv_heads": max(1, hidden // 256)}


def write_shaped_llama(path: Path, shape: dict[str, int], dtype: str) -> int:
    """`write_llama` of a `llama_shape` (an MLP 3x wide, `VOCAB` tokens); returns its parameter count."""
    return write_llama(path, layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                       kv_heads=shape["kv_heads"], intermediate=shape["hidden"] * 3, vocab=VOCAB,
                       dtype=dtype)  # fmt: skip


def engine_env() -> dict[str, str]:
    """The environment of a benchmark's in-process vLLM CPU engine: its worker in the same process, a 2 GiB KV cache,
    its OpenMP threads on every CPU; a variable already set wins."""
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, (os.cpu_count() or 1) - 1)}",
    }
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


def connector_config(**extra: Any) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for KvferryConnector with the cache embedded in the engine's process."""
    return {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"mode": "embedded", **extra},
    }


def run_child(target: str, payload: dict[str, Any], env: dict[str, str], steps: Steps) -> dict[str, Any]:
    """`target(payload, step)` ("module:function") in a fresh Python process with `env` added to this one's;
    its steps advance `steps`; returns what it returned (JSON)."""
    code = "from kvferry.bench.vllm_child import child_main; child_main()"
    cmd = [sys.executable, "-c", code, target, json.dumps(payload)]
    proc = subprocess.Popen(cmd, env=child_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    watchdog = threading.Timer(CHILD_TIMEOUT_S, proc.kill)  # ends the read loop below by closing the pipe
    watchdog.start()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    result = None
    try:
        for line in proc.stdout:
            if line.startswith(_STEP):
                steps.done(line.removeprefix(_STEP).strip())
            elif line.startswith(_RESULT):
                result = json.loads(line.removeprefix(_RESULT))
            else:
                tail.append(line)
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # this process was interrupted: the engine's ends with it
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or result is None:
        raise BenchError(f"the vLLM engine's process failed (exit status {proc.returncode}):\n{''.join(tail)}")
    return result


def child_main() -> None:
    """The child's side of `run_child`: sys.argv is [-c, target, payload]."""
    try:
        module, function = sys.argv[1].split(":")
        measure: Callable[[dict[str, Any], Callable[[str], None]], dict[str, Any]]
        measure = getattr(importlib.import_module(module), function)
        result = measure(json.loads(sys.argv[2]), lambda what: print(_STEP + what, flush=True))
        print(_RESULT + json.dumps(result), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)  # vLLM's background threads can stall interpreter teardown
