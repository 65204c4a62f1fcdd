"""`kvferry bench vllm-gpu`: the vLLM connector's worker side on a GPU, over KV in the views vLLM 0.32 builds, beside
vLLM's own page DMA and a plain memcpy of the same bytes.

The views are the recorded ones of `kvferry.bench.vllm_views` (llama3-8b with FlashAttention in the layouts LBHNC, LBNHC
and BLHNC, and DeepSeek-V3's MLA latent with FlashMLA), replayed on the GPU and recognised by the connector's own code.
Each mode (embedded: the cache in this process; server: a ``kvferry server`` holding the pool, the KV registered by CUDA
IPC, reached over loopback TCP and over its Unix socket; server direct: its pool shared, the stores and loads copied in
this process, `kvferry.connector.direct_stores` and `direct_loads`) stores a 16-chunk prefix from blocks scattered over
the cache and loads it into other scattered blocks, as vLLM's model runner calls the worker side (a store after the
forward pass, a foreground load before it), each timed from the call to the bytes in place
(`kvferry.bench.vllm_connector_path`). In the same rounds vLLM's own CPU offload moves the same bytes, a page per
descriptor of one ``cuMemcpyBatchAsync`` to and from pinned memory (`kvferry.bench.vllm_page_dma`), and a pinned memcpy
moves them as one copy each way. Every sample is recorded under its operation's name where it is timed
(`kvferry.bench.samples`); a ratio is the memcpy's median time over the path's (1.0: as fast as one plain copy).

Every round uses a fresh prefix and new bytes in the source blocks, and every load of the timed rounds (and of the
warm-up) is checked outside its timed region: the whole prefix loaded, each destination block (random bytes before the
load) holding its source block's bytes in every layer, and every other byte of the KV unchanged
(`kvferry.bench.block_check`). Stores are checked through the loads that follow them. A failed check ends the run with
an error (exit status 1). Then a GEMM standing in for the model runs while stores and loads of the same size loop beside
it (each load's token count checked). With --steps, a stand-in model step is timed with and without the store started
after it (`kvferry.bench.vllm_gpu_steps`), in each mode.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from kvferry.bench.gpu_gemm import gemm_tflops
from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive, require_cuda
from kvferry.bench.report import cell, new_table
from kvferry.bench.rounds import measure, stray_ceilings
from kvferry.bench.server_process import ServerProcess, add_busy_poll_argument, check_busy_poll, mps_line
from kvferry.bench.timing import PinnedCopy, synchronize, wake_up_line, wake_up_us
from kvferry.bench.vllm_connector_path import CHUNK, CHUNKS, ConnectorPath
from kvferry.bench.vllm_gpu_steps import describe_steps, step_stall
from kvferry.bench.vllm_page_dma import PageDMA
from kvferry.bench.vllm_views import BENCH_CASES, case_of, load_fixtures
from kvferry.client import KvferryClient
from kvferry.connector.settings import ConnectorSettings
from kvferry.cuda.driver import driver
from kvferry.cuda.vmm_alloc import DriverMappedSegments

POOL_GB = 4.0
# server: over loopback TCP, over its Unix socket (`--ipc`), and with its pool shared: stores and loads copied here
MODES = ["embedded", "server tcp", "server ipc", "server direct"]
DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench vllm-gpu                                  # on a machine with CUDA
  kvferry bench vllm-gpu --repeats 15 --json bench-out/vllm_gpu.json
  kvferry bench vllm-gpu --steps                          # also: do stores hold up a model step?
  kvferry bench vllm-gpu --vmm                            # vLLM 0.34's extensible (driver-mapped) KV cache
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed rounds per case and mode (medians), after a warm-up round"
    )
    parser.add_argument("--no-server", action="store_true", help="embedded mode only")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM beside the transfers")
    parser.add_argument(
        "--steps", action="store_true", help="also time a stand-in model step with and without a store after it"
    )
    parser.add_argument(
        "--vmm",
        action="store_true",
        help="the KV in driver-mapped memory, as vLLM 0.34's extensible KV cache allocates it (cuMemCreate with the "
        "POSIX-fd handle type, mapped into a reserved range; one allocation, as for a block-outermost layout): the "
        "server maps it by file descriptor over its Unix socket",
    )
    add_busy_poll_argument(parser)
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    check_busy_poll(args)
    positive(args, "repeats")
    require_cuda("this benchmark")


def gemm_beside(path: ConnectorPath) -> dict[str, float]:
    """The GEMM's TFLOP/s alone and while store + load pairs loop beside it (and the GB/s they moved then)."""

    def pair() -> int:
        path.tokens = path.next_prefix()  # every store copies (the source bytes stay: nothing beside the GEMM)
        path.store()
        path.look_up()
        path.load()
        path.check_tokens()
        return 2 * path.nbytes

    alone, _ = gemm_tflops(None)
    beside, moved = gemm_tflops(pair)
    return {"alone_tflops": alone, "beside_tflops": beside, "gemm_ratio": beside / alone, "moved_gbps": moved}


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    fixtures = {case_of(f): f for f in load_fixtures()}
    # Descriptors of driver-mapped memory reach the server over its Unix socket only (`--vmm`: no TCP row).
    modes = ["embedded"] if args.no_server else [m for m in MODES if not (args.vmm and m == "server tcp")]
    steps.expect(len(BENCH_CASES) * len(modes) + (0 if args.no_gemm else 1) + (len(modes) if args.steps else 0))
    rows: list[dict[str, Any]] = []
    gemm: dict[str, Any] | None = None
    stalls: dict[str, Any] = {}
    wake = wake_up_us()  # before any server: nothing else running
    for mode in modes:
        ipc = tempfile.TemporaryDirectory(prefix="kvferry-bench-") if mode in ("server ipc", "server direct") else None
        ipc_path = None if ipc is None else f"{ipc.name}/server.sock"
        server = None
        if mode != "embedded":
            shared = mode == "server direct"
            server = ServerProcess(POOL_GB, args.busy_poll_us, ipc_path, chunk_size=CHUNK, shared_pool=shared)
        try:
            settings = _settings(mode, None if server is None else server.endpoint)
            for case in BENCH_CASES:
                path = ConnectorPath(case, fixtures[case], settings, allocate=_driver_mapped if args.vmm else None)
                try:
                    rows.append({"mode": mode, "case": case.name, **measure_case(path, args.repeats)})
                    steps.done(f"{mode}: {case.name}")
                    if mode == "embedded" and case is BENCH_CASES[0] and not args.no_gemm:
                        gemm = gemm_beside(path)
                        steps.done("the GEMM beside stores and loads")
                    if case is BENCH_CASES[0] and args.steps:
                        stalls[mode] = step_stall(path, args.repeats)
                        steps.done(f"{mode}: model steps with and without stores")
                finally:
                    path.close()
            if server is not None and mode == "server direct":
                with KvferryClient(server.tcp_endpoint) as client:
                    check_direct(client.stats()["cache"], len(BENCH_CASES))
        finally:
            if server is not None:
                server.stop()
            if ipc is not None:
                ipc.cleanup()
    config = {
        "chunk_tokens": CHUNK,
        "chunks": CHUNKS,
        "repeats": args.repeats,
        "pool_gb": POOL_GB,
        "vmm": args.vmm,
        "busy_poll_us": args.busy_poll_us,
    }
    strayed = stray_ceilings(rows, lambda row: f"{row['mode']} {row['case']}")
    shown = [
        *_show(rows, gemm),
        *strayed,
        *(describe_steps(mode, s) for mode, s in stalls.items()),
        wake_up_line(wake, busy_poll_us=args.busy_poll_us),
        mps_line(),
    ]
    results = {"rows": rows, "gemm": gemm, "steps": stalls, "wake_up_us": wake}
    return Outcome(config, results, shown, device="cuda")


def measure_case(path: ConnectorPath, repeats: int) -> dict[str, Any]:
    """`measure` with a pinned memcpy of the path's bytes and vLLM's page DMA of the same blocks (where the driver
    has its batched copy)."""
    dma = PageDMA(path.kv, path.src, path.dst, path.check, path.case.name) if driver().has_batch else None
    if dma is not None and dma.nbytes != path.nbytes:
        raise BenchError(f"{path.case.name}: vLLM's pages hold {dma.nbytes} bytes, the connector moves {path.nbytes}")
    copy = PinnedCopy(path.nbytes)
    pages: dict[str, Any] = {"vllm_dma_pages": None, "vllm_dma_page_kib": None}
    if dma is not None:
        pages = {"vllm_dma_pages": dma.pages, "vllm_dma_page_kib": dma.nbytes / dma.pages / 1024}
    return {**measure(path, copy, dma, repeats, settle=synchronize), **pages}


def _driver_mapped(nbytes: int) -> Any:
    """`nbytes` (or more: whole granules) of driver-mapped memory on the current device, as a uint8 tensor that
    frees it once garbage."""
    import torch

    return DriverMappedSegments([nbytes], torch.cuda.current_device()).tensor()


def check_direct(cache: dict[str, Any], cases: int) -> None:
    """The direct mode's transfers were copied here: its server's cache (``cache``: STATS) located objects and ran
    no RETRIEVE, and adopted every store but each case's first (a STORE: nothing was reserved yet)."""
    if not cache["located_chunks"] or cache["retrieves"]:
        raise BenchError(
            f"server direct: {cache['located_chunks']} chunks located, {cache['retrieves']} RETRIEVEs: the loads "
            "did not all go direct"
        )
    if not cache["adopted_stores"] or cache["stores"] - cache["adopted_stores"] > cases:
        raise BenchError(
            f"server direct: {cache['adopted_stores']} of {cache['stores']} stores copied here: the stores did not "
            "go direct"
        )


def _settings(mode: str, endpoint: str | None) -> ConnectorSettings:
    if mode != "embedded":
        direct = mode == "server direct"
        return ConnectorSettings(
            mode="server", server_url=str(endpoint), timeout_s=30.0, direct_loads=direct, direct_stores=direct
        )
    return ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": CHUNK, "l1_size_gb": POOL_GB}})


def _show(rows: list[dict[str, Any]], gemm: dict[str, Any] | None) -> list[Any]:
    table = new_table(
        f"a {CHUNKS}-chunk prefix through the vLLM connector's worker side and by vLLM's page DMA, against a same-run"
        " pinned memcpy (ratio: the memcpy's time over the transfer's; every load checked)",
        ("mode", "vLLM KV", "MiB", "store us", "ratio", "GB/s", "load us", "ratio", "GB/s", "vLLM pages",
         "page DMA store ratio", "load ratio"),
        names=2,
    )  # fmt: skip
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
            "" if r["vllm_dma_pages"] is None else f"{r['vllm_dma_pages']} x {r['vllm_dma_page_kib']:.0f} KiB",
            cell(r["vllm_dma_store_ratio"], ".3f"),
            cell(r["vllm_dma_load_ratio"], ".3f"),
        )
    shown: list[Any] = [table]
    if any(r["vllm_dma_pages"] is None for r in rows):
        shown.append("vLLM page DMA: not run (this CUDA driver has no cuMemcpyBatchAsync, CUDA 12.8+)")
    if gemm is not None:
        shown.append(
            f"bf16 GEMM alone {gemm['alone_tflops']:.0f} TFLOP/s, beside stores and loads {gemm['beside_tflops']:.0f}"
            f" ({gemm['gemm_ratio']:.3f}) while they moved {gemm['moved_gbps']:.1f} GB/s"
        )
    return shown
