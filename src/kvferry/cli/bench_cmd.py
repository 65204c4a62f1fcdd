"""`kvferry bench NAME`: the benchmarks a user runs, each a module of `kvferry.bench`.

Only the chosen benchmark's module is imported (and its flags attached): `kvferry --help` and `kvferry bench --help`
import none of them, and a benchmark's `--help` works without CUDA or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from rich.console import Console


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str  # in kvferry.bench: add_arguments, check, run, DESCRIPTION, EXAMPLES
    help: str
    runs_on: str  # where it runs: CPU, GPU, or both; "vLLM" where it needs the vllm extra


BENCHMARKS = (
    Benchmark("transfer", "transfer_bench", "engine KV blocks <-> chunk objects (kvferry.transfer)", "CPU/GPU"),
    Benchmark("cache", "cache_bench", "CacheEngine lookup time and bookkeeping per chunk", "CPU"),
    Benchmark("pool", "pool_bench", "HostPool alloc/free operations per second", "CPU"),
    Benchmark("tiers", "tiers_bench", "disk and Redis tiers against plain I/O of the same bytes", "CPU"),
    Benchmark("server", "server_bench", "kvferry server over loopback: request rate and latency", "CPU/GPU"),
    Benchmark("server-engines", "server_engines_bench", "several engine processes on one server at once", "CPU/GPU"),
    Benchmark("gpu-transfer", "gpu_transfer_bench", "the GPU data path section by section", "GPU"),
    Benchmark("cache-gpu", "cache_gpu_bench", "one chunk through CacheEngine on a GPU engine", "GPU"),
    Benchmark("vllm-gpu", "vllm_gpu_bench", "the vLLM connector on a GPU, in the views vLLM builds", "GPU"),
    Benchmark("sglang-gpu", "sglang_gpu_bench", "the SGLang linker on a GPU, in the pools SGLang builds", "GPU"),
    Benchmark("sglang-host", "sglang_host_bench", "the SGLang HiCache backend's pages against a host memcpy", "CPU"),
    Benchmark("codec", "codec_bench", "fp8 objects' store and retrieve against bf16 and the link", "GPU"),
    Benchmark("codec-accuracy", "codec_accuracy", "fp8 objects' error on heavy-tailed KV, per scale layout", "CPU"),
    Benchmark("vllm-ttft", "vllm_ttft_bench", "vLLM time to first token with and without a kvferry hit", "CPU, vLLM"),
    Benchmark("vllm-async-load", "vllm_async_load_bench", "vLLM step time while a prefix loads", "CPU, vLLM"),
    Benchmark("vllm-batch", "vllm_batch_bench", "what stores cost a busy vLLM, nothing to hit", "CPU, vLLM"),
    Benchmark("vllm-chat", "vllm_chat_bench", "multi-turn conversations' TTFT with and without kvferry", "CPU, vLLM"),
    Benchmark("codec-greedy", "codec_greedy", "greedy tokens with fp8 prefixes loaded against computed", "CPU, vLLM"),
)

BENCH_EXAMPLES = """\
examples:
  kvferry bench transfer --help
  kvferry bench cache --repeats 30
  kvferry bench server --json bench-out/server.json
  kvferry bench gpu-transfer --sections bulk,onechunk     # on a machine with CUDA
"""


def add_bench_parser(
    commands: argparse._SubParsersAction,
    chosen: str | None,
    formatter: type[argparse.HelpFormatter],
) -> None:
    """`kvferry bench` and one subparser per benchmark; only `chosen`'s module is imported, for its flags."""
    bench = commands.add_parser(
        "bench",
        help="measure kvferry against same-run ceilings (copies, plain I/O, ZMQ)",
        description=_wrap(
            "Benchmarks of kvferry, each reported against a ceiling measured in the same run: a plain copy of the "
            "same bytes, plain I/O to the same filesystem or Redis, a bare ZMQ round trip. Each shows a progress "
            "bar while it runs and a table at the end; --json PATH also writes the results, the machine and the "
            "exact command."
        ),
        epilog=BENCH_EXAMPLES,
        formatter_class=formatter,
    )
    benches = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    for b in BENCHMARKS:
        sub = benches.add_parser(b.name, help=f"{b.help} [{b.runs_on}]", formatter_class=formatter)
        if b.name != chosen:
            continue
        module = importlib.import_module(f"kvferry.bench.{b.module}")
        sub.description = module.DESCRIPTION
        sub.epilog = module.EXAMPLES
        module.add_arguments(sub)
        sub.set_defaults(run=_runner(b, module))


def _runner(b: Benchmark, module: ModuleType) -> Callable[[argparse.Namespace, list[str], Console], int]:
    from kvferry.bench.harness import run_and_report

    def run(args: argparse.Namespace, argv: list[str], console: Console) -> int:
        return run_and_report(b.name, module, args, ["kvferry", *argv], console)

    return run


def chosen_benchmark(argv: list[str]) -> str | None:
    """The benchmark named on a `kvferry bench NAME ...` command line (the first word after `bench`)."""
    words = [a for a in argv if not a.startswith("-")]
    return words[1] if len(words) > 1 and words[0] == "bench" else None


def _wrap(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=100)
