"""`kvferry server` over loopback: request rate and latency of PING, LOOKUP and one-chunk STORE/RETRIEVE.

    python benchmarks/bench_server.py [--requests 2000] [--transfers 300] [--model qwen2.5-0.5b]
                                      [--device cpu|cuda] [--out bench-out/bench_server.json]

The server runs in its own process (`python -m kvferry.server`), the client in this one, as an engine would.
Cases (each a bounded number of requests):
  zmq_floor        a bare ZMQ ROUTER echo in another process, same frames as PING: what loopback costs here
  ping             round trip of the smallest request through the client library and the server
  lookup           LOOKUP of a 4096-token prompt whose 16 chunks all hit
  lookup_x32       the same with 32 requests in flight (futures): throughput, not latency
  store_1chunk     STORE of one new 256-token chunk from scattered blocks (a new prefix each time)
  retrieve_1chunk  RETRIEVE of one cached chunk into scattered blocks
  store/retrieve_16chunks  the same for 16 chunks (4096 tokens): GB/s of the server-side copy
Latencies are client-side wall times per request; `engine_us` is the same store/retrieve through a
CacheEngine in this process (no server), so the difference is what the server adds. With --device cuda the
engine's KV is on the GPU (registered by CUDA IPC) and `memcpy_gbps` is a same-run pinned-host <-> GPU
copy of the same bytes, the ceiling for the GB/s columns.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
from rich.console import Console
from rich.table import Table

import kvferry
from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.server.protocol import Op, encode_request

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
CHUNK, BS, NB = 256, 16, 1024
PER_CHUNK = CHUNK // BS
NAMESPACE = {"model": "bench", "salt": "bench_server"}


class ServerProcess:
    def __init__(self, pool_gb: float) -> None:
        src = str(Path(kvferry.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "kvferry.server", "--port", "0", "--no-http", "--chunk-size", str(CHUNK)]
        cmd += ["--l1-size-gb", str(pool_gb), "--log-level", "INFO"]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:  # type: ignore[union-attr]
            match = re.search(r"ready: zmq=(tcp://\S+)", line)
            if match:
                self.endpoint = match.group(1)
                break
        else:
            raise RuntimeError("the server exited before it was ready")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)


def _echo(ports: Any) -> None:
    """A bare ROUTER that echoes every message: the floor under every latency measured here."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    ports.put(router.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        router.send_multipart(router.recv_multipart())


def zmq_floor(n: int) -> dict[str, float]:
    spawn = multiprocessing.get_context("spawn")
    ports = spawn.Queue()
    echo = spawn.Process(target=_echo, args=(ports,), daemon=True)
    echo.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{ports.get(timeout=60)}")
    frame = encode_request(Op.PING, 1, {})
    try:
        return percentiles(timed(n, lambda i: (dealer.send(frame), dealer.recv()), lambda: None))
    finally:
        dealer.close(linger=0)
        ctx.term()
        echo.terminate()


def percentiles(samples_s: list[float]) -> dict[str, float]:
    us = np.array(samples_s) * 1e6
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "req_per_s": float(len(us) / (us.sum() / 1e6)),
    }


def timed(n: int, call: Callable[[int], Any], sync: Callable[[], None]) -> list[float]:
    samples = []
    for i in range(n):
        start = time.perf_counter()
        call(i)
        sync()
        samples.append(time.perf_counter() - start)
    return samples


def memcpy_gbps(nbytes: int, device: str) -> float | None:
    if device != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times)) / 1e9


Mover = Callable[[list[int], list[int]], Any]  # (tokens, block ids) -> None


def transfer_cases(store: Mover, retrieve: Mover, tokens: Callable[[int], list[int]], args, sync) -> dict[str, Any]:
    """Time `store` of new prefixes, then `retrieve` of the last one, for one chunk and for 16."""
    rng = np.random.default_rng(1)

    def one_size(chunks: int) -> dict[str, Any]:
        n = args.transfers if chunks == 1 else max(10, args.transfers // 10)
        ids = [rng.permutation(NB)[: chunks * PER_CHUNK].tolist() for _ in range(8)]  # scattered blocks
        prefixes = [tokens(chunks) for _ in range(n)]
        return {
            f"store_{chunks}chunk": percentiles(timed(n, lambda i: store(prefixes[i], ids[i % 8]), sync)),
            f"retrieve_{chunks}chunk": percentiles(timed(n, lambda i: retrieve(prefixes[-1], ids[(i + 1) % 8]), sync)),
        }

    return {**one_size(1), **one_size(16)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    dims = MODELS[args.model]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    kv = make_paged(FMT, dims, NB, BS, dtype=torch.bfloat16, device=args.device, generator=generator)
    chunk_bytes = 2 * dims.nl * CHUNK * dims.nh * dims.hs * 2
    fresh = iter(range(10**9))

    def new_tokens(chunks: int) -> list[int]:
        base = next(fresh) * CHUNK * 16
        return list(range(base, base + chunks * CHUNK))

    server = ServerProcess(pool_gb=2.0)  # LRU makes room as the distinct prefixes pile up
    try:
        with KvferryClient(server.endpoint, timeout_s=120) as client:
            reg = client.register_kv_cache(kv, FMT, block_size=BS, namespace=NAMESPACE)
            cases = {"zmq_floor": zmq_floor(args.requests)}
            cases.update(request_cases(client, reg, new_tokens(16), args.requests))
            cases.update(
                transfer_cases(
                    lambda t, ids: client.store(reg, t, ids),
                    lambda t, ids: client.retrieve(reg, t, ids),
                    new_tokens,
                    args,
                    sync,
                )
            )
    finally:
        server.stop()
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 2.0}})
    with CacheEngine(config, name="bench-embedded") as engine:
        ns = engine.namespace_for("bench", FMT, kv, block_size=BS)
        embedded = transfer_cases(
            lambda t, ids: engine.store(t, kv, ids, FMT, namespace=ns, block_size=BS),
            lambda t, ids: engine.retrieve(t, kv, ids, FMT, namespace=ns, block_size=BS),
            new_tokens,
            args,
            sync,
        )
    for name, row in embedded.items():
        chunks = 1 if name.endswith("_1chunk") else 16
        cases[name]["gbps"] = chunks * chunk_bytes / (cases[name]["p50_us"] / 1e6) / 1e9
        cases[name]["engine_us"] = row["p50_us"]
    return {
        "chunk_bytes": chunk_bytes,
        "memcpy_16chunk_gbps": memcpy_gbps(16 * chunk_bytes, args.device),
        "cases": cases,
    }


def request_cases(client: KvferryClient, reg: int, prompt: list[int], n: int) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    client.store(reg, prompt, rng.permutation(NB)[: len(prompt) // BS].tolist())
    assert client.lookup(prompt, registration=reg).tokens == len(prompt)
    cases = {
        "ping": percentiles(timed(n, lambda i: client.ping(), lambda: None)),
        "lookup": percentiles(timed(n, lambda i: client.lookup(prompt, registration=reg), lambda: None)),
    }
    start = time.perf_counter()
    window: list[Any] = []
    for _ in range(n):
        window.append(client.lookup_async(prompt, registration=reg))
        if len(window) == 32:
            window.pop(0).result()
    for future in window:
        future.result()
    cases["lookup_x32"] = {"req_per_s": n / (time.perf_counter() - start)}
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per PING/LOOKUP case")
    parser.add_argument("--transfers", type=int, default=300, help="requests per one-chunk STORE/RETRIEVE case")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b", help="KV geometry")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engine's KV lives")
    parser.add_argument("--out", type=Path, default=Path("bench-out/bench_server.json"))
    args = parser.parse_args()
    result = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "model": args.model,
        "device": args.device,
        **run(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"kvferry server over loopback ({args.model}, KV on {args.device}, chunk {CHUNK} tokens)")
    for column in ("case", "req/s", "p50 us", "p99 us", "GB/s (p50)", "embedded engine p50 us"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for name, row in result["cases"].items():
        table.add_row(
            name,
            f"{row['req_per_s']:.0f}",
            *(f"{row[k]:.0f}" if k in row else "" for k in ("p50_us", "p99_us")),
            f"{row['gbps']:.2f}" if "gbps" in row else "",
            f"{row['engine_us']:.0f}" if "engine_us" in row else "",
        )
    Console(width=120).print(table)
    print(f"one chunk = {result['chunk_bytes'] / 2**20:.2f} MiB; wrote {args.out}")
    if result["memcpy_16chunk_gbps"] is not None:
        print(f"same-run pinned memcpy (GPU -> host) of 16 chunks: {result['memcpy_16chunk_gbps']:.1f} GB/s")


if __name__ == "__main__":
    main()
