"""`kvferry bench vllm-gpu`: the vLLM connector's worker side on a GPU, over KV in the views vLLM 0.32 builds.

The views are the recorded ones of `kvferry.bench.vllm_views` (llama3-8b with FlashAttention in two layouts, and
DeepSeek-V3's MLA latent with FlashMLA), replayed on the GPU and recognised by the connector's own code. Each mode
(embedded: the cache in this process; server: a ``kvferry server`` holding the pool, the KV registered by CUDA
IPC) stores a 16-chunk prefix from vLLM's blocks (a fresh prefix each time: every store copies) and loads it into
other blocks, as vLLM's model runner calls the worker side (a store after the forward pass, a foreground load before
it), timed from the call to the bytes in place, alternately with a pinned memcpy of the same bytes (medians). The
first load is checked byte for byte against the blocks it was stored from. Then a GEMM standing in for the model
runs while stores and loads of the same size loop beside it. With --steps, a stand-in model step is timed with and
without the store started after it (`kvferry.bench.vllm_gpu_steps`), in each mode.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch

from kvferry.bench.gpu_gemm import gemm_tflops
from kvferry.bench.harness import Outcome, Steps, add_json_argument, description_of, require_cuda
from kvferry.bench.report import new_table
from kvferry.bench.server_bench import ServerProcess
from kvferry.bench.timing import PinnedCopy
from kvferry.bench.vllm_gpu_steps import describe_steps, step_stall
from kvferry.bench.vllm_views import BENCH_CASES, Case, case_of, load_fixtures, replay
from kvferry.integrations.vllm.kv_layout import EngineKV, recognise
from kvferry.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.integrations.vllm.settings import ConnectorSettings
from kvferry.integrations.vllm.worker_backend import make_worker_backend
from kvferry.integrations.vllm.worker_side import WorkerSide

CHUNK, CHUNKS, POOL_GB = 256, 16, 4.0
DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench vllm-gpu                                  # on a machine with CUDA
  kvferry bench vllm-gpu --repeats 15 --json bench-out/vllm_gpu.json
  kvferry bench vllm-gpu --steps                          # also: do stores hold up a model step?
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=9, help="timed store/load pairs per case and mode (medians)")
    parser.add_argument("--no-server", action="store_true", help="embedded mode only")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM beside the transfers")
    parser.add_argument(
        "--steps", action="store_true", help="also time a stand-in model step with and without a store after it"
    )
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    require_cuda("this benchmark")


class Bench:
    """One recorded case on the GPU, one mode: a worker side, a source and a target block set, the ceiling."""

    def __init__(self, case: Case, fixture: dict[str, Any], settings: ConnectorSettings) -> None:
        self.case = case
        self.kv = _recognised(case, replay(fixture, "cuda")[1])
        self.backend = make_worker_backend(settings, self.kv, model=case.name, block_size=case.block_size, name="b")
        self.worker = WorkerSide(self.backend, block_size=case.block_size)
        per = CHUNK // case.block_size * CHUNKS
        self.src, self.dst = list(range(1, per + 1)), list(range(per + 1, 2 * per + 1))
        self.nbytes = sum(layer[0].numel() * layer.element_size() for layer in self.kv.layers) * per * self.kv.split
        self.copy = PinnedCopy(self.nbytes)
        self._prefixes = itertools.count()
        self.tokens = self.next_prefix()

    def next_prefix(self) -> list[int]:
        first = next(self._prefixes)
        return [first, *range(1, CHUNK * CHUNKS)]

    def store(self) -> float:
        """A new prefix stored from vLLM's blocks after the step's forward pass: seconds to done."""
        self.tokens = self.next_prefix()
        started = time.perf_counter()
        self.worker.start_stores(StepPlan(stores=[StoreSpec("s", self.tokens, self.src, 0)]))
        self.worker.preempted(["s"])  # waits for the store
        return time.perf_counter() - started

    def load(self) -> float:
        """The last stored prefix loaded into other blocks before a forward pass: seconds to done."""
        started = time.perf_counter()
        self.worker.start_loads(StepPlan(loads=[LoadSpec("l", self.tokens, self.dst, 0)]))
        seconds = time.perf_counter() - started
        if self.worker.take_load_errors():
            raise RuntimeError(f"{self.case.name}: a load came back short")
        return seconds

    def check_loaded(self) -> None:
        """The blocks the last load wrote hold the bytes of the blocks its prefix was stored from, in every layer."""
        src, dst = (torch.as_tensor(list(self.kv.kernel_block_ids(b)), device="cuda") for b in (self.src, self.dst))
        for layer in self.kv.layers:
            if not torch.equal(
                layer.index_select(0, src).view(torch.uint8), layer.index_select(0, dst).view(torch.uint8)
            ):
                raise RuntimeError(f"{self.case.name}: a load did not give back the stored bytes")

    def memcpy(self, to_host: bool) -> float:
        started = time.perf_counter()
        self.copy(to_host)
        return time.perf_counter() - started

    def close(self) -> None:
        self.worker.close()
        self.backend.close()


def _recognised(case: Case, views: dict[str, torch.Tensor]) -> EngineKV:
    return recognise(views, isa=None, kv_cache_dtype=case.cache_dtype, mla=case.mla, block_size=case.block_size)


def measure(bench: Bench, repeats: int) -> dict[str, Any]:
    """Store and load alternated with the memcpy of their bytes (after one warm-up of each)."""
    times: dict[str, list[float]] = {"store": [], "load": [], "d2h": [], "h2d": []}
    for i in range(repeats + 1):
        samples = (bench.store(), bench.memcpy(True), bench.load(), bench.memcpy(False))
        if not i:
            bench.check_loaded()  # the warm-up's load, byte for byte (outside the timed rounds)
        else:
            for name, seconds in zip(times, samples, strict=True):
                times[name].append(seconds)
    med = {name: statistics.median(s) for name, s in times.items()}
    gib = bench.nbytes / 2**30
    return {
        "mib": bench.nbytes / 2**20,
        "store_us": med["store"] * 1e6,
        "load_us": med["load"] * 1e6,
        "store_ratio": med["d2h"] / med["store"],
        "load_ratio": med["h2d"] / med["load"],
        "store_gbps": gib * 2**30 / med["store"] / 1e9,
        "load_gbps": gib * 2**30 / med["load"] / 1e9,
    }


def gemm_beside(bench: Bench) -> dict[str, float]:
    """The GEMM's TFLOP/s alone and while store + load pairs loop beside it (and the GB/s they moved then)."""

    def pair() -> int:
        bench.store()
        bench.load()
        return 2 * bench.nbytes

    alone, _ = gemm_tflops(None)
    beside, moved = gemm_tflops(pair)
    return {"alone_tflops": alone, "beside_tflops": beside, "gemm_ratio": beside / alone, "moved_gbps": moved}


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    fixtures = {case_of(f): f for f in load_fixtures()}
    modes = ["embedded"] if args.no_server else ["embedded", "server"]
    steps.expect(len(BENCH_CASES) * len(modes) + (0 if args.no_gemm else 1) + (len(modes) if args.steps else 0))
    rows: list[dict[str, Any]] = []
    gemm: dict[str, Any] | None = None
    stalls: dict[str, Any] = {}
    for mode in modes:
        server = ServerProcess(POOL_GB, chunk_size=CHUNK) if mode == "server" else None
        try:
            settings = _settings(mode, None if server is None else server.endpoint)
            for case in BENCH_CASES:
                bench = Bench(case, fixtures[case], settings)
                try:
                    rows.append({"mode": mode, "case": case.name, **measure(bench, args.repeats)})
                    steps.done(f"{mode}: {case.name}")
                    if mode == "embedded" and case is BENCH_CASES[0] and not args.no_gemm:
                        gemm = gemm_beside(bench)
                        steps.done("the GEMM beside stores and loads")
                    if case is BENCH_CASES[0] and args.steps:
                        stalls[mode] = step_stall(bench, args.repeats)
                        steps.done(f"{mode}: model steps with and without stores")
                finally:
                    bench.close()
        finally:
            if server is not None:
                server.stop()
    config = {"chunk_tokens": CHUNK, "chunks": CHUNKS, "repeats": args.repeats, "pool_gb": POOL_GB}
    shown = [*_show(rows, gemm), *(describe_steps(mode, s) for mode, s in stalls.items())]
    return Outcome(config, {"rows": rows, "gemm": gemm, "steps": stalls}, shown, device="cuda")


def _settings(mode: str, endpoint: str | None) -> ConnectorSettings:
    if mode == "server":
        return ConnectorSettings(mode="server", server_url=str(endpoint), timeout_s=30.0)
    return ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": CHUNK, "l1_size_gb": POOL_GB}})


def _show(rows: list[dict[str, Any]], gemm: dict[str, Any] | None) -> list[Any]:
    table = new_table(
        f"a {CHUNKS}-chunk prefix through the vLLM connector's worker side, against a same-run pinned memcpy",
        ("mode", "vLLM KV", "MiB", "store us", "ratio", "GB/s", "load us", "ratio", "GB/s"),
        names=2,
    )
    for r in rows:
        table.add_row(
            r["mode"],
            r["case"],
            f"{r['mib']:.0f}",
            f"{r['store_us']:.0f}",
            f"{r['store_ratio']:.3f}",
            f"{r['store_gbps']:.1f}",
            f"{r['load_us']:.0f}",
            f"{r['load_ratio']:.3f}",
            f"{r['load_gbps']:.1f}",
        )
    shown: list[Any] = [table]
    if gemm is not None:
        shown.append(
            f"bf16 GEMM alone {gemm['alone_tflops']:.0f} TFLOP/s, beside stores and loads {gemm['beside_tflops']:.0f}"
            f" ({gemm['gemm_ratio']:.3f}) while they moved {gemm['moved_gbps']:.1f} GB/s"
        )
    return shown
