"""Runs one vLLM engine for the end-to-end test (one process per engine, so engines never share state).

    python vllm_driver.py PHASE --model DIR --prompt FILE --out FILE [--tier-dir DIR | --server-url URL]
                          [--multiprocessing]

PHASE reference: no connector, one greedy generation. embedded: KvferryConnector with the cache in this process
(and a disk tier written on store, which the test reads objects back from): the prompt three times, the third
with the loaded KV corrupted by the test hook. server: KvferryConnector talking to a kvferry server, once.
Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless --multiprocessing: then vLLM's engine
core and its CPU worker are two more processes, so the connector's scheduler half runs apart from its KV.
Writes a JSON report: generated tokens, vLLM's cached-token count per run, timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # so vLLM can import the hooks module by name

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}
CHUNK_SIZE = 256
MAX_TOKENS = 12


def make_llm(model: str, extra: dict[str, Any] | None) -> Any:
    from vllm import LLM

    kv_transfer = None
    if extra is not None:
        kv_transfer = {
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enable_prefix_caching=False,  # so a repeat is served by kvferry, not vLLM's own prefix cache
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv_transfer,
    )


def generate(llm: Any, prompt: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return {
        "tokens": list(out.outputs[0].token_ids),
        "cached": int(out.num_cached_tokens or 0),
        "seconds": time.perf_counter() - started,
    }


def namespace_of(llm: Any) -> dict[str, Any]:
    from kvferry.integrations.vllm import backends

    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    backend = backends.find(engine_id)
    assert isinstance(backend, backends.EmbeddedBackend), backend
    ns = backend.namespace
    fields = ("model", "kv_dtype", "layout", "world_size", "rank", "salt")
    return {
        "namespace": {name: getattr(ns, name) for name in fields},
        "hash_algo": backend.engine.config.cache.hash_algo,
        "chunk_size": backend.engine.chunk_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["reference", "embedded", "server"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tier-dir")
    parser.add_argument("--server-url")
    parser.add_argument("--multiprocessing", action="store_true")
    args = parser.parse_args()
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    # In-process engines start faster and let the test hooks reach the worker.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocessing else "0"
    prompt = json.loads(Path(args.prompt).read_text())
    report: dict[str, Any] = {"phase": args.phase}

    if args.phase == "reference":
        extra = None
    elif args.phase == "embedded":
        extra = {
            "mode": "embedded",
            "config": {
                "cache": {"chunk_size": CHUNK_SIZE, "l1_size_gb": 0.25, "tier_write": "on_store"},
                "tiers": [f"disk:{args.tier_dir}?size=1GB"],
            },
            "after_load_hook": "vllm_hooks:corrupt_loaded_kv",
        }
    else:
        extra = {"mode": "server", "server_url": args.server_url}

    started = time.perf_counter()
    llm = make_llm(args.model, extra)
    report["engine_start_seconds"] = time.perf_counter() - started
    report["runs"] = [generate(llm, prompt)]
    if args.phase == "embedded":
        import vllm_hooks

        report["runs"].append(generate(llm, prompt))
        vllm_hooks.CORRUPT["on"] = True
        report["runs"].append(generate(llm, prompt))
        vllm_hooks.CORRUPT["on"] = False
        report["corrupt_calls"] = vllm_hooks.CORRUPT["calls"]
        report.update(namespace_of(llm))
        # The first run stored chunks, so vLLM kept its blocks until the connector reported the stores done;
        # a request still held here after two more runs would be leaked blocks. (vLLM internals: test only.)
        report["requests_held"] = len(llm.llm_engine.engine_core.engine_core.scheduler.requests)
    # Shut the engine down (the connector waits for its stores and flushes its tiers), then exit without
    # running interpreter teardown, which vLLM's background threads can stall.
    llm.llm_engine.engine_core.shutdown()
    Path(args.out).write_text(json.dumps(report))
    os._exit(0)


if __name__ == "__main__":
    main()
