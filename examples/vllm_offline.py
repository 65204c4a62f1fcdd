"""vLLM's offline API with kvferry: the second run of a long prompt loads its prefix from kvferry.

    pip install -e '.[vllm]'
    python examples/vllm_offline.py --model Qwen/Qwen2.5-0.5B-Instruct                 # cache in this process
    python examples/vllm_offline.py --model ... --mode server --server-url tcp://127.0.0.1:5555   # a kvferry server

vLLM's own prefix cache is turned off here only so that the repeat is served by kvferry; in production leave it
on: kvferry then serves what vLLM evicted, restarted engines and other engine processes (server mode).
On a CPU-only machine set VLLM_CPU_KVCACHE_SPACE (GiB) and VLLM_CPU_OMP_THREADS_BIND first. Embedded mode keeps
the cache in vLLM's worker, which must then share the scheduler's process: this script sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 for it (vLLM's CPU backend otherwise runs its worker apart).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["embedded", "server"], default="embedded")
    parser.add_argument("--server-url", default="tcp://127.0.0.1:5555")
    args = parser.parse_args()
    if args.mode == "embedded":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams  # after the environment is set

    extra: dict = {"mode": args.mode}
    if args.mode == "server":
        extra["server_url"] = args.server_url
    else:
        extra["config"] = {"cache": {"l1_size_gb": 2}}  # host memory for the cache; tiers: {"tiers": [...]}
    llm = LLM(
        model=args.model,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    document = " ".join(f"Clause {i}: the party of part {i % 7} shall deliver item {i * 13 % 101}." for i in range(300))
    prompt = f"{document}\n\nQuestion: which item does clause 42 name? Answer:"
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for attempt in ("first (kvferry miss)", "second (kvferry hit)"):
        started = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(
            f"{attempt}: {time.perf_counter() - started:.2f} s, {out.num_cached_tokens} of "
            f"{len(out.prompt_token_ids)} prompt tokens loaded -> {out.outputs[0].text!r}"
        )


if __name__ == "__main__":
    main()
