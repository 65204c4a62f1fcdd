"""Decode step time of running requests while a long prefix loads from kvferry, with and without async loads.

    python benchmarks/bench_vllm_async_load.py [--prefix-tokens 8192] [--running 4] [--json out.json]

A random-weight Llama (written to a temporary directory; no hub) runs on vLLM's CPU backend with kvferry embedded.
A long prompt is stored first. Then ``--running`` short requests decode, and once they do, the long prompt comes
again: kvferry holds its prefix. With ``async_load`` the load runs in the background (vLLM's WAITING_FOR_REMOTE_KVS)
and the running requests keep decoding; without, the step that admits the long request loads it before its
forward pass, and every running request waits for that step. Reported per mode: the running requests' step times
from the long request's arrival to its first token (median and max), that time itself, and the load's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def write_model(path: Path, layers: int, kv_heads: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def run_mode(model: Path, async_load: bool, prefix_tokens: int, running: int) -> dict[str, Any]:
    """One engine (this process): store the long prompt, then time steps while its prefix loads again."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_model_len=prefix_tokens + 512,
        max_num_batched_tokens=prefix_tokens + 512,
        enforce_eager=True,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "mode": "embedded",
                "async_load": async_load,
                "config": {"cache": {"l1_size_gb": 2}},
            },
        },
    )
    engine = llm.llm_engine
    long_prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % 1000 + 3 for i in range(prefix_tokens + 64)])
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([long_prompt], first, use_tqdm=False)  # computes and stores the prefix
    decode = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(running):
        engine.add_request(str(1000 + i), TokensPrompt(prompt_token_ids=[5 + i] * 32), decode)
    for _ in range(20):  # the running requests are decoding
        engine.step()
    engine.add_request("999", long_prompt, first)
    arrived = time.perf_counter()
    steps: list[float] = []
    first_token = None
    while first_token is None:
        started = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - started)
        if any(o.request_id == "999" and o.outputs and o.outputs[0].token_ids for o in outputs):
            first_token = time.perf_counter() - arrived
    for _ in range(5):  # steady decode after it, for comparison
        started = time.perf_counter()
        engine.step()
        steps_after = time.perf_counter() - started
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    loaded = get_kv_transfer_group()._worker.counters.tokens_loaded  # the connector's own count
    engine.engine_core.shutdown()
    return {
        "async_load": async_load,
        "steps_while_loading": len(steps),
        "step_ms_median": 1000 * statistics.median(steps),
        "step_ms_max": 1000 * max(steps),
        "step_ms_steady": 1000 * steps_after,
        "long_request_first_token_ms": 1000 * first_token,
        "tokens_loaded": loaded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--one", choices=["async", "sync"], help=argparse.SUPPRESS)  # one mode, in a child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.one:
        result = run_mode(Path(args.model), args.one == "async", args.prefix_tokens, args.running)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_model(model, args.layers, args.kv_heads)
        for mode in ("sync", "async"):  # each engine in a fresh process
            cmd = [sys.executable, __file__, "--one", mode, "--model", str(model)]
            cmd += ["--prefix-tokens", str(args.prefix_tokens), "--running", str(args.running)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    kv_bytes = 2 * args.layers * args.kv_heads * 64 * 2 * args.prefix_tokens
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "prefix_tokens": args.prefix_tokens,
        "prefix_kv_mib": kv_bytes / 2**20,
        "running_requests": args.running,
        "results": results,
    }
    for r in results:
        print(
            f"async_load={r['async_load']!s:5}  running requests' step while the prefix loads: median "
            f"{r['step_ms_median']:.1f} ms, max {r['step_ms_max']:.1f} ms over {r['steps_while_loading']} steps "
            f"(steady {r['step_ms_steady']:.1f} ms); long request's first token after "
            f"{r['long_request_first_token_ms']:.0f} ms; {r['tokens_loaded']} tokens loaded"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
