"""`kvferry bench vllm-ttft`: time to first token on vLLM's CPU backend with and without a kvferry prefix hit, in
one engine, same run.

Needs the vllm extra. Writes a random-weight Llama (no download) of the given size to a temp dir and starts one
vLLM engine with KvferryConnector and vLLM's own prefix cache off (in a process of its own); the cache is embedded
in vLLM's process, or with --server in a `kvferry server` it reaches over the server's Unix socket. For each of
--prompts distinct random prompts: a first request (kvferry misses, computes the whole prompt and stores its full
chunks), then the same prompt again (kvferry loads every full chunk; vLLM computes only the tail). TTFT is the
wall time of a `generate` with `max_tokens=1` (prefill plus one sampled token). Reported: medians over the
prompts, the hit's speed-up, and the tokens vLLM reported as cached. Several prompt lengths
(`--prompt-tokens 1024,2048,4096`) draw TTFT with and without a hit against the prompt's length (`--plot PATH`).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvferry.bench.harness import (
    BenchError,
    Outcome,
    Steps,
    add_json_argument,
    description_of,
    int_list,
    positive,
    require_vllm,
)
from kvferry.bench.plot import Chart, Series, add_plot_argument
from kvferry.bench.report import new_table
from kvferry.bench.server_process import ServerProcess
from kvferry.bench.vllm_child import VOCAB, connector_config, engine_env, llama_shape, run_child, write_shaped_llama

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench vllm-ttft                                  # 3000-token prompts, a 57M-parameter model, fp32
  kvferry bench vllm-ttft --prompt-tokens 4096 --prompts 5 --json bench-out/vllm_ttft.json
  kvferry bench vllm-ttft --layers 16 --hidden 1024 --dtype bfloat16
  kvferry bench vllm-ttft --prompt-tokens 1024,2048,4096 --plot bench-out/vllm_ttft.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-tokens",
        type=int_list,
        default=[3000],
        metavar="N[,N...]",
        help="tokens per prompt; a comma-separated list measures each length (default: 3000)",
    )
    parser.add_argument(
        "--prompts", type=int, default=3, help="distinct prompts, each a miss, then a hit (default: %(default)s)"
    )
    parser.add_argument("--layers", type=int, default=8, help="the model's layers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=512, help="model width, a multiple of 256 (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvferry's chunk, in tokens (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="float32 by default: CPUs without AVX-512 BF16 run bf16 matmuls slowly",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="the cache in a kvferry server process (the connector's server mode, over the server's Unix socket) "
        "instead of in vLLM's",
    )
    parser.add_argument(
        "--foreground-loads",
        action="store_true",
        help="the connector's async_load off: a hit loads before the forward pass of the step that schedules it",
    )
    add_json_argument(parser)
    add_plot_argument(parser, "TTFT with and without a hit against the prompt's length")


def check(args: argparse.Namespace) -> None:
    positive(args, "prompts", "layers", "hidden", "chunk_size")
    if min(args.prompt_tokens) < 1:
        raise BenchError(f"--prompt-tokens must be at least 1, got {min(args.prompt_tokens)}")
    llama_shape(args.layers, args.hidden)  # a width it cannot make is refused here
    require_vllm()


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(3 + 2 * args.prompts * len(args.prompt_tokens))
    model: dict[str, Any] = dict(llama_shape(args.layers, args.hidden))
    workdir = Path(tempfile.mkdtemp(prefix="kvferry-ttft-"))
    try:
        payload = {"model_dir": str(workdir / "model"), "model": model}
        names = ("dtype", "prompt_tokens", "prompts", "chunk_size", "foreground_loads")
        payload |= {name: getattr(args, name) for name in names}
        server = None
        if args.server:
            server = ServerProcess(pool_gb=2, ipc_path=str(workdir / "kvferry.sock"), chunk_size=args.chunk_size)
            payload["server_url"] = server.endpoint
        try:
            measured = run_child("kvferry.bench.vllm_ttft_bench:measure", payload, engine_env(), steps)
        finally:
            if server is not None:
                server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    model |= {"head_dim": 64, "parameters": measured["parameters"]}
    rows = measured["rows"]
    by_length = [_medians(length, [r for r in rows if r["prompt_tokens"] == length]) for length in args.prompt_tokens]
    results = {
        "engine_start_s": measured["engine_start_s"],
        **by_length[-1],  # the headline: the last length asked for
        "by_length": by_length,
        "kvferry": measured["kvferry"],
        "rows": rows,
    }
    config = {"model": model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "prompts": args.prompts}
    config |= {
        "chunk_size": args.chunk_size,
        "loads": "foreground" if args.foreground_loads else "background",
        "cache": "server" if args.server else "embedded",
    }
    return Outcome(config, results, _show(args, model, results), chart=_chart(args, model, by_length))


def _medians(length: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    miss = statistics.median(r["miss_s"] for r in rows)
    hit = statistics.median(r["hit_s"] for r in rows)
    return {"prompt_tokens": length, "ttft_miss_s": miss, "ttft_hit_s": hit, "speedup": miss / hit}


def _setup(args: argparse.Namespace, model: dict[str, Any]) -> str:
    return (
        f"{model['parameters'] / 1e6:.0f}M-param random Llama ({args.layers} layers, {args.dtype}), kvferry "
        f"{'server' if args.server else 'embedded'}, {'foreground' if args.foreground_loads else 'background'} loads"
    )


def _chart(args: argparse.Namespace, model: dict[str, Any], by_length: list[dict[str, Any]]) -> Chart:
    lengths = [float(m["prompt_tokens"]) for m in by_length]
    series = [
        Series("without a hit", lengths, [m["ttft_miss_s"] for m in by_length]),
        Series("with a kvferry hit", lengths, [m["ttft_hit_s"] for m in by_length]),
    ]
    title = f"vLLM CPU time to first token, median of {args.prompts}\n{_setup(args, model)}"
    return Chart(title, "prompt tokens", "TTFT s", series)


def _show(args: argparse.Namespace, model: dict[str, Any], results: dict[str, Any]) -> list[Any]:
    rows = results["rows"]
    table = new_table(
        f"vLLM CPU TTFT, {_setup(args, model)}",
        ("prompt", "tokens", "miss TTFT s", "hit TTFT s", "cached tokens (miss / hit)", "speed-up"),
    )
    for r in rows:
        table.add_row(
            str(r["prompt"]),
            str(r["prompt_tokens"]),
            f"{r['miss_s']:.3f}",
            f"{r['hit_s']:.3f}",
            f"{r['miss_cached']} / {r['hit_cached']}",
            f"{r['miss_s'] / r['hit_s']:.1f}x",
        )
    for m in results["by_length"]:
        miss, hit = m["ttft_miss_s"], m["ttft_hit_s"]
        table.add_row("median", str(m["prompt_tokens"]), f"{miss:.3f}", f"{hit:.3f}", "", f"{m['speedup']:.1f}x")
    stats, loads = results["kvferry"], len(rows)
    line = (
        f"kvferry: {stats['retrieved_bytes'] / loads / 2**20:.1f} MiB loaded per hit in "
        f"{stats['retrieve_seconds'] / loads * 1e3:.1f} ms ({stats['worker_load_seconds'] * 1e3:.1f} ms as vLLM's "
        "worker saw it); "
        f"{stats['stored_bytes'] / loads / 2**20:.1f} MiB stored per miss in "
        f"{stats['store_seconds'] / loads * 1e3:.1f} ms (in the background)"
    )
    return [table, line]


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return time.perf_counter() - started, int(out.num_cached_tokens or 0)


def measure(payload: dict[str, Any], step: Callable[[str], None]) -> dict[str, Any]:
    """In the engine's process (see `vllm_child`): write the model, start vLLM with kvferry embedded, then time
    misses and hits."""
    shape = payload["model"]
    parameters = write_shaped_llama(Path(payload["model_dir"]), shape, payload["dtype"])
    step("model written")

    import vllm
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvferry.connector import backends
    from kvferry.connector.server_backend import ServerBackend
    from kvferry.integrations.vllm.connector import KvferryConnector

    lengths = payload["prompt_tokens"]
    longest = max(lengths)
    url = payload.get("server_url")
    cache: dict[str, Any] = {"config": {"cache": {"chunk_size": payload["chunk_size"], "l1_size_gb": 2}}}
    if url:
        cache = {"mode": "server", "server_url": url}
    started = time.perf_counter()
    llm = vllm.LLM(
        model=payload["model_dir"],
        skip_tokenizer_init=True,
        dtype=payload["dtype"],
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=longest + 16,
        max_num_batched_tokens=longest + 16,  # the whole prompt in one prefill step
        kv_transfer_config=connector_config(async_load=not payload["foreground_loads"], **cache),
    )
    engine_start_s = time.perf_counter() - started
    step("vLLM engine started")
    rng = random.Random(0)
    _ttft(llm, [rng.randrange(VOCAB) for _ in range(64)])  # warm-up: first-call costs out of the numbers
    step("warm-up")
    rows = []
    for length in lengths:
        for i in range(payload["prompts"]):
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
            miss_s, miss_cached = _ttft(llm, prompt)
            step(f"{length} tokens, prompt {i + 1}: miss")
            time.sleep(0.5)  # let the miss's asynchronous store finish: a hit needs the chunks committed
            hit_s, hit_cached = _ttft(llm, prompt)
            step(f"{length} tokens, prompt {i + 1}: hit")
            row = {"prompt": i, "prompt_tokens": length, "miss_s": miss_s, "hit_s": hit_s}
            rows.append(row | {"miss_cached": miss_cached, "hit_cached": hit_cached})
    transfer_config = llm.llm_engine.vllm_config.kv_transfer_config
    assert transfer_config is not None  # the LLM above was made with the kvferry connector
    backend = backends.find(str(transfer_config.engine_id))
    if isinstance(backend, backends.EmbeddedBackend):
        stats = backend.engine.stats()
    elif isinstance(backend, ServerBackend):
        stats = backend.link.call(lambda client, _: client.stats())["cache"]  # the server's copies
    else:
        raise RuntimeError("the connector did not register the KV cache")
    kvferry_stats = {k: stats[k] for k in ("stored_bytes", "store_seconds", "retrieved_bytes", "retrieve_seconds")}
    connector = get_kv_transfer_group()
    worker = connector.worker_counters if isinstance(connector, KvferryConnector) else None
    assert worker is not None  # configured so, in-process: the loads as vLLM's worker saw them, call to result
    kvferry_stats["worker_load_seconds"] = worker.load_seconds / max(1, worker.loads)
    llm.llm_engine.engine_core.shutdown()
    return {
        "parameters": parameters,
        "engine_start_s": engine_start_s,
        "kvferry": kvferry_stats,
        "rows": rows,
    }
