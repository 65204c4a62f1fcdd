"""`kvferry bench server-engines`: several engine processes on one `kvferry server` at once, against one alone.

Each engine is a process of its own with its own KV and session, as vLLM workers are. Every round it makes a LOOKUP
of a cached 16-chunk prompt, a STORE of a new one-chunk prefix and a RETRIEVE of a cached chunk, then pauses
(--think-ms: the engine's forward pass). Every store and retrieve must return its tokens, and every retrieve must
leave the stored bytes in its blocks, poisoned before it (checked outside the timed calls: an engine that finds
otherwise fails the run). Engine 0 runs its rounds alone first, then every engine runs them at once
(all started together). Per op: the p50 and p99 alone, and together the median of the engines' p50s, the worst p50
and the worst p99; `slowdown` is together over alone (the worst engine's p50, and the worst p99). Transfers of the
engines share the host link: --think-ms sets how much of it they ask for.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive, require_cuda
from kvferry.bench.report import cell, new_table
from kvferry.bench.server_bench import CHUNK, FMT, NB, PER_CHUNK
from kvferry.bench.server_process import ServerProcess
from kvferry.bench.server_transfers import KVBlocks, check_tokens
from kvferry.formats.synthetic import MODELS

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench server-engines                                   # 4 engines, qwen2.5-0.5b geometry, CPU KV
  kvferry bench server-engines --engines 8 --device cuda --rounds 200
"""
OPS = ("lookup", "store_1chunk", "retrieve_1chunk")
START_TIMEOUT_S = 300.0
MAX_ROUNDS = 100_000  # an engine's runs keep their token ids apart below 10**8 (see `engine_main`)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=4, help="engine processes at once (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=100, help="rounds per engine (default: %(default)s)")
    parser.add_argument(
        "--think-ms", type=float, default=2.0, help="pause after each round, per engine (default: %(default)s)"
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="qwen2.5-0.5b", help="KV geometry (default: %(default)s)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engines' KV lives")
    parser.add_argument("--pool-gb", type=float, default=4.0, help="the server's host pool (default: %(default)s)")
    parser.add_argument("--ipc", action="store_true", help="engines connect through the server's Unix socket (no ZMQ)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "engines", "rounds")
    if args.rounds > MAX_ROUNDS:
        raise BenchError(f"--rounds must be at most {MAX_ROUNDS}, got {args.rounds}")
    if args.think_ms < 0 or args.pool_gb <= 0:
        raise BenchError("--think-ms must be >= 0 and --pool-gb positive")
    if args.device == "cuda":
        require_cuda("--device cuda")


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(3)
    with contextlib.ExitStack() as stack:
        ipc_path = None
        if args.ipc:
            ipc_path = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvferry-")), "server.sock")
        server = ServerProcess(pool_gb=args.pool_gb, ipc_path=ipc_path, chunk_size=CHUNK)
        steps.done("server started")
        ctx = mp.get_context("spawn")  # CUDA in children: never fork a process that may have touched it
        try:
            alone = _run_engines(ctx, server.endpoint, args, 1, run=0)[0]
            steps.done("one engine alone")
            together = _run_engines(ctx, server.endpoint, args, args.engines, run=1)
            steps.done(f"{args.engines} engines at once")
        finally:
            server.stop()
    rows = {}
    for op in OPS:
        p50s = [_pct(engine[op], 50) for engine in together]
        worst_p99 = max(_pct(engine[op], 99) for engine in together)
        row = {
            "alone_p50_us": _pct(alone[op], 50),
            "alone_p99_us": _pct(alone[op], 99),
            "together_p50_us": statistics.median(p50s),
            "together_worst_p50_us": max(p50s),
            "together_worst_p99_us": worst_p99,
        }
        row["slowdown_p50"] = row["together_worst_p50_us"] / row["alone_p50_us"]
        row["slowdown_p99"] = worst_p99 / row["alone_p99_us"]
        rows[op] = row
    config = {key: getattr(args, key) for key in ("engines", "rounds", "think_ms", "model", "device", "pool_gb", "ipc")}
    return Outcome(config, {"ops": rows}, _show(args, rows), device=args.device)


def _run_engines(ctx: Any, endpoint: str, args: argparse.Namespace, n: int, run: int) -> list[dict[str, list[float]]]:
    """Start `n` engine processes, let them all go at once, and gather each one's latencies (seconds per op)."""
    ready, go, results = ctx.Barrier(n + 1), ctx.Event(), ctx.Queue()
    spec = EngineSpec(endpoint, args.model, args.device, args.rounds, args.think_ms / 1e3, run)
    procs = [ctx.Process(target=engine_main, args=(i, spec, ready, go, results), daemon=True) for i in range(n)]
    for proc in procs:
        proc.start()
    try:
        ready.wait(timeout=START_TIMEOUT_S)
        go.set()
        got = [results.get(timeout=START_TIMEOUT_S + args.rounds * 10) for _ in range(n)]
    except Exception as exc:
        raise BenchError(f"an engine process did not finish ({type(exc).__name__}: {exc})") from exc
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [r["error"] for r in got if "error" in r]
    if errors:
        raise BenchError(f"an engine failed: {errors[0]}")
    return [r["latencies"] for r in sorted(got, key=lambda r: r["engine"])]


@dataclass(frozen=True)
class EngineSpec:
    """What every engine process of a run is told (picklable: the processes are spawned)."""

    endpoint: str
    model: str
    device: str
    rounds: int
    think_s: float  # between rounds
    # Which run of the server's (one engine alone, then all together): each stores prefixes of its own, as a
    # store of chunks the server holds already would copy nothing (and return 0 tokens)
    run: int = 0


def engine_main(index: int, spec: EngineSpec, ready: Any, go: Any, results: Any) -> None:
    """One engine process: register its KV, cache what its lookups and retrieves hit, wait for the start, run.
    `ready` and `go` line the engines up (a barrier, an event); `results` gets its latencies or its error."""
    import torch

    from kvferry.client import KvferryClient
    from kvferry.formats.synthetic import make_paged

    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    try:
        kv = make_paged(FMT, MODELS[spec.model], NB, 16, dtype=torch.bfloat16, device=spec.device)
        rng = np.random.default_rng(index)
        base = (index + 1) * 10**8 + spec.run * MAX_ROUNDS * CHUNK
        prompt = list(range(base, base + 16 * CHUNK))  # its own: the engines' prompts differ
        blocks = KVBlocks(kv, seed=index)
        namespace = {"model": "bench", "salt": "engines", "codec": "none"}  # objects hold the engine's bytes
        with KvferryClient(spec.endpoint, timeout_s=120) as client:
            reg = client.register_kv_cache(kv, FMT, block_size=16, namespace=namespace)
            prompt_ids = rng.permutation(NB)[: 16 * PER_CHUNK].tolist()
            check_tokens("the prompt's store", client.store(reg, prompt, prompt_ids), len(prompt))
            first_chunk = blocks.read(prompt_ids[:PER_CHUNK])  # what every retrieve brings back
            ready.wait(timeout=START_TIMEOUT_S)
            go.wait(timeout=START_TIMEOUT_S)
            for r in range(spec.rounds):
                ids = rng.permutation(NB)[:PER_CHUNK].tolist()
                fresh = list(range(base + (16 + r) * CHUNK, base + (17 + r) * CHUNK))  # a new prefix each round
                started = time.perf_counter()
                client.lookup(prompt, registration=reg)
                latencies["lookup"].append(time.perf_counter() - started)
                started = time.perf_counter()
                stored = client.store(reg, fresh, ids)
                latencies["store_1chunk"].append(time.perf_counter() - started)
                check_tokens(f"round {r}'s store", stored, CHUNK)
                blocks.poison(ids)
                started = time.perf_counter()
                retrieved = client.retrieve(reg, prompt[:CHUNK], ids)
                latencies["retrieve_1chunk"].append(time.perf_counter() - started)
                check_tokens(f"round {r}'s retrieve", retrieved, CHUNK)
                blocks.check(f"round {r}'s retrieve", ids, first_chunk)
                time.sleep(spec.think_s)
        results.put({"engine": index, "latencies": latencies})
    except BaseException as exc:  # reported to the parent, which names it
        results.put({"engine": index, "error": f"{type(exc).__name__}: {exc}"})


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples) * 1e6, q))


def _show(args: argparse.Namespace, rows: dict[str, dict[str, float]]) -> list[Any]:
    table = new_table(
        f"{args.engines} engines on one kvferry server ({args.model}, KV on {args.device}, {args.rounds} rounds, "
        f"{args.think_ms:g} ms between rounds)",
        ("op", "alone p50 / p99 us", "together p50 (median / worst) us", "worst p99 us", "slowdown p50 / p99"),
    )
    for op, row in rows.items():
        table.add_row(
            op,
            f"{row['alone_p50_us']:.0f} / {row['alone_p99_us']:.0f}",
            f"{row['together_p50_us']:.0f} / {row['together_worst_p50_us']:.0f}",
            cell(row["together_worst_p99_us"], ".0f"),
            f"{row['slowdown_p50']:.2f} / {row['slowdown_p99']:.2f}",
        )
    return [table]
