"""Time to first token on vLLM's CPU backend with and without a kvferry prefix hit, in one engine, same run.

    python benchmarks/bench_vllm_ttft.py [--prompt-tokens 4096] [--prompts 3] [--layers 8] [--hidden 512]
                                         [--out bench-out/bench_vllm_ttft.json]

Needs the vllm extra. Writes a random-weight Llama (no download) of the given size to a temp dir and starts one
vLLM engine with KvferryConnector embedded and vLLM's own prefix cache off. For each of --prompts distinct
random prompts: a first request (kvferry misses, computes the whole prompt and stores its full chunks), then the
same prompt again (kvferry loads every full chunk; vLLM computes only the tail). TTFT is the wall time of a
``generate`` with ``max_tokens=1`` (prefill plus one sampled token). Reported: medians over the prompts, the
hit's speed-up, and the tokens vLLM reported as cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, (os.cpu_count() or 1) - 1)}",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402  (the environment above must be set before vLLM is imported)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def write_model(path: Path, layers: int, hidden: int, dtype: torch.dtype) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    return {
        "layers": layers,
        "hidden": hidden,
        "kv_heads": config.num_key_value_heads,
        "head_dim": 64,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return time.perf_counter() - started, int(out.num_cached_tokens or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=3, help="distinct prompts (each a miss, then a hit)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="model width (a multiple of 256)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="float32 by default: CPUs without AVX-512 BF16 run bf16 matmuls slowly",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/bench_vllm_ttft.json"))
    args = parser.parse_args()

    from vllm import LLM

    workdir = Path(tempfile.mkdtemp(prefix="kvferry-ttft-"))
    model_info = write_model(workdir / "model", args.layers, args.hidden, getattr(torch, args.dtype))
    started = time.perf_counter()
    llm = LLM(
        model=str(workdir / "model"),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=args.prompt_tokens + 16,
        max_num_batched_tokens=args.prompt_tokens + 16,  # the whole prompt in one prefill step
        kv_transfer_config={
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "mode": "embedded",
                "config": {"cache": {"chunk_size": args.chunk_size, "l1_size_gb": 2}},
            },
        },
    )
    engine_start_s = time.perf_counter() - started

    rng = random.Random(0)
    ttft(llm, [rng.randrange(32000) for _ in range(64)])  # warm-up: first-call costs out of the numbers
    rows = []
    for i in range(args.prompts):
        prompt = [rng.randrange(32000) for _ in range(args.prompt_tokens)]
        miss_s, miss_cached = ttft(llm, prompt)
        time.sleep(0.5)  # let the miss's asynchronous store finish: a hit needs the chunks committed
        hit_s, hit_cached = ttft(llm, prompt)
        rows.append(
            {"prompt": i, "miss_s": miss_s, "hit_s": hit_s, "miss_cached": miss_cached, "hit_cached": hit_cached}
        )

    from kvferry.integrations.vllm import backends

    backend = backends.find(str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id))
    assert isinstance(backend, backends.EmbeddedBackend), "the connector did not register the KV cache"
    stats = backend.engine.stats()
    kvferry_stats = {k: stats[k] for k in ("stored_bytes", "store_seconds", "retrieved_bytes", "retrieve_seconds")}
    miss = statistics.median(r["miss_s"] for r in rows)
    hit = statistics.median(r["hit_s"] for r in rows)
    result = {
        "benchmark": "bench_vllm_ttft",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": __import__("vllm").__version__,
        "cpus": os.cpu_count(),
        "model": model_info,
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens,
        "chunk_size": args.chunk_size,
        "engine_start_s": engine_start_s,
        "ttft_miss_s": miss,
        "ttft_hit_s": hit,
        "speedup": miss / hit,
        "kvferry": kvferry_stats,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    table = Table(
        title=f"vLLM CPU TTFT, {args.prompt_tokens}-token prompt, {model_info['parameters'] / 1e6:.0f}M-param "
        f"random Llama ({args.layers} layers, {args.dtype}), kvferry embedded"
    )
    for column in ("prompt", "miss TTFT s", "hit TTFT s", "cached tokens (miss / hit)", "speed-up"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r["prompt"]),
            f"{r['miss_s']:.3f}",
            f"{r['hit_s']:.3f}",
            f"{r['miss_cached']} / {r['hit_cached']}",
            f"{r['miss_s'] / r['hit_s']:.1f}x",
        )
    table.add_row("median", f"{miss:.3f}", f"{hit:.3f}", "", f"{miss / hit:.1f}x")
    Console().print(table)
    loads = len(rows)
    print(
        f"kvferry: {kvferry_stats['retrieved_bytes'] / loads / 2**20:.1f} MiB loaded per hit in "
        f"{kvferry_stats['retrieve_seconds'] / loads * 1e3:.1f} ms; "
        f"{kvferry_stats['stored_bytes'] / loads / 2**20:.1f} MiB stored per miss in "
        f"{kvferry_stats['store_seconds'] / loads * 1e3:.1f} ms (in the background)"
    )
    print(f"wrote {args.out}")
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # vLLM's background threads can stall interpreter teardown


if __name__ == "__main__":
    main()
