"""GPU data path benchmark: every number is a ratio to a same-run pinned memcpy of the same bytes.

Run on the GPU machine:  PYTHONPATH=src python3 benchmarks/bench_gpu_transfer.py --out $OUT/gpu.json
Sections: bulk (16+ scattered chunks, staged / serial / zero-copy / torch by hand), every format, one-chunk latency,
both directions at once, GEMM interference, zero-copy crossover.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, layout_of
from kvferry.formats.synthetic import MODELS, ModelDims, make_paged
from kvferry.memory import HostPool
from kvferry.transfer.gpu_engine import EngineConfig, TransferEngine

F = EngineKVFormat
SHAPES = {"llama3-8b": 16, "qwen2.5-0.5b": 16, "deepseek-v3-mla": 64}


def paired_ms(fn, ceiling, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median wall times in ms of fn() and of its ceiling, timed alternately (both must synchronize): a machine
    whose PCIe or host speed drifts during a run then moves both alike (a ceiling timed once before the row
    moved ratios by +-0.02 on noisy starts)."""
    fn()
    ceiling()
    ours, ceil = [], []
    for _ in range(reps):
        for f, out in ((fn, ours), (ceiling, ceil)):
            t = time.perf_counter()
            f()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ours), statistics.median(ceil)


_memcpy_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def memcpy(nbytes: int, to_host: bool):  # type: ignore[no-untyped-def]
    """The ceiling: one pinned <-> device copy of nbytes (torch's copy_, i.e. cudaMemcpyAsync), then a sync."""
    if nbytes not in _memcpy_buffers:
        _memcpy_buffers.clear()  # one size at a time: 512 MiB buffers add up
        _memcpy_buffers[nbytes] = (torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2),
                                   torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1))  # fmt: skip
    dev, host = _memcpy_buffers[nbytes]

    def once() -> None:
        (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        torch.cuda.synchronize()

    return once


class Setup:
    def __init__(
        self, model: str, fmt: F, n_chunks: int, chunk: int = 256, nb: int = 4096, gaps: bool = True, run: bool = False
    ) -> None:
        """`gaps`: objects scattered in the pool (a small hole after each); `run`: one tensor of all objects."""
        dims = MODELS[model]
        if layout_of(fmt).is_mla and not layout_of(fmt).nesting.count("NP"):
            dims = ModelDims(nl=dims.nl, nh=1, hs=sum(dims.plane_widths) or dims.hs)
        if not layout_of(fmt).is_mla and model == "deepseek-v3-mla":
            dims = MODELS["llama3-8b"]
        if fmt == F.NL_X_NB_BSV_BSS:
            dims = ModelDims(nl=61, nh=1, hs=132)
        bs = SHAPES[model]
        dtype = torch.uint8 if fmt == F.NL_X_NB_BSV_BSS else torch.bfloat16
        self.fmt, self.chunk, self.bs = fmt, chunk, bs
        self.paged = make_paged(fmt, dims, nb, bs, dtype, device="cuda")
        self.geom = describe(fmt, self.paged, block_size=bs)
        obj_bytes = self.geom.bytes_per_token * chunk
        self.pool = HostPool(1 << max(30, (obj_bytes * n_chunks * 2).bit_length()))
        listed: list[torch.Tensor] = []
        for _ in range(0 if run else n_chunks):
            listed.append(self.pool.alloc(self.geom.object_shape(chunk), dtype))
            if gaps:  # scattered in the pool: a small hole after each object
                self.pool.alloc((4096,), torch.uint8)
        self.objects = self.pool.alloc((n_chunks, *self.geom.object_shape(chunk)), dtype) if run else listed
        self.ids = torch.randperm(nb)[: n_chunks * chunk // bs]
        self.nbytes = obj_bytes * n_chunks

    def run(self, direction: Direction, engine: TransferEngine, mode: str | None = None) -> None:
        kvferry.transfer_async(
            self.paged, self.objects, self.ids, direction, self.fmt, self.chunk, geometry=self.geom,
            engine=engine, mode=mode,
        ).wait()  # fmt: skip


def by_hand(s: Setup):  # type: ignore[no-untyped-def]
    """LIMITS.md's 'torch by hand': per layer kv[l][:, ids] into a GPU buffer, then one D2H copy."""
    ids = s.ids.cuda()
    buf = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)
    per_layer = s.nbytes // len(s.paged)

    def once() -> None:
        for i, t in enumerate(s.paged):
            buf[i * per_layer : (i + 1) * per_layer].view(t.dtype).view(-1).copy_(t[:, ids].reshape(-1))
        host.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()

    return once


def gemm_tflops(during=None, seconds: float = 1.0) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """bf16 8192^3 GEMMs on the current stream for ~seconds while `during()` transfers loop on its own streams."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    moved = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = max(40, int(seconds / 1.6e-3))  # one 8192^3 GEMM takes ~1.6 ms on an H200
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    t0 = time.perf_counter()
    side = torch.cuda.Stream()  # the transfers' caller stream: not ordered after the GEMMs
    with torch.cuda.stream(side):
        while not end.query() and during is not None:
            moved += during()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ms = start.elapsed_time(end)
    return 2 * n**3 * iters / (ms / 1e3) / 1e12, (moved / wall / 1e9 if during is not None else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sections", default="bulk,formats,formats-run,onechunk,bidir,gemm,crossover",
                    help="comma-separated subset of: bulk, formats, formats-run (objects as one tensor), onechunk, "
                         "bidir, gemm, crossover")  # fmt: skip
    args = ap.parse_args()
    reps = args.reps
    rows: list[dict] = []
    engine = TransferEngine("cuda")
    serial = TransferEngine("cuda", EngineConfig(slots=1, mode="staged"))
    old_floor = TransferEngine("cuda", EngineConfig(slice_bytes=16 << 20))  # the slice floor before 8 MiB

    def row(section: str, what: str, nbytes: int, fn, ceiling, n: int = reps, **extra) -> None:  # type: ignore[no-untyped-def]
        ms, ceiling_ms = paired_ms(fn, ceiling, n)
        r = dict(section=section, what=what, mib=nbytes / 2**20, gbps=nbytes / ms / 1e6,
                 ceiling_gbps=nbytes / ceiling_ms / 1e6, ratio=ceiling_ms / ms, **extra)  # fmt: skip
        rows.append(r)
        print(f"{section:10s} {what:58s} {r['gbps']:7.1f} GB/s  ceil {r['ceiling_gbps']:6.1f}  ratio {r['ratio']:.3f}",
              flush=True)  # fmt: skip

    def run(s: Setup, d: Direction, eng: TransferEngine, mode: str | None):  # type: ignore[no-untyped-def]
        return lambda: s.run(d, eng, mode)

    sections = set(args.sections.split(","))
    # 1. bulk: 16 chunks of scattered blocks (32 for qwen)
    for model, n in (
        [] if "bulk" not in sections else (("llama3-8b", 16), ("qwen2.5-0.5b", 32), ("deepseek-v3-mla", 16))
    ):
        fmt = F.NL_X_NB_BS_HS if model == "deepseek-v3-mla" else F.NL_X_TWO_NB_BS_NH_HS
        s = Setup(model, fmt, n)
        for d in (Direction.D2H, Direction.H2D):
            ceil = memcpy(s.nbytes, d is Direction.D2H)
            row("bulk", f"{model} {d.name} staged pipeline", s.nbytes, run(s, d, engine, "staged"), ceil)
            row("bulk", f"{model} {d.name} serial gather+DMA (1 slot)", s.nbytes, run(s, d, serial, "staged"), ceil)
            row("bulk", f"{model} {d.name} zero-copy kernel", s.nbytes, run(s, d, engine, "zero_copy"), ceil)
        if fmt == F.NL_X_TWO_NB_BS_NH_HS:
            row("bulk", f"{model} D2H torch by hand", s.nbytes, by_hand(s), memcpy(s.nbytes, True))
        adjacent = Setup(model, fmt, n, gaps=False)  # a fresh pool hands one request's objects out back to back
        for d in (Direction.D2H, Direction.H2D):
            row("bulk", f"{model} {d.name} staged, adjacent objects", s.nbytes, run(adjacent, d, engine, "staged"),
                memcpy(s.nbytes, d is Direction.D2H))  # fmt: skip
        del adjacent
        one = Setup(model, fmt, n, run=True)  # the objects as one tensor [n, *object_shape]
        for d in (Direction.D2H, Direction.H2D):
            row("bulk", f"{model} {d.name} staged, objects as one tensor", s.nbytes, run(one, d, engine, "staged"),
                memcpy(s.nbytes, d is Direction.D2H))  # fmt: skip
        del one
        del s
        torch.cuda.empty_cache()
    # 2. every format at a realistic shape, 16 chunks: objects scattered in the pool (one DMA each), or as one
    # tensor (as the cache allocates a request's objects: one DMA per slice)
    for section, as_one in (("formats", False), ("formats-run", True)):
        for fmt in F if section in sections else ():
            model = "deepseek-v3-mla" if layout_of(fmt).is_mla else "llama3-8b"
            s = Setup(model, fmt, 16, nb=2048, run=as_one)
            for d in (Direction.D2H, Direction.H2D):
                ceil = memcpy(s.nbytes, d is Direction.D2H)
                row(section, f"{fmt.name} {d.name}", s.nbytes, run(s, d, engine, None), ceil)
            del s
    # 3. one chunk, wall time from the Python call to completion vs a single memcpy's
    for model in ("llama3-8b", "qwen2.5-0.5b") if "onechunk" in sections else ():
        s = Setup(model, F.NL_X_TWO_NB_BS_NH_HS, 1)
        for d in (Direction.D2H, Direction.H2D):
            ceil = memcpy(s.nbytes, d is Direction.D2H)
            enqueue = []
            for _ in range(50):
                t0 = time.perf_counter()
                h = kvferry.transfer_async(s.paged, s.objects, s.ids, d, s.fmt, geometry=s.geom, engine=engine)
                enqueue.append((time.perf_counter() - t0) * 1e6)
                h.wait()
            print(f"one-chunk  {model} {d.name}: CPU time of the call (enqueue) {statistics.median(enqueue):.0f} us")
            for mode in ("staged", "zero_copy", None):
                what = f"{model} {d.name} {mode or 'auto'}"
                row("one-chunk", what, s.nbytes, run(s, d, engine, mode), ceil, reps * 4)
            row("one-chunk", f"{model} {d.name} staged, 16 MiB slices", s.nbytes, run(s, d, old_floor, "staged"),
                ceil, reps * 4)  # fmt: skip
        row("one-chunk", f"{model} D2H torch by hand", s.nbytes, by_hand(s), memcpy(s.nbytes, True), reps * 4)
    # 4. both directions at once vs two-stream memcpy
    s = Setup("llama3-8b", F.NL_X_TWO_NB_BS_NH_HS, 16)
    t = Setup("llama3-8b", F.NL_X_TWO_NB_BS_NH_HS, 16)
    dev = [torch.empty(s.nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = [torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    st = [torch.cuda.Stream(), torch.cuda.Stream()]

    def two_memcpy() -> None:
        with torch.cuda.stream(st[0]):
            host[0].copy_(dev[0], non_blocking=True)
        with torch.cuda.stream(st[1]):
            dev[1].copy_(host[1], non_blocking=True)
        torch.cuda.synchronize()

    def both() -> None:
        h1 = kvferry.transfer_async(s.paged, s.objects, s.ids, Direction.D2H, s.fmt, geometry=s.geom, engine=engine)
        h2 = kvferry.transfer_async(t.paged, t.objects, t.ids, Direction.H2D, t.fmt, geometry=t.geom, engine=engine)
        h1.wait()
        h2.wait()

    if "bidir" in sections:
        row(
            "bidir",
            "llama3-8b store+retrieve at once (bytes both ways)",
            2 * s.nbytes,
            both,
            two_memcpy,
        )
    # 5. GEMM interference. The GEMM's own speed drifts with the card's power/thermal state (the first second of
    # GEMMs ran 12% faster than the next, measured): warm it up, and compare each run beside a transfer with the mean
    # of runs alone just before and after it. Control: a plain pinned memcpy loop (the copy engine, no kernel).
    if "gemm" in sections:
        gemm_tflops(seconds=3.0)
        dev = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)

        def plain(to_host: bool) -> int:
            host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            return s.nbytes

        variants: list[tuple[str, Direction, object]] = []
        for d in (Direction.D2H, Direction.H2D):
            variants.append(("plain memcpy (control)", d, lambda d=d: plain(d is Direction.D2H)))
        grids = [("staged", None, 0), ("staged", 32, 0), ("staged", None, -1), ("staged", 32, -1), ("staged", 16, -1)]
        for mode, programs, priority in [*grids, ("zero_copy", None, 0)]:
            eng = TransferEngine("cuda", EngineConfig(programs=programs, kernel_priority=priority))
            label = f"{mode}{'' if programs is None else f' {programs} programs'}{' high priority' * (priority < 0)}"
            for d in (Direction.D2H, Direction.H2D):

                def loop(d=d, mode=mode, eng=eng) -> int:  # type: ignore[no-untyped-def]
                    s.run(d, eng, mode)
                    return s.nbytes

                variants.append((label, d, loop))
        for label, d, during in variants:
            before, _ = gemm_tflops()
            tf, gbps = gemm_tflops(during)
            after, _ = gemm_tflops()
            alone = (before + after) / 2
            rows.append(
                dict(section="gemm", what=f"{label} {d.name}", gemm_tflops=tf, gemm_alone=alone,
                     gemm_alone_before=before, gemm_alone_after=after, gemm_kept=tf / alone, gbps=gbps)
            )  # fmt: skip
            print(
                f"gemm       {label} {d.name}: GEMM {tf:.0f} TFLOP/s of {alone:.0f} alone ({before:.0f} before, "
                f"{after:.0f} after): kept {tf / alone:.3f}; transfer {gbps:.1f} GB/s",
                flush=True,
            )
    # 6. crossover: qwen chunks, staged vs zero-copy wall time
    for n in (1, 2, 4, 8) if "crossover" in sections else ():
        q = Setup("qwen2.5-0.5b", F.NL_X_TWO_NB_BS_NH_HS, n)
        for d in (Direction.D2H, Direction.H2D):
            for mode in ("staged", "zero_copy"):
                row("crossover", f"qwen {n} chunks {d.name} {mode}", q.nbytes, run(q, d, engine, mode),
                    memcpy(q.nbytes, d is Direction.D2H), reps * 2)  # fmt: skip
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                torch=torch.__version__, command=" ".join(sys.argv))  # fmt: skip
    import triton

    meta["triton"] = triton.__version__
    with open(args.out, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
