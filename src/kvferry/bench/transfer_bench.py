"""`kvferry bench transfer`: GB/s of `kvferry.transfer` on a model-shaped KV cache, as a ratio to a plain copy.

Several request sizes (`--tokens 256,1024,4096`) draw the ratio against the request's size (`--plot PATH`).

One case per (format, direction): an engine KV cache of `tokens / block_size` blocks in the format's layout
(random data), chunk objects carved from a `HostPool` (pinned when CUDA is available), and block ids in a random
permutation, so every block is somewhere else in the pool (scattered, as in a long-running engine). Before any
timing, the chosen backend's output on a slice of the request is checked byte for byte against the reference
backend: a fast but wrong backend is never reported. Timed runs alternate with the same-run copy ceiling
(`kvferry.bench.timing.CopyCeiling`), and both are reported as medians.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, int_list
from kvferry.bench.plot import Chart, Series, add_plot_argument
from kvferry.bench.timing import CopyCeiling, gbps, time_call
from kvferry.bench.transfer_spec import DTYPES, BenchSpec, kv_dtype, make_spec
from kvferry.formats import EngineKVFormat, KVGeometry, describe
from kvferry.formats.synthetic import MODELS, make_paged, random_fill
from kvferry.memory import HostPool
from kvferry.transfer import Direction, transfer
from kvferry.transfer.api import Backend

DIRECTION_NAMES = {Direction.D2H: "d2h", Direction.H2D: "h2d"}
_VERIFY_OBJECTS = 2  # chunk objects' worth of blocks checked against the reference per case
_POISON = 0x5A


@dataclass
class TransferResult:
    fmt: EngineKVFormat
    direction: str
    backend: str
    dtype: str
    tokens: int
    nbytes: int
    seconds: list[float]
    ceiling_method: str
    ceiling_seconds: list[float]
    verified_blocks: int
    gbps: float = field(init=False)
    ceiling_gbps: float = field(init=False)
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.gbps = gbps(self.nbytes, statistics.median(self.seconds))
        self.ceiling_gbps = gbps(self.nbytes, statistics.median(self.ceiling_seconds))
        self.ratio = self.gbps / self.ceiling_gbps


@dataclass
class _Case:
    """One format's engine cache, its chunk objects and the request's block ids."""

    fmt: EngineKVFormat
    paged: Any
    geom: KVGeometry
    objects: list[torch.Tensor]  # views into a HostPool's slab, which they keep alive
    block_ids: torch.Tensor
    tokens: int
    chunk_size: int

    @property
    def nbytes(self) -> int:
        return self.tokens * self.geom.bytes_per_token

    def run(self, direction: Direction, backend: Backend, objects: list[torch.Tensor] | None = None) -> None:
        objs = self.objects if objects is None else objects
        n_blocks = sum(o.shape[2] for o in objs) // self.geom.bs
        transfer(
            self.paged,
            objs,
            self.block_ids[:n_blocks],
            direction,
            self.fmt,
            chunk_size=self.chunk_size,
            backend=backend,
            block_size=self.geom.bs,
            geometry=self.geom,
        )


def _build_case(spec: BenchSpec, fmt: EngineKVFormat, generator: torch.Generator) -> _Case:
    num_blocks = spec.tokens // spec.block_size
    dtype = kv_dtype(fmt, spec.dtype)
    paged = make_paged(fmt, spec.dims, num_blocks, spec.block_size, dtype, spec.device, generator=generator)
    geom = describe(fmt, paged, spec.block_size)
    sizes = [min(spec.chunk_size, spec.tokens - start) for start in range(0, spec.tokens, spec.chunk_size)]
    shapes = [geom.object_shape(n) for n in sizes]
    alignment = 4096
    capacity = sum(math.ceil(math.prod(s) * geom.element_size / alignment) * alignment for s in shapes)
    pool = HostPool(capacity, alignment=alignment)
    objects = [pool.alloc(s, dtype) for s in shapes]
    block_ids = torch.randperm(num_blocks, generator=generator)
    return _Case(fmt, paged, geom, objects, block_ids, spec.tokens, spec.chunk_size)


def _check_against_reference(case: _Case, direction: Direction, backend: Backend, generator: torch.Generator) -> int:
    """Run `backend` on the first objects of the request and compare with the reference; returns blocks checked."""
    objs = case.objects[:_VERIFY_OBJECTS]
    fresh = [torch.empty(o.shape, dtype=o.dtype, device=case.geom.device) for o in objs]
    for o in fresh:
        o.view(torch.uint8).fill_(_POISON)
    if direction is Direction.D2H:
        for o in objs:
            o.view(torch.uint8).fill_(_POISON)
        case.run(Direction.D2H, backend, objs)
    else:
        for o in objs:
            random_fill(o, generator)
        case.run(Direction.H2D, backend, objs)
    case.run(Direction.D2H, "reference", fresh)  # what the engine holds now, read by the oracle
    for i, (got, want) in enumerate(zip(objs, fresh, strict=True)):
        if not torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()):
            raise BenchError(
                f"backend={backend!r} disagrees with the reference on {case.fmt.name} "
                f"{DIRECTION_NAMES[direction]} (object {i}): not timing a wrong result"
            )
    return sum(o.shape[2] for o in objs) // case.geom.bs


def run_bench(spec: BenchSpec, on_step: Callable[[str], None] | None = None) -> list[TransferResult]:
    """Measure every (format, direction) of `spec`; `on_step(description)` is called after each step."""
    step = on_step or (lambda _description: None)
    generator = torch.Generator().manual_seed(spec.seed)
    ceilings: dict[tuple[str, int], CopyCeiling] = {}
    results: list[TransferResult] = []
    for fmt in spec.formats:
        case = _build_case(spec, fmt, generator)
        # Fill the objects (page faults, and data for a retrieve) with one unmeasured store.
        case.run(Direction.D2H, spec.backend)
        for direction in spec.directions:
            name = DIRECTION_NAMES[direction]
            # On the CPU both directions copy host to host: one ceiling serves both.
            key = (name if spec.device.type == "cuda" else "host", case.nbytes)
            if key not in ceilings:
                ceilings[key] = CopyCeiling(spec.device, case.nbytes, name)
            results.append(_measure(spec, case, direction, ceilings[key], step, generator))
    return results


def _measure(
    spec: BenchSpec,
    case: _Case,
    direction: Direction,
    ceiling: CopyCeiling,
    step: Callable[[str], None],
    generator: torch.Generator,
) -> TransferResult:
    """Check one case against the reference, warm up, then alternate timed transfers with the ceiling copy."""
    label = f"{case.fmt.name} {DIRECTION_NAMES[direction]}"
    checked = _check_against_reference(case, direction, spec.backend, generator)
    step(f"{label}: checked against the reference")
    case.run(direction, spec.backend)
    ceiling.time_once()
    ceiling.clear()
    step(f"{label}: warm-up")
    seconds = []
    for r in range(spec.repeats):
        seconds.append(time_call(lambda: case.run(direction, spec.backend), spec.device))
        ceiling.time_once()
        step(f"{label}: run {r + 1}/{spec.repeats}")
    method, _ = ceiling.best()
    return TransferResult(
        fmt=case.fmt,
        direction=DIRECTION_NAMES[direction],
        backend=_resolved_backend(spec),
        dtype=str(case.geom.dtype).removeprefix("torch."),
        tokens=case.tokens,
        nbytes=case.nbytes,
        seconds=seconds,
        ceiling_method=method,
        ceiling_seconds=list(ceiling.samples[method]),
        verified_blocks=checked,
    )


def _resolved_backend(spec: BenchSpec) -> str:
    if spec.backend != "auto":
        return spec.backend
    return "triton" if spec.device.type == "cuda" else "torch"


DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench transfer                                   # llama3-8b, 4096 tokens, store + retrieve
  kvferry bench transfer --model deepseek-v3-mla           # 64-token blocks, format NL_X_NB_BS_HS
  kvferry bench transfer --format all --tokens 1024        # every MHA layout
  kvferry bench transfer --layers 28 --heads 4 --head-size 128 --format 2 --direction h2d
  kvferry bench transfer --device cuda --tokens 16384 --json bench-out/transfer.json
  kvferry bench transfer --tokens 256,1024,4096,16384 --plot bench-out/transfer.png   # the ratio against size
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("KV cache shape")
    shape.add_argument(
        "--model", default="llama3-8b", choices=sorted(MODELS), help="model shape (default: %(default)s)"
    )
    shape.add_argument("--layers", type=int, metavar="NL", help="override the model's layer count")
    shape.add_argument("--heads", type=int, metavar="NH", help="override the model's kv heads per layer")
    shape.add_argument("--head-size", type=int, metavar="HS", help="override the model's head size")
    shape.add_argument(
        "--format",
        metavar="FMT",
        help="format name or id, a comma-separated list, or 'all' (default: NL_X_TWO_NB_BS_NH_HS, "
        "or NL_X_NB_BS_HS for MLA models; see `kvferry formats`)",
    )
    shape.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="KV dtype (default: %(default)s)")
    shape.add_argument("--block-size", type=int, metavar="BS", help="tokens per block (default: 16; 64 for MLA)")
    request = parser.add_argument_group("request")
    request.add_argument(
        "--tokens",
        type=int_list,
        default=[4096],
        metavar="N[,N...]",
        help="tokens per transfer; a comma-separated list measures each size (default: 4096)",
    )
    request.add_argument(
        "--chunk-size", type=int, default=256, metavar="TOKENS", help="tokens per chunk object (default: %(default)s)"
    )
    request.add_argument(
        "--direction", default="both", choices=["d2h", "h2d", "both"], help="d2h = store, h2d = retrieve"
    )
    request.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "triton", "reference"],
        help="copy implementation (auto: torch on cpu, triton on cuda)",
    )
    request.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine's KV lives")
    request.add_argument("--repeats", type=int, default=7, help="timed runs per case; medians are reported")
    request.add_argument("--seed", type=int, default=0, help="seed of the random data and block ids")
    add_json_argument(parser)
    add_plot_argument(parser, "the ratio to the ceiling against the request's size")


def specs_of(args: argparse.Namespace) -> list[BenchSpec]:
    """One spec per request size."""
    return [
        make_spec(
            model=args.model,
            layers=args.layers,
            heads=args.heads,
            head_size=args.head_size,
            formats=args.format,
            direction=args.direction,
            tokens=tokens,
            chunk_size=args.chunk_size,
            block_size=args.block_size,
            backend=args.backend,
            device=args.device,
            dtype=args.dtype,
            repeats=args.repeats,
            seed=args.seed,
        )
        for tokens in args.tokens
    ]


def check(args: argparse.Namespace) -> None:
    specs_of(args)


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    specs = specs_of(args)
    steps.expect(sum(spec.steps for spec in specs))
    results = [r for spec in specs for r in run_bench(spec, steps.done)]
    spec = specs[0]  # the sizes' specs differ in their tokens only
    table = results_table(spec, [s.tokens for s in specs], results)
    config = _config(spec) | {"tokens": [s.tokens for s in specs]}
    chart = ratio_chart(spec, results)
    return Outcome(config, [_result_json(r) for r in results], [table], device=spec.device.type, chart=chart)


def ratio_chart(spec: BenchSpec, results: list[TransferResult]) -> Chart:
    """The ratio to the ceiling against the request's MiB, a line per format and direction."""
    lines: dict[str, list[TransferResult]] = {}
    for r in results:
        lines.setdefault(f"{r.fmt.name} {r.direction}", []).append(r)
    series = [Series(label, [r.nbytes / 2**20 for r in rs], [r.ratio for r in rs]) for label, rs in lines.items()]
    title = f"kvferry.transfer against a plain copy: {spec.model}, {spec.device.type}, median of {spec.repeats}"
    return Chart(title, "request MiB", "ratio to the same-run ceiling", series, x_log=True)


def results_table(spec: BenchSpec, tokens: list[int], results: list[TransferResult]) -> Table:
    dims = spec.dims
    sizes = ", ".join(str(t) for t in tokens)
    title = (
        f"kvferry.transfer on {spec.model} (NL={dims.nl}, NH={dims.nh}, HS={dims.hs}), {sizes} tokens, "
        f"block {spec.block_size}, chunk {spec.chunk_size}, {spec.device.type}, median of {spec.repeats}"
    )
    table = Table(title=title, title_justify="left")
    for name in ("format", "dir", "backend", "dtype", "MiB", "GB/s", "ceiling GB/s", "ratio", "ceiling"):
        table.add_column(name, justify="right" if name in ("MiB", "GB/s", "ceiling GB/s", "ratio") else "left")
    for r in results:
        style = "green" if r.ratio >= 0.8 else "yellow" if r.ratio >= 0.5 else "red"
        table.add_row(
            f"{r.fmt.value} {r.fmt.name}",
            r.direction,
            r.backend,
            r.dtype,
            f"{r.nbytes / 2**20:.0f}",
            f"{r.gbps:.2f}",
            f"{r.ceiling_gbps:.2f}",
            f"[{style}]{r.ratio:.2f}[/{style}]",
            r.ceiling_method,
        )
    return table


def _config(spec: BenchSpec) -> dict[str, Any]:
    return {
        "model": spec.model,
        "dims": asdict(spec.dims),
        "tokens": spec.tokens,
        "chunk_size": spec.chunk_size,
        "block_size": spec.block_size,
        "backend": spec.backend,
        "device": str(spec.device),
        "dtype": str(spec.dtype).removeprefix("torch."),
        "repeats": spec.repeats,
        "seed": spec.seed,
    }


def _result_json(r: TransferResult) -> dict[str, Any]:
    return {
        "format": r.fmt.name,
        "format_id": r.fmt.value,
        "direction": r.direction,
        "backend": r.backend,
        "dtype": r.dtype,
        "tokens": r.tokens,
        "bytes": r.nbytes,
        "gbps": r.gbps,
        "ceiling_gbps": r.ceiling_gbps,
        "ratio": r.ratio,
        "ceiling_method": r.ceiling_method,
        "seconds": r.seconds,
        "ceiling_seconds": r.ceiling_seconds,
        "verified_blocks": r.verified_blocks,
    }
