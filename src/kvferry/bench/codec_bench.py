"""`python -m kvferry.bench.codec_bench`: the fp8 object codec on a GPU against the bf16 path and the link.

Per model and request size (16 chunks, 1 chunk): the wall time of a store and of a retrieve (call to completion,
median) with the fp8 codec and without it, and of a pinned memcpy of the bf16 bytes and of the bytes the codec
moves. `vs bf16 memcpy` counts the bf16 bytes the engine holds (what the issue's 1.8x is about); `link` counts the
bytes moved. Every codec request is first checked byte for byte against the torch backend on the GPU. Then a bf16
8192^3 GEMM beside a loop of 16-chunk fp8 stores and retrieves, against the mean of the GEMM alone before and after.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvferry import Direction
from kvferry.bench.gpu_gemm import gemm_tflops
from kvferry.bench.timing import PinnedCopy, median_us
from kvferry.formats import EngineKVFormat, KVGeometry, describe, with_codec
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.transfer import transfer, transfer_async
from kvferry.transfer.gpu_engine import TransferEngine

F = EngineKVFormat
SHAPES = {"llama3-8b": (F.NL_X_TWO_NB_BS_NH_HS, 16), "deepseek-v3-mla": (F.NL_X_NB_BS_HS, 64)}


def _setup(model: str, chunks: int) -> tuple:
    fmt, bs = SHAPES[model]
    per = 256 // bs
    paged = make_paged(fmt, MODELS[model], max(64, 2 * chunks * per), bs, torch.bfloat16, "cuda")
    plain = describe(fmt, paged)
    ids = torch.randperm(max(64, 2 * chunks * per))[: chunks * per]
    return fmt, paged, plain, with_codec(plain, "fp8"), ids


def _check(fmt: F, paged: object, coded: KVGeometry, objs: torch.Tensor, ids: torch.Tensor) -> str:
    """How many bytes of the GPU kernel's objects differ from the torch backend's on the same GPU (and a few of
    them: the scaled value, the reference's e4m3 value, the kernel's)."""
    ref = torch.empty(objs.shape, dtype=torch.uint8, device="cuda")
    transfer(paged, ref, ids, Direction.D2H, fmt, geometry=coded, backend="torch")
    ref = ref.cpu()
    bad = ref != objs
    width = coded.codec.width if coded.codec else 0
    group = coded.codec.group if coded.codec else 1
    if not bool(bad.any()):
        return "equal"
    plain = torch.empty((objs.shape[0], *coded.object_shape(256)[:3], width), dtype=coded.dtype, device="cuda")
    transfer(paged, plain, ids, Direction.D2H, fmt, geometry=describe(fmt, paged))
    x = plain.cpu().float().unflatten(-1, (-1, group))
    amax = x.abs().amax(-1, keepdim=True)
    scaled = (x * (torch.full_like(amax, 448.0) / amax)).flatten(-2)
    where = bad[..., :width].nonzero()[:6].tolist()
    e4m3 = torch.float8_e4m3fn
    few = [(scaled[tuple(i)].item(), ref[tuple(i)].view(e4m3).item(), objs[tuple(i)].view(e4m3).item()) for i in where]
    return f"{int(bad[..., :width].sum())} value bytes, {int(bad[..., width:].sum())} scale bytes differ: {few}"


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
            if name == "fp8" and d is Direction.D2H:
                print(
                    model, chunks, "fp8 objects vs the torch backend on the GPU:", _check(fmt, paged, geom, objs, ids)
                )
            us = median_us(call, repeats)
            to_host = d is Direction.D2H
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
                }
            )
    return rows


def gemm_row(seconds: float) -> dict[str, object]:
    fmt, paged, _, coded, ids = _setup("llama3-8b", 16)
    engine = TransferEngine("cuda")
    objs = torch.empty((16, *coded.object_shape(256)), dtype=torch.uint8, pin_memory=True)
    nbytes = coded.bytes_per_token * 256 * 16

    def both() -> int:
        for d in (Direction.D2H, Direction.H2D):
            transfer_async(paged, objs, ids, d, fmt, geometry=coded, engine=engine).wait()
        return 2 * nbytes

    gemm_tflops(seconds=3.0)  # warm the card up
    before, _ = gemm_tflops(seconds=seconds)
    beside, gbps = gemm_tflops(both, seconds=seconds)
    after, _ = gemm_tflops(seconds=seconds)
    alone = statistics.mean((before, after))
    return dict(gemm_alone_tflops=round(alone, 1), gemm_beside_tflops=round(beside, 1),
                gemm_kept=round(beside / alone, 4), fp8_gbps_moved=round(gbps, 1))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gemm-seconds", type=float, default=1.0)
    args = parser.parse_args()
    for model in SHAPES:
        for chunks in (16, 1):
            for row in transfer_rows(model, chunks, args.repeats):
                print(row, flush=True)
    print(gemm_row(args.gemm_seconds), flush=True)


if __name__ == "__main__":
    main()
