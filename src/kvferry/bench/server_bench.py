"""`kvferry bench server`: `kvferry server` over loopback: request rate and latency of PING, LOOKUP and STORE/RETRIEVE.

The server runs in its own process (`python -m kvferry.server`), the client in this one, as an engine would.
Cases (each a bounded number of requests):
  floor            a bare echo in another process, same frames as PING: what the transport costs here (a ZMQ
                   ROUTER over loopback TCP; with --ipc, a plain Unix socket as the server's)
  ping             round trip of the smallest request through the client library and the server
  lookup           LOOKUP of a 4096-token prompt whose 16 chunks all hit
  lookup_x32       the same with 32 requests in flight (futures): throughput, not latency
  store_1chunk     STORE of one new 256-token chunk from scattered blocks (a new prefix each time)
  retrieve_1chunk  RETRIEVE of one cached chunk into scattered blocks
  store/retrieve_16chunks  the same for 16 chunks (4096 tokens): GB/s of the server-side copy
Every store and retrieve is checked: the tokens it returns, and the bytes a retrieve leaves in its blocks
(poisoned before it), outside the timed region (`server_transfers`); a wrong one fails the run.
Latencies are client-side wall times per request; `engine_us` is the same store/retrieve through a
CacheEngine in this process (no server), so the difference is what the server adds. Every store/retrieve
alternates with a plain copy of its bytes between the same memories (on the CPU the faster of numpy.copyto and
torch copy_; with --device cuda, where the engine's KV is on the GPU and registered by CUDA IPC, a pinned
host <-> GPU copy_): `ratio` is that copy's median time over the request's p50.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq

from kvferry.bench.event_follower import EventFollower
from kvferry.bench.harness import (
    BenchError,
    Outcome,
    Steps,
    add_json_argument,
    description_of,
    positive,
    require_cuda,
)
from kvferry.bench.report import cell, new_table
from kvferry.bench.server_process import ServerProcess, add_busy_poll_argument, check_busy_poll
from kvferry.bench.server_transfers import KVBlocks, transfer_cases
from kvferry.bench.timing import CopyCeiling, latency_summary
from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.protocol.messages import Op, encode_request
from kvferry.protocol.unix_framing import frame
from kvferry.security import ClientCurve

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
CHUNK, BS, NB = 256, 16, 1024
PER_CHUNK = CHUNK // BS
NAMESPACE = {"model": "bench", "salt": "bench_server", "codec": "none"}  # objects hold the engine's bytes

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench server                                     # qwen2.5-0.5b geometry, KV in shared memory
  kvferry bench server --requests 500 --transfers 50 --json bench-out/server.json
  kvferry bench server --device cuda --model llama3-8b --requests 300 --transfers 50
  kvferry bench server --curve                             # CURVE on the request socket: what it costs
  kvferry bench server --events                            # the server publishes KV events: what they cost
"""


# A bare echo of every message, in a process of its own: the floor under every latency measured here. A ZMQ
# ROUTER, or with a path a plain Unix stream socket (whole frames arrive in one read at these sizes). Plain pyzmq
# and sockets, so that it starts in a fraction of a second (no torch, no kvferry).
_ECHO = """
import socket, sys, zmq
if sys.argv[1:]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen()
    print(f"ipc://{sys.argv[1]}", flush=True)
    conn, _ = listener.accept()
    while data := conn.recv(1 << 16):
        conn.sendall(data)
router = zmq.Context().socket(zmq.ROUTER)
print(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}", flush=True)
while True:
    router.send_multipart(router.recv_multipart())
"""


def transport_floor(n: int, ipc_path: str | None = None) -> dict[str, float]:
    """A bare round trip over loopback TCP through ZMQ, or over a plain Unix socket at `ipc_path`."""
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, *([ipc_path] if ipc_path else [])], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    request = encode_request(Op.PING, 1, {})
    try:
        assert echo.stdout is not None
        endpoint = echo.stdout.readline().strip()
        if "://" not in endpoint:
            raise BenchError("the bare echo process did not start")
        if ipc_path is not None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
                unix.connect(ipc_path)
                framed = frame(request)

                def round_trip(_: int) -> bytes:
                    unix.sendall(framed)
                    return unix.recv(1 << 16)

                return latency_summary(timed(n, round_trip))
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            return latency_summary(timed(n, lambda i: (dealer.send(request), dealer.recv())))
    finally:
        echo.kill()
        echo.wait()


def timed(n: int, call: Callable[[int], Any]) -> list[float]:
    samples = []
    for i in range(n):
        start = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - start)
    return samples


def request_cases(client: KvferryClient, reg: int, prompt: list[int], n: int, steps: Steps) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    client.store(reg, prompt, rng.permutation(NB)[: len(prompt) // BS].tolist())
    if client.lookup(prompt, registration=reg).tokens != len(prompt):
        raise BenchError("the server did not find the prompt it just stored")
    cases = {"ping": latency_summary(timed(n, lambda i: client.ping()))}
    steps.done("ping")
    cases["lookup"] = latency_summary(timed(n, lambda i: client.lookup(prompt, registration=reg)))
    steps.done("lookup")
    start = time.perf_counter()
    window: list[Any] = []
    for _ in range(n):
        window.append(client.lookup_async(prompt, registration=reg))
        if len(window) == 32:
            window.pop(0).result()
    for future in window:
        future.result()
    cases["lookup_x32"] = {"req_per_s": n / (time.perf_counter() - start)}
    steps.done("lookup_x32")
    return cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=int, default=2000, help="requests per PING/LOOKUP case (default: %(default)s)"
    )
    parser.add_argument(
        "--transfers",
        type=int,
        default=300,
        help="requests per one-chunk STORE/RETRIEVE case; a tenth (at least 10) for 16 chunks (default: %(default)s)",
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="qwen2.5-0.5b", help="KV geometry (default: %(default)s)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engine's KV lives")
    parser.add_argument(
        "--pool-gb",
        type=float,
        default=2.0,
        help="host pool of the server and of the in-process engine; LRU makes room as prefixes pile up "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--ipc",
        action="store_true",
        help="connect through the server's Unix socket (its --ipc: no ZMQ) instead of loopback TCP; the floor too",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="CURVE on the request socket (throwaway keys of the server and the client): what authentication "
        "and encryption cost; the floor stays a bare socket",
    )
    parser.add_argument(
        "--events",
        action="store_true",
        help="the server publishes its KV events, followed by a subscriber in another process (as a router "
        "would): what events cost; a run whose subscriber received no stored chunk fails",
    )
    add_busy_poll_argument(parser)
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "requests", "transfers")
    check_busy_poll(args)
    if args.pool_gb <= 0:
        raise BenchError(f"--pool-gb must be positive, got {args.pool_gb}")
    if args.device == "cuda":
        require_cuda("--device cuda")
    if args.curve and args.ipc:
        raise BenchError("--curve is for the TCP socket: the Unix socket (--ipc) has no CURVE (its file mode decides)")


def _server_cases(
    endpoint: str,
    kv: Any,
    floor: dict[str, float],
    args: argparse.Namespace,
    new_tokens: Callable[[int], list[int]],
    steps: Steps,
    ceiling: Callable[[int, str], CopyCeiling],
    curve: ClientCurve | None,
) -> dict[str, Any]:
    """Every case through the server at `endpoint`, after the bare ZMQ `floor` measured over the same transport."""
    with KvferryClient(endpoint, timeout_s=120, curve=curve) as client:
        reg = client.register_kv_cache(kv, FMT, block_size=BS, namespace=NAMESPACE)
        cases = {"floor": floor}
        steps.done("floor")
        cases.update(request_cases(client, reg, new_tokens(16), args.requests, steps))
        cases.update(
            transfer_cases(
                lambda t, ids: client.store(reg, t, ids),
                lambda t, ids: client.retrieve(reg, t, ids),
                KVBlocks(kv),
                new_tokens,
                args.transfers,
                steps,
                "server",
                ceiling,
                args.device,
                NB,
                PER_CHUNK,
            )
        )
    return cases


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(1 + 4 + 4 + 4)
    dims = MODELS[args.model]
    generator = torch.Generator().manual_seed(0)
    kv = make_paged(FMT, dims, NB, BS, dtype=torch.bfloat16, device=args.device, generator=generator)
    chunk_bytes = 2 * dims.nl * CHUNK * dims.nh * dims.hs * 2
    fresh = iter(range(10**9))

    def new_tokens(chunks: int) -> list[int]:
        base = next(fresh) * CHUNK * 16
        return list(range(base, base + chunks * CHUNK))

    ceilings: dict[tuple[int, str], CopyCeiling] = {}

    def ceiling(chunks: int, direction: str) -> CopyCeiling:
        """A plain copy of `chunks` chunks' bytes between the memories of the transfer (kept across cases)."""
        key = (chunks, direction)
        if key not in ceilings:
            ceilings[key] = CopyCeiling(torch.device(args.device), chunks * chunk_bytes, direction)
        return ceilings[key]

    sockets = tempfile.TemporaryDirectory(prefix="kvferry-bench-") if args.ipc else contextlib.nullcontext(None)
    with sockets as socket_dir:
        ipc_path = os.path.join(socket_dir, "server.sock") if socket_dir else None
        security, curve = _throwaway_curve() if args.curve else (None, None)
        server = ServerProcess(
            pool_gb=args.pool_gb,
            busy_poll_us=args.busy_poll_us,
            chunk_size=CHUNK,
            ipc_path=ipc_path,
            security=security,
            events=args.events,
        )
        follower = EventFollower(*server.events_endpoints) if args.events else None  # type: ignore[arg-type]
        steps.done("server started")
        try:
            floor = transport_floor(args.requests, os.path.join(socket_dir, "echo.sock") if socket_dir else None)
            cases = _server_cases(server.endpoint, kv, floor, args, new_tokens, steps, ceiling, curve)
            events = follower.finish() if follower is not None else None
        finally:
            if follower is not None:
                follower.close()
            server.stop()
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": args.pool_gb}})
    with CacheEngine(config, name="bench-embedded") as engine:
        ns = engine.namespace_for("bench", FMT, kv, block_size=BS)
        embedded = transfer_cases(
            lambda t, ids: engine.store(t, kv, ids, FMT, namespace=ns, block_size=BS),
            lambda t, ids: engine.retrieve(t, kv, ids, FMT, namespace=ns, block_size=BS),
            KVBlocks(kv),
            new_tokens,
            args.transfers,
            steps,
            "embedded engine",
            ceiling,
            args.device,
            NB,
            PER_CHUNK,
        )
    for name, row in embedded.items():
        chunks = 1 if name.endswith("_1chunk") else 16
        cases[name]["gbps"] = chunks * chunk_bytes / (cases[name]["p50_us"] / 1e6) / 1e9
        cases[name]["engine_us"] = row["p50_us"]
        if "ratio" in row:
            cases[name]["engine_ratio"] = row["ratio"]
    results: dict[str, Any] = {"chunk_bytes": chunk_bytes}
    results["cases"] = cases
    if events is not None:
        results["events"] = events
    keys = ("model", "device", "requests", "transfers", "pool_gb", "busy_poll_us", "ipc", "curve", "events")
    config_json = {key: getattr(args, key) for key in keys}
    return Outcome(config_json | {"chunk_size": CHUNK}, results, _show(args, results), device=args.device)


def _throwaway_curve() -> tuple[dict[str, str], ClientCurve]:
    """The server's KVFERRY_SECURITY__ variables for CURVE with one allowed client, and that client's keys (new
    keys each run, passed in the child's environment: nothing is written)."""
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    grants = [{"model": NAMESPACE["model"], "salt": NAMESPACE["salt"]}]
    tenant = {"name": "bench", "public_key": public.decode(), "namespaces": grants}  # as a shared server's engines
    security = {
        "KVFERRY_SECURITY__CURVE_SECRET_KEY": server_secret.decode(),
        "KVFERRY_SECURITY__TENANTS": json.dumps([tenant]),
    }
    return security, ClientCurve(server_public=server_public, public=public, secret=secret)


def _show(args: argparse.Namespace, results: dict[str, Any]) -> list[Any]:
    table = new_table(
        f"kvferry server over loopback ({args.model}, KV on {args.device}, chunk {CHUNK} tokens)",
        ("case", "req/s", "p50 us", "p99 us", "GB/s (p50)", "ratio", "embedded engine p50 us (ratio)"),
    )
    for name, row in results["cases"].items():
        table.add_row(
            name,
            f"{row['req_per_s']:.0f}",
            cell(row.get("p50_us"), ".0f"),
            cell(row.get("p99_us"), ".0f"),
            cell(row.get("gbps"), ".2f"),
            cell(row.get("ratio"), ".3f"),
            f"{row['engine_us']:.0f}" + (f" ({row['engine_ratio']:.3f})" if "engine_ratio" in row else "")
            if "engine_us" in row
            else "",
        )
    ceiling = "a pinned host <-> GPU copy_" if args.device == "cuda" else "the faster of numpy.copyto and torch copy_"
    shown: list[Any] = [
        table,
        f"one chunk = {results['chunk_bytes'] / 2**20:.2f} MiB; ratio: the same bytes copied by {ceiling}, timed "
        "after each request (median) over the request's p50 (client call to reply)",
    ]
    if "events" in results:
        got = results["events"]
        shown.append(f"KV events on: a subscriber followed {got['last_seq'] + 1} batches ({got['gaps']} gaps), "
                     f"holding {got['held']['server']} chunks at the end")  # fmt: skip
    return shown
