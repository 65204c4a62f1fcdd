"""`kvferry bench gpu-transfer`: the GPU data path, section by section; every number is a ratio to a same-run pinned
memcpy of the same bytes, timed alternately with it (medians of --reps).

Sections:
  bulk         16 scattered chunks (qwen2.5-0.5b: 32) of llama3-8b, qwen2.5-0.5b and deepseek-v3-mla: staged,
               serial (one staging slot), zero-copy, page DMA, torch by hand; adjacent objects; objects as one
               tensor
  formats      every engine format at a realistic shape, 16 chunks, objects scattered in the pool
  formats-run  the same with the objects as one tensor (as the cache allocates a request's objects)
  onechunk     one chunk, from the Python call to completion, per mode
  calls        the latency-bound requests (one chunk of llama3-8b and of qwen2.5-0.5b, 16 scattered and 32 as
               one tensor of qwen2.5-0.5b) and the memcpy of their bytes: the call's CPU time, its wall time split
               into the GPU's own time and its wait for the CPU, a profiled timeline (`kvferry.bench.gpu_timeline`);
               the 16 chunks' ratios
  bidir        a store and a retrieve at once, against two memcpys on two streams
  gemm         a bf16 8192^3 GEMM loop's TFLOP/s while transfers run beside it, against GEMMs alone
  crossover    1-8 qwen2.5-0.5b chunks, staged against zero-copy

The bytes are checked on a stated sample, outside the timed regions: the last timed transfer of each row (each
case, engine, mode and direction; not `torch by hand`, which is torch's own copy) against the torch backend's
transfer of the same blocks, into memory first filled with random bytes: a store's objects, or the whole KV after a
retrieve. In `gemm`, each transfer loop's bytes once, after the loop. A wrong transfer fails the run (`BenchError`).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import kvferry
from kvferry import Direction
from kvferry.bench.codec_checks import CallCheck
from kvferry.bench.gpu_gemm import STEPS as GEMM_STEPS
from kvferry.bench.gpu_gemm import gemm_rows, gemm_table
from kvferry.bench.gpu_setup import Setup, by_hand
from kvferry.bench.gpu_timeline import Waitable, call_costs
from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, require_cuda
from kvferry.bench.report import new_table
from kvferry.bench.timing import PinnedCopy
from kvferry.formats import EngineKVFormat, layout_of
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.gpu_engine import TransferEngine

F = EngineKVFormat
SECTIONS = ("bulk", "formats", "formats-run", "onechunk", "calls", "bidir", "gemm", "crossover")
D2H = Direction.D2H
DIRECTIONS = (Direction.D2H, Direction.H2D)

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench gpu-transfer                                      # every section
  kvferry bench gpu-transfer --sections bulk,onechunk --reps 15 --json bench-out/gpu.json
  kvferry bench gpu-transfer --sections calls --reps 15          # what a small request's call costs
"""


def paired_ms(
    fn: Callable[[], object], ceiling: Callable[[], object], reps: int, checks: Sequence[CallCheck] = ()
) -> tuple[float, float]:
    """Median wall times in ms of fn() and of its ceiling, timed alternately (both must synchronize): a machine
    whose PCIe or host speed drifts during a run then moves both alike (a ceiling timed once before the row
    moved ratios by +-0.02 on noisy starts). `checks`: of the last timed fn(), poisoned before it, checked after
    the loop."""
    fn()
    ceiling()
    ours: list[float] = []
    ceil: list[float] = []
    for rep in range(reps):
        if rep == reps - 1:
            for check in checks:
                check.setup()
        for f, out in ((fn, ours), (ceiling, ceil)):
            t = time.perf_counter()
            f()
            out.append((time.perf_counter() - t) * 1e3)
    for check in checks:
        check.last()
    return statistics.median(ours), statistics.median(ceil)


_ceilings: dict[int, PinnedCopy] = {}


def memcpy(nbytes: int, to_host: bool) -> Callable[[], None]:
    """The ceiling: one pinned <-> device copy of nbytes (torch's copy_, i.e. cudaMemcpyAsync), then a sync."""
    copy = _ceiling(nbytes)
    return lambda: copy(to_host)


def memcpy_start(nbytes: int, to_host: bool) -> Callable[[], Waitable]:
    """The ceiling's copy as a request `gpu_timeline` times: enqueued on the caller's stream, waited for as the
    ceiling is (a device-wide sync)."""
    copy = _ceiling(nbytes)

    def start() -> Waitable:
        copy.start(to_host)
        return _OnCallersStream()

    return start


class _OnCallersStream:
    def wait(self) -> None:
        torch.cuda.synchronize()

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Nothing to do: the copy is on the caller's stream."""


def _ceiling(nbytes: int) -> PinnedCopy:
    if nbytes not in _ceilings:
        _ceilings.clear()  # one size at a time: 512 MiB buffers add up
        _ceilings[nbytes] = PinnedCopy(nbytes)
    return _ceilings[nbytes]


# The latency-bound requests of the `calls` section: (model, chunks, the objects as one tensor)
CALLS = (("llama3-8b", 1, False), ("qwen2.5-0.5b", 1, False), ("qwen2.5-0.5b", 16, False), ("qwen2.5-0.5b", 32, True))


def call_name(model: str, n: int, run: bool) -> str:
    return f"{model} " + ("one chunk" if n == 1 else f"{n} chunks as one tensor" if run else f"{n} scattered chunks")


class Bench:
    """The engines every section uses, and the rows they produce (each row one progress step)."""

    def __init__(self, reps: int, steps: Steps) -> None:
        self.reps, self.steps = reps, steps
        self.rows: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.checked = 0  # rows whose last timed transfer was checked
        self.engine = TransferEngine("cuda")
        self.serial = TransferEngine("cuda", EngineConfig(slots=1, mode="staged"))
        self.old_floor = TransferEngine("cuda", EngineConfig(slice_bytes=16 << 20))  # the slice floor before 8 MiB

    def row(
        self,
        section: str,
        what: str,
        nbytes: int,
        fn: Callable[[], object],
        ceiling: Callable[[], object],
        n: int | None = None,
        checked: Sequence[tuple[Setup, Direction]] = (),
    ) -> None:
        """`checked`: the cases and directions fn() transfers, whose last timed transfer is checked."""
        checks = [case.check(d, f"{section} {what}") for case, d in checked]
        ms, ceiling_ms = paired_ms(fn, ceiling, self.reps if n is None else n, checks)
        self.checked += bool(checks)
        self.rows.append(
            dict(
                section=section,
                what=what,
                mib=nbytes / 2**20,
                gbps=nbytes / ms / 1e6,
                ceiling_gbps=nbytes / ceiling_ms / 1e6,
                ratio=ceiling_ms / ms,
            )
        )
        self.steps.done(f"{section} {what}")

    def bulk(self) -> None:
        """16 chunks of scattered blocks (32 for qwen)."""
        for model, n in (("llama3-8b", 16), ("qwen2.5-0.5b", 32), ("deepseek-v3-mla", 16)):
            fmt = F.NL_X_NB_BS_HS if model == "deepseek-v3-mla" else F.NL_X_TWO_NB_BS_NH_HS
            s = Setup(model, fmt, n)
            for d in DIRECTIONS:
                ceil = memcpy(s.nbytes, d is D2H)
                for label, engine, mode in (
                    ("staged pipeline", self.engine, "staged"),
                    ("serial gather+DMA (1 slot)", self.serial, "staged"),
                    ("zero-copy kernel", self.engine, "zero_copy"),
                    ("page DMA (copy engine alone)", self.engine, "page_dma"),
                ):
                    what = f"{model} {d.name} {label}"
                    self.row("bulk", what, s.nbytes, s.runner(d, engine, mode), ceil, checked=[(s, d)])
            if fmt == F.NL_X_TWO_NB_BS_NH_HS:
                self.row("bulk", f"{model} D2H torch by hand", s.nbytes, by_hand(s), memcpy(s.nbytes, True))
            adjacent = Setup(model, fmt, n, gaps=False)  # a fresh pool hands one request's objects out back to back
            for d in DIRECTIONS:
                what = f"{model} {d.name} staged, adjacent objects"
                run = adjacent.runner(d, self.engine, "staged")
                self.row("bulk", what, s.nbytes, run, memcpy(s.nbytes, d is D2H), checked=[(adjacent, d)])
            del adjacent
            one = Setup(model, fmt, n, run=True)  # the objects as one tensor [n, *object_shape]
            for d in DIRECTIONS:
                what = f"{model} {d.name} staged, objects as one tensor"
                run = one.runner(d, self.engine, "staged")
                self.row("bulk", what, s.nbytes, run, memcpy(s.nbytes, d is D2H), checked=[(one, d)])
            del one
            del s
            torch.cuda.empty_cache()

    def formats(self, section: str) -> None:
        """Every format at a realistic shape, 16 chunks: objects scattered in the pool (one DMA each), or as one
        tensor (as the cache allocates a request's objects: one DMA per slice)."""
        for fmt in F:
            model = "deepseek-v3-mla" if layout_of(fmt).is_mla else "llama3-8b"
            s = Setup(model, fmt, 16, nb=2048, run=section == "formats-run")
            for d in DIRECTIONS:
                ceil = memcpy(s.nbytes, d is D2H)
                run = s.runner(d, self.engine, None)
                self.row(section, f"{fmt.name} {d.name}", s.nbytes, run, ceil, checked=[(s, d)])
            del s

    def onechunk(self) -> None:
        """One chunk, wall time from the Python call to completion vs a single memcpy's."""
        reps = self.reps * 4
        for model in ("llama3-8b", "qwen2.5-0.5b"):
            s = Setup(model, F.NL_X_TWO_NB_BS_NH_HS, 1)
            for d in DIRECTIONS:
                ceil = memcpy(s.nbytes, d is D2H)
                for label, engine, mode in (
                    ("staged", self.engine, "staged"),
                    ("zero_copy", self.engine, "zero_copy"),
                    ("page_dma", self.engine, "page_dma"),
                    ("auto", self.engine, None),
                    ("staged, 16 MiB slices", self.old_floor, "staged"),
                ):
                    run = s.runner(d, engine, mode)
                    self.row("one-chunk", f"{model} {d.name} {label}", s.nbytes, run, ceil, reps, [(s, d)])
            self.row("one-chunk", f"{model} D2H torch by hand", s.nbytes, by_hand(s), memcpy(s.nbytes, True), reps)

    def latency_bound(self) -> None:
        """The requests whose call's CPU time shows, in the mode `auto` picks: per direction, `gpu_timeline.call_costs`
        of the request and of the ceiling's memcpy of its bytes; and the ratio of 16 scattered qwen2.5-0.5b chunks
        (the other three are rows of `onechunk` and `bulk`)."""
        for model, n, run in CALLS:
            s = Setup(model, F.NL_X_TWO_NB_BS_NH_HS, n, run=run)
            what = call_name(model, n, run)
            for d in DIRECTIONS:
                if n == 16:
                    ratio = s.runner(d, self.engine, None)
                    ceil = memcpy(s.nbytes, d is D2H)
                    self.row("calls", f"{what} {d.name} auto", s.nbytes, ratio, ceil, checked=[(s, d)])
                # a staged retrieve of several slices starts its first DMAs into staging unordered (gpu_timeline)
                ordered = n == 1 or d is D2H
                costs = call_costs(functools.partial(s.start, d, self.engine), ordered=ordered)
                self.calls.append({"what": what, "direction": d.name, **costs})
                ceiling = call_costs(memcpy_start(s.nbytes, d is D2H))
                self.calls.append({"what": f"{what}: memcpy", "direction": d.name, **ceiling})
                self.steps.done(f"calls {what} {d.name}: the call's CPU time and GPU timeline")
            del s
            torch.cuda.empty_cache()

    def bidir(self, s: Setup) -> None:
        """Both directions at once vs two-stream memcpy."""
        t = Setup("llama3-8b", F.NL_X_TWO_NB_BS_NH_HS, 16)
        copies = [PinnedCopy(s.nbytes), PinnedCopy(s.nbytes)]
        st = [torch.cuda.Stream(), torch.cuda.Stream()]

        def two_memcpy() -> None:
            with torch.cuda.stream(st[0]):
                copies[0].host.copy_(copies[0].dev, non_blocking=True)
            with torch.cuda.stream(st[1]):
                copies[1].dev.copy_(copies[1].host, non_blocking=True)
            torch.cuda.synchronize()

        def both() -> None:
            h1 = kvferry.transfer_async(
                s.paged, s.objects, s.ids, Direction.D2H, s.fmt, geometry=s.geom, engine=self.engine
            )
            h2 = kvferry.transfer_async(
                t.paged, t.objects, t.ids, Direction.H2D, t.fmt, geometry=t.geom, engine=self.engine
            )
            h1.wait()
            h2.wait()

        what = "llama3-8b store+retrieve at once (bytes both ways)"
        self.row("bidir", what, 2 * s.nbytes, both, two_memcpy, checked=[(s, Direction.D2H), (t, Direction.H2D)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=15, help="timed runs per row; medians (default: %(default)s)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of: {', '.join(SECTIONS)} (default: all of them)",
    )
    add_json_argument(parser)


def _sections(args: argparse.Namespace) -> list[str]:
    asked = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in asked if s not in SECTIONS]
    if unknown or not asked:
        raise BenchError(f"--sections {args.sections!r}: each must be one of {', '.join(SECTIONS)}")
    return asked


def check(args: argparse.Namespace) -> None:
    if args.reps < 1:
        raise BenchError(f"--reps must be at least 1, got {args.reps}")
    _sections(args)
    require_cuda("this benchmark")


def planned_steps(sections: list[str]) -> int:
    """Progress steps: one per row, per one-chunk CPU-time measurement, per GEMM variant and its warm-up."""
    per_section = {
        "bulk": 13 + 13 + 12,  # llama and qwen: 4 modes x 2 directions, by hand, adjacent x 2, one tensor x 2
        "formats": 2 * len(F),
        "formats-run": 2 * len(F),
        "onechunk": 2 * (2 * 5 + 1),  # per model: 5 modes x 2 directions, by hand
        "calls": len(CALLS) * 2 + 2,  # per request and direction (with its memcpy's); the 16 chunks' ratios
        "bidir": 1,
        "gemm": GEMM_STEPS,
        "crossover": 4 * 2 * 2,
    }
    return sum(per_section[s] for s in set(sections))


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    sections = set(_sections(args))
    steps.expect(planned_steps(list(sections)))
    bench = Bench(args.reps, steps)
    if "bulk" in sections:
        bench.bulk()
    for section in ("formats", "formats-run"):
        if section in sections:
            bench.formats(section)
    if "onechunk" in sections:
        bench.onechunk()
    if "calls" in sections:
        bench.latency_bound()
    if sections & {"bidir", "gemm"}:
        s = Setup("llama3-8b", F.NL_X_TWO_NB_BS_NH_HS, 16)
        if "bidir" in sections:
            bench.bidir(s)
        if "gemm" in sections:
            bench.rows += gemm_rows(s, steps)
    if "crossover" in sections:  # qwen chunks, staged vs zero-copy wall time
        for n in (1, 2, 4, 8):
            q = Setup("qwen2.5-0.5b", F.NL_X_TWO_NB_BS_NH_HS, n)
            for d in DIRECTIONS:
                for mode in ("staged", "zero_copy"):
                    bench.row(
                        "crossover",
                        f"qwen {n} chunks {d.name} {mode}",
                        q.nbytes,
                        q.runner(d, bench.engine, mode),
                        memcpy(q.nbytes, d is D2H),
                        args.reps * 2,
                        [(q, d)],
                    )
    config = {"reps": args.reps, "sections": [name for name in SECTIONS if name in sections]}
    results = {"rows": bench.rows, "calls": bench.calls, "checked_rows": bench.checked}
    return Outcome(config, results, _show(bench), device="cuda")


def _show(bench: Bench) -> list[Any]:
    out: list[Any] = []
    rows = [r for r in bench.rows if r["section"] != "gemm"]
    if rows:
        table = new_table(
            "kvferry GPU transfers against a same-run pinned memcpy of the same bytes",
            ("section", "what", "MiB", "GB/s", "ceiling GB/s", "ratio"),
            names=2,
        )
        for r in rows:
            table.add_row(
                r["section"],
                r["what"],
                f"{r['mib']:.0f}",
                f"{r['gbps']:.1f}",
                f"{r['ceiling_gbps']:.1f}",
                f"{r['ratio']:.3f}",
            )
        out.append(table)
        out.append(
            f"checked: the last timed transfer of {bench.checked} of these rows (a sample; not `torch by hand`) "
            "equal to the torch backend's, byte for byte"
        )
    if bench.calls:
        calls = new_table(
            "the call (medians of 50): its CPU time to return; its wall time to completion, the GPU's own time for "
            "it, and the difference: what the GPU waited for the CPU. Profiled (10 calls, upper bounds): when its "
            "first GPU operation starts and its last ends, after the call",
            ("request", "dir", "CPU us", "wall us", "GPU us", "GPU waited us", "first op us", "last ends us"),
            names=2,
        )
        for c in bench.calls:
            times = (c["enqueue_us"], c["wall_us"], c["gpu_us"], c["cpu_bound_us"], c["first_op_us"], c["gpu_end_us"])
            calls.add_row(c["what"], c["direction"], *map(_us, times))
        out.append(calls)
    gemm = [r for r in bench.rows if r["section"] == "gemm"]
    if gemm:
        out.append(gemm_table(gemm))
    return out


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
