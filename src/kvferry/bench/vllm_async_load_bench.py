"""`kvferry bench vllm-async-load`: decode step time of running requests while a long prefix loads from kvferry,
with and without async loads.

A random-weight Llama (written to a temporary directory; no hub) runs on vLLM's CPU backend with kvferry embedded,
one engine per mode, each in a fresh process. A long prompt is stored first. Then --running short requests
decode, and once they do, the long prompt comes again: kvferry holds its prefix. With `async_load` the load runs
in the background (vLLM's WAITING_FOR_REMOTE_KVS) and the running requests keep decoding; without, the step that
admits the long request loads it before its forward pass, and every running request waits for that step.
Reported per mode: the running requests' step times from the long request's arrival to its first token (median
and max), that time itself, and the load's size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvferry.bench.harness import Outcome, Steps, add_json_argument, description_of, positive, require_vllm
from kvferry.bench.report import new_table
from kvferry.bench.vllm_child import connector_config, run_child, write_llama

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench vllm-async-load                          # an 8192-token prefix, 4 running requests
  kvferry bench vllm-async-load --prefix-tokens 4096 --running 8 --json bench-out/vllm_async_load.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix-tokens", type=int, default=8192, help="the long prompt's tokens kvferry loads (default: %(default)s)"
    )
    parser.add_argument(
        "--running", type=int, default=4, help="short requests decoding meanwhile (default: %(default)s)"
    )
    parser.add_argument("--layers", type=int, default=16, help="the model's layers (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads of 64 per layer (default: %(default)s)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "prefix_tokens", "running", "layers", "kv_heads")
    require_vllm()


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(1 + 2 * 2)
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_llama(
            model,
            layers=args.layers,
            hidden=512,
            heads=args.kv_heads,
            kv_heads=args.kv_heads,
            intermediate=1024,
            vocab=1024,
            dtype="bfloat16",
        )
        steps.done("model written")
        for mode in ("sync", "async"):  # each engine in a fresh process
            payload = {"model": str(model), "async_load": mode == "async"}
            payload |= {"prefix_tokens": args.prefix_tokens, "running": args.running}
            results.append(run_child("kvferry.bench.vllm_async_load_bench:measure", payload, env, steps))
    kv_bytes = 2 * args.layers * args.kv_heads * 64 * 2 * args.prefix_tokens
    config = {"prefix_tokens": args.prefix_tokens, "running_requests": args.running}
    config |= {"layers": args.layers, "kv_heads": args.kv_heads, "dtype": "bfloat16"}
    return Outcome(config, {"prefix_kv_mib": kv_bytes / 2**20, "modes": results}, _show(args, kv_bytes, results))


def _show(args: argparse.Namespace, kv_bytes: int, results: list[dict[str, Any]]) -> list[Any]:
    table = new_table(
        f"vLLM CPU, {args.running} running requests while a {args.prefix_tokens}-token prefix "
        f"({kv_bytes / 2**20:.1f} MiB of KV) loads from kvferry",
        (
            "async_load",
            "steps while loading",
            "step ms median",
            "step ms max",
            "steady step ms",
            "long request's first token ms",
            "tokens loaded",
        ),
    )
    for r in results:
        table.add_row(
            str(r["async_load"]),
            str(r["steps_while_loading"]),
            f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_max']:.1f}",
            f"{r['step_ms_steady']:.1f}",
            f"{r['long_request_first_token_ms']:.0f}",
            str(r["tokens_loaded"]),
        )
    return [table]


def measure(payload: dict[str, Any], step: Callable[[str], None]) -> dict[str, Any]:
    """In the engine's process (see `vllm_child`): store the long prompt, then time steps while its prefix loads."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput

    from kvferry.integrations.vllm.connector import KvferryConnector

    prefix_tokens, running, async_load = payload["prefix_tokens"], payload["running"], payload["async_load"]
    llm = LLM(
        model=payload["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_model_len=prefix_tokens + 512,
        max_num_batched_tokens=prefix_tokens + 512,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=connector_config(async_load=async_load, config={"cache": {"l1_size_gb": 2}}),
    )
    step(f"async_load={async_load}: vLLM engine started")
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
        if any(
            isinstance(o, RequestOutput) and o.request_id == "999" and o.outputs and o.outputs[0].token_ids
            for o in outputs
        ):
            first_token = time.perf_counter() - arrived
    for _ in range(5):  # steady decode after it, for comparison
        started = time.perf_counter()
        engine.step()
        steps_after = time.perf_counter() - started
    connector = get_kv_transfer_group()
    assert isinstance(connector, KvferryConnector) and connector.worker_counters is not None  # in-process
    loaded = connector.worker_counters.tokens_loaded  # the connector's own count
    engine.engine_core.shutdown()
    step(f"async_load={async_load}: measured")
    return {
        "async_load": async_load,
        "steps_while_loading": len(steps),
        "step_ms_median": 1000 * statistics.median(steps),
        "step_ms_max": 1000 * max(steps),
        "step_ms_steady": 1000 * steps_after,
        "long_request_first_token_ms": 1000 * first_token,
        "tokens_loaded": loaded,
    }
