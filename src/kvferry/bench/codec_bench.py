"""`kvferry bench codec`: the fp8 object codec on a GPU against the bf16 path and the link.

Per model and request size (--chunks, default 16 and 1): the wall time of a store and of a retrieve (call to completion,
median) with the fp8 codec and without it, and of a pinned memcpy of the bf16 bytes and of the bytes the codec
moves. `vs bf16 memcpy` counts the bf16 bytes the engine holds (what the issue's 1.8x is about); `link` counts the
bytes moved. Every timed store and retrieve, fp8 and bf16, is checked byte for byte against the torch backend on the
GPU: before each call what it writes is filled with random bytes, after it the objects (a store) or the engine's
tensors (a retrieve) must equal the torch backend's store of the same blocks or retrieve of the same objects
(`codec_checks`); a mismatch fails the run. Then a bf16 8192^3 GEMM beside a loop of 16-chunk stores and retrieves
(fp8, then bf16; not checked), against the mean of the GEMM alone before and after (--no-gemm: none). --sweep
first tries the codec kernel's tile sizes, groups per step and warps and keeps the fastest.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import RenderableType

from kvferry import Direction
from kvferry.bench.codec_checks import RetrieveCheck, StoreCheck
from kvferry.bench.gpu_gemm import gemm_tflops
from kvferry.bench.harness import (
    BenchError,
    Outcome,
    Steps,
    add_json_argument,
    description_of,
    int_list,
    positive,
    require_cuda,
)
from kvferry.bench.report import cell, new_table
from kvferry.bench.timing import PinnedCopy, median_us
from kvferry.formats import EngineKVFormat, KVGeometry, describe, with_codec
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.kernels import triton_tiling
from kvferry.transfer import forget_plans, transfer, transfer_async
from kvferry.transfer.gpu_engine import TransferEngine

F = EngineKVFormat
SHAPES = {"llama3-8b": (F.NL_X_TWO_NB_BS_NH_HS, 16), "deepseek-v3-mla": (F.NL_X_NB_BS_HS, 64)}
SWEEP = ((4096, 8, 4), (4096, 1, 4), (2048, 8, 4), (8192, 8, 8))  # codec tile values, groups per step, warps

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench codec                                     # on a machine with CUDA
  kvferry bench codec --sweep --json bench-out/codec.json
  kvferry bench codec --chunks 1 --models llama3-8b --no-gemm
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case; medians (default: 20)")
    parser.add_argument(
        "--chunks", type=int_list, default=[16, 1], help="request sizes in 256-token chunks (default: 16,1)"
    )
    parser.add_argument(
        "--models", default=",".join(SHAPES), help=f"models, comma-separated, of: {', '.join(SHAPES)} (default: both)"
    )
    parser.add_argument("--gemm-seconds", type=float, default=1.0, help="per GEMM measurement (default: 1.0)")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM beside the transfers")
    parser.add_argument(
        "--sweep", action="store_true", help="first try codec tile sizes, groups per step and warps; keep the best"
    )
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "repeats")
    unknown = sorted(set(args.models.split(",")) - set(SHAPES))
    if unknown:
        raise BenchError(f"--models: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if not args.chunks or min(args.chunks) < 1:
        raise BenchError(f"--chunks must be whole numbers of at least 1, got {args.chunks}")
    if args.gemm_seconds <= 0:
        raise BenchError(f"--gemm-seconds must be above 0, got {args.gemm_seconds}")
    require_cuda("this benchmark")


def _setup(model: str, chunks: int) -> tuple:
    fmt, bs = SHAPES[model]
    per = 256 // bs
    paged = make_paged(fmt, MODELS[model], max(64, 2 * chunks * per), bs, torch.bfloat16, "cuda")
    plain = describe(fmt, paged)
    ids = torch.randperm(max(64, 2 * chunks * per))[: chunks * per]
    return fmt, paged, plain, with_codec(plain, "fp8"), ids


def transfer_rows(model: str, chunks: int, repeats: int) -> list[dict[str, object]]:
    fmt, paged, plain, coded, ids = _setup(model, chunks)
    engine = TransferEngine("cuda")
    rows = []
    bf16_bytes = plain.bytes_per_token * 256 * chunks
    fp8_bytes = coded.bytes_per_token * 256 * chunks
    copy_bf16, copy_fp8 = PinnedCopy(bf16_bytes), PinnedCopy(fp8_bytes)
    for name, geom in (("bf16", plain), ("fp8", coded)):
        objs = torch.empty((chunks, *geom.object_shape(256)), dtype=geom.object_dtype, pin_memory=True)
        for d in (Direction.D2H, Direction.H2D):

            def call(d: Direction = d, geom: KVGeometry = geom, objs: torch.Tensor = objs) -> None:
                transfer_async(paged, objs, ids, d, fmt, geometry=geom, engine=engine).wait()

            for _ in range(3):
                call()
            to_host = d is Direction.D2H
            what = f"{model}, {chunks} chunks, {name} {'store' if to_host else 'retrieve'}"
            checks = (StoreCheck if to_host else RetrieveCheck)(what, fmt, paged, geom, objs, ids)
            us = median_us(call, repeats, setup=checks.setup)
            checks.last()
            moved = copy_fp8 if name == "fp8" else copy_bf16
            memcpy_bf16 = median_us(lambda c=copy_bf16, t=to_host: c(t), repeats)  # type: ignore[misc]
            memcpy_moved = median_us(lambda c=moved, t=to_host: c(t), repeats)  # type: ignore[misc]
            nbytes = fp8_bytes if name == "fp8" else bf16_bytes
            rows.append(
                {
                    "model": model,
                    "chunks": chunks,
                    "codec": name,
                    "direction": d.name,
                    "us": round(us, 1),
                    "vs_bf16_memcpy": round(memcpy_bf16 / us, 3),
                    "link": round(memcpy_moved / us, 3),
                    "mib_moved": round(nbytes / 2**20, 1),
                    "vs_torch": f"equal, {checks.calls} calls",  # every timed call (a mismatch raised)
                }
            )
    forget_plans(coded)  # a later request of new tensors at these addresses compiles anew (`sweep`)
    forget_plans(plain)
    return rows


def kernel_gbps(model: str, repeats: int) -> dict[str, float]:
    """The codec kernel alone, GPU memory to GPU memory (bf16 GB/s read or written), for 16 chunks."""
    fmt, paged, plain, coded, ids = _setup(model, 16)
    objs = torch.empty((16, *coded.object_shape(256)), dtype=torch.uint8, device="cuda")
    nbytes = plain.bytes_per_token * 256 * 16
    out = {}
    for d in (Direction.D2H, Direction.H2D):

        def call(d: Direction = d) -> None:
            transfer(paged, objs, ids, d, fmt, geometry=coded)

        call()  # compile
        out[d.name] = round(nbytes / median_us(call, repeats) / 1e3, 1)
    forget_plans(coded)
    return out


def sweep(repeats: int, steps: Steps) -> list[dict[str, object]]:
    """Codec tile sizes, groups per step and warps: kernel alone and 16 llama3-8b chunks through the pipeline; keeps
    the fastest (for the rest of the run) and returns each one's figures."""
    tried, best_us = [], float("inf")
    best = (triton_tiling.CODEC_TILE_VALUES, triton_tiling.CODEC_GROUPS_PER_STEP, triton_tiling.CODEC_WARPS)
    for values, groups, warps in SWEEP:
        triton_tiling.CODEC_TILE_VALUES, triton_tiling.CODEC_GROUPS_PER_STEP = values, groups
        triton_tiling.CODEC_WARPS = warps
        rows = [r for r in transfer_rows("llama3-8b", 16, repeats) if r["codec"] == "fp8"]
        total = sum(float(str(r["us"])) for r in rows)
        kernel = {m: kernel_gbps(m, repeats) for m in SHAPES}
        pipeline = {str(r["direction"]): (r["vs_bf16_memcpy"], r["link"]) for r in rows}
        tried.append(
            {"tile_values": values, "groups": groups, "warps": warps, "kernel_gbps": kernel, "llama3-8b_16": pipeline}
        )
        if total < best_us:
            best, best_us = (values, groups, warps), total
        steps.done(f"sweep: {values} values, {groups} groups per step, {warps} warps")
    triton_tiling.CODEC_TILE_VALUES, triton_tiling.CODEC_GROUPS_PER_STEP, triton_tiling.CODEC_WARPS = best
    return tried


def gemm_row(codec: str, seconds: float) -> dict[str, object]:
    fmt, paged, plain, coded, ids = _setup("llama3-8b", 16)
    geom = coded if codec == "fp8" else plain
    engine = TransferEngine("cuda")
    objs = torch.empty((16, *geom.object_shape(256)), dtype=geom.object_dtype, pin_memory=True)
    nbytes = geom.bytes_per_token * 256 * 16

    def both() -> int:
        for d in (Direction.D2H, Direction.H2D):
            transfer_async(paged, objs, ids, d, fmt, geometry=geom, engine=engine).wait()
        return 2 * nbytes

    gemm_tflops(seconds=3.0)  # warm the card up
    before, _ = gemm_tflops(seconds=seconds)
    beside, gbps = gemm_tflops(both, seconds=seconds)
    after, _ = gemm_tflops(seconds=seconds)
    alone = statistics.mean((before, after))
    return {"codec": codec, "gemm_alone_tflops": round(alone, 1), "gemm_beside_tflops": round(beside, 1),
            "gemm_kept": round(beside / alone, 4), "gbps_moved": round(gbps, 1)}  # fmt: skip


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    models = args.models.split(",")
    gemms = () if args.no_gemm else ("fp8", "bf16")
    steps.expect((len(SWEEP) if args.sweep else 0) + len(models) * len(args.chunks) + len(gemms))
    tried = sweep(args.repeats, steps) if args.sweep else []
    rows = []
    for model in models:
        for chunks in args.chunks:
            rows += transfer_rows(model, chunks, args.repeats)
            steps.done(f"{model}: {chunks} chunks")
    gemm = []
    for codec in gemms:
        gemm.append(gemm_row(codec, args.gemm_seconds))
        steps.done(f"GEMM beside {codec} transfers")
    tiling = {
        "tile_values": triton_tiling.CODEC_TILE_VALUES,
        "groups": triton_tiling.CODEC_GROUPS_PER_STEP,
        "warps": triton_tiling.CODEC_WARPS,
    }
    config = {"models": models, "chunks": args.chunks, "repeats": args.repeats, "codec_tiling": tiling}
    results = {"rows": rows, "gemm": gemm, "sweep": tried}
    return Outcome(config, results, _show(rows, gemm, tried, tiling), device="cuda")


def _show(rows: list[dict], gemm: list[dict], tried: list[dict], tiling: dict) -> list[RenderableType]:
    table = new_table(
        f"fp8 objects against bf16 and a same-run pinned memcpy (medians; codec tiles of {tiling['tile_values']} "
        f"values, up to {tiling['groups']} groups a step, {tiling['warps']} warps)",
        ("model", "chunks", "objects", "op", "MiB moved", "us", "x bf16 memcpy", "x link"),
        names=4,
    )
    for r in rows:
        op = "store" if r["direction"] == "D2H" else "retrieve"
        table.add_row(str(r["model"]), str(r["chunks"]), str(r["codec"]), op, cell(r["mib_moved"]), cell(r["us"]),
                      cell(r["vs_bf16_memcpy"], ".2f"), cell(r["link"], ".2f"))  # fmt: skip
    show: list[RenderableType] = [*(f"sweep: {t}" for t in tried), table]
    if rows:
        show.append("every timed store and retrieve: its objects or KV equal to the torch backend's, byte for byte")
    if gemm:
        beside = new_table("a bf16 8192^3 GEMM beside 16-chunk stores and retrieves", ("objects", "GEMM kept", "GB/s"))
        for g in gemm:
            beside.add_row(str(g["codec"]), cell(g["gemm_kept"], ".3f"), cell(g["gbps_moved"]))
        show.append(beside)
    return show
