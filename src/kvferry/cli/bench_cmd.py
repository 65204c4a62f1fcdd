"""`kvferry bench transfer`: flags, a progress bar, the results table and the JSON file."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvferry.bench import BenchError, make_spec, run_bench
from kvferry.bench.report import results_table, to_json, write_json
from kvferry.bench.transfer_bench import DTYPES
from kvferry.formats.synthetic import MODELS

TRANSFER_EXAMPLES = """\
examples:
  kvferry bench transfer                                   # llama3-8b, 4096 tokens, store + retrieve
  kvferry bench transfer --model deepseek-v3-mla           # 64-token blocks, format NL_X_NB_BS_HS
  kvferry bench transfer --format all --tokens 1024        # every MHA layout
  kvferry bench transfer --layers 28 --heads 4 --head-size 128 --format 2 --direction h2d
  kvferry bench transfer --device cuda --tokens 16384 --json bench-out/transfer.json
"""


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
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
    run = parser.add_argument_group("request")
    run.add_argument("--tokens", type=int, default=4096, help="tokens per transfer (default: %(default)s)")
    run.add_argument(
        "--chunk-size", type=int, default=256, metavar="TOKENS", help="tokens per chunk object (default: %(default)s)"
    )
    run.add_argument("--direction", default="both", choices=["d2h", "h2d", "both"], help="d2h = store, h2d = retrieve")
    run.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "triton", "reference"],
        help="copy implementation (auto: torch on cpu, triton on cuda)",
    )
    run.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine's KV lives")
    run.add_argument("--repeats", type=int, default=7, help="timed runs per case; medians are reported")
    run.add_argument("--seed", type=int, default=0, help="seed of the random data and block ids")
    parser.add_argument("--json", metavar="PATH", help="also write machine-readable results here")


def run_transfer(args: argparse.Namespace, argv: list[str], console: Console) -> int:
    """Exit status 2 for options that cannot run, 1 when a backend disagrees with the reference."""
    errors = Console(stderr=True)
    try:
        spec = make_spec(
            model=args.model,
            layers=args.layers,
            heads=args.heads,
            head_size=args.head_size,
            formats=args.format,
            direction=args.direction,
            tokens=args.tokens,
            chunk_size=args.chunk_size,
            block_size=args.block_size,
            backend=args.backend,
            device=args.device,
            dtype=args.dtype,
            repeats=args.repeats,
            seed=args.seed,
        )
    except BenchError as exc:
        errors.print(f"kvferry bench transfer: error: {exc}", markup=False, highlight=False)
        return 2
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=errors,
        transient=True,
    )
    try:
        with progress:
            task = progress.add_task("setting up", total=spec.steps)
            results = run_bench(spec, lambda what: progress.update(task, advance=1, description=what))
    except BenchError as exc:
        errors.print(f"kvferry bench transfer: {exc}", markup=False, highlight=False)
        return 1
    console.print(results_table(spec, results))
    if args.json:
        write_json(args.json, to_json(spec, results, ["kvferry", *argv]))
        console.print(f"results written to {args.json}", markup=False, highlight=False)
    return 0
