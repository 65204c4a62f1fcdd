"""Question: where, between the engine's call and its return, does a STORE/RETRIEVE through `kvferry server` spend
its time, stage by stage, against the same call on an in-process `CacheEngine`?

Runs a server in a child process with probes on its stages (request read, worker started, copy enqueued, copy
waited for, reply handed to the socket loop, reply sent) and this process as its client with probes on the client's
send and reply read. Both sides stamp CLOCK_MONOTONIC (one clock for every process of the host), so each request's
stages line up. Prints, per case, the median microseconds after the call of every stage, and the call's p50 with and
without a plain memcpy of the same bytes between requests (as `kvferry bench server` times them).

    PYTHONPATH=src python3 benchmarks/experiments/server_timeline.py [--model llama3-8b] [--reps 60] [--busy-poll-us N]
        [--ipc]

Answer (2026-12-01, H200 host, 1c3a8fd with probes on every stage up to the enqueue): a one-chunk llama3-8b STORE
over the Unix socket left the client 68 us after the call, was read 104 us later (the socket thread's wake-up), was
decoded and checked by 238, ordered after the client's work by 344 (88 us, ~70 of them entering `torch.cuda.stream`;
57 with `set_stream`), and its copy enqueued from 429 to 638 (the engine's `submit`, 186 us in process too).

At bce93fd (2026-12-02, H200 host): the same STORE left the client at 100 us (its ready event's record 23 of
them), was read at 147, decoded and validated by 230, ordered after the client's work by 312 (~50 us of torch
calls; the driver's since 72037e1), enqueued from 363 to 589, and returned at 1207 (0.533 of the memcpy; in
process 920, 0.695): ~260 us more than in process before the enqueue, in no single large piece.

Later the same day (#19-#21): between finding its registration and the cache's first step a STORE spent 83 us (one
chunk) and 151 us (16 chunks) against a RETRIEVE's 15 and 37: its order after the client's work, a stream made to
wait on the client's event and made current. Since b3ca4b0 the engine waits on the event itself
(`kvferry.transfer.ordered_after`): 17 and 31 us. The caller's `torch.cuda.synchronize()` after a call that had
returned (stamped `call_out`) took 47-120 us: a switch back to the client's context on the GPU.

Before (2026-12-01, H200 host, d79bcfb): a one-chunk llama3-8b RETRIEVE was read by the server 128 us after the
client sent it, reached a worker 95 us later, and its answer left the copy's end 350 us behind (worker -> socket
thread -> client): each hand-over between threads costs ~90-130 us of wake-up there. Since 7d79137 a GPU transfer
naming a done flag runs up to its enqueue on the socket thread and is answered there (0.52 against 0.38 of the
memcpy answered after the copy, same boot); the cases compare both ways.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

EVENTS: list[tuple[str, int]] = []


def stamp(name: str) -> None:
    EVENTS.append((name, time.monotonic_ns()))


def around(owner: Any, attr: str, before: str | None, after: str | None) -> None:
    """Wrap `owner.attr` so that it stamps `before` on entry and `after` on return."""
    inner = getattr(owner, attr)

    def probe(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        try:
            return inner(*args, **kwargs)
        finally:
            if after:
                stamp(after)

    setattr(owner, attr, probe)


def install_engine_probes() -> None:
    from kvferry.cache import engine, reader, writer
    from kvferry.memory import host_pool
    from kvferry.transfer import api, gpu_engine, handle

    around(engine.CacheEngine, "_geometry", "geometry_in", "geometry_out")
    around(engine, "check_block_ids", "block_ids_in", "block_ids_out")
    around(host_pool.HostPool, "try_reserve_many", "reserve_in", "reserve_out")
    around(writer, "transfer_pool_at_async", "enqueue_in", "enqueued")
    around(writer, "copy_chunks", "enqueue_in", "enqueued")
    around(reader, "copy_chunks", "enqueue_in", "enqueued")
    around(api, "check_pool_addresses", "addresses_in", "addresses_out")
    around(gpu_engine.TransferEngine, "submit", "submit_in", "submit_out")
    around(handle.TransferHandle, "wait", "wait_in", "wait_out")


def serve(out: str, argv: list[str]) -> int:
    """The server, probed; its events go to `out` when it exits."""
    from kvferry.server import runner, server, sessions, transfers, unix_clients
    from kvferry.server.app import run_from_command_line

    install_engine_probes()
    around(unix_clients.UnixClients, "_read", "read_in", None)
    around(unix_clients, "take_frames", None, "framed")
    around(server, "decode_request", "decode_in", "decode_out")
    around(runner, "parse_args", "parse_in", "parse_out")
    around(sessions.SessionTable, "settle", "settle_in", "settle_out")
    around(sessions.SessionTable, "use_registration", "registration_in", "registration_out")
    around(server.KvferryServer, "_accept", "accept", None)
    around(runner.RequestRunner, "_run_on_worker", "worker", None)  # a transfer run on a worker from its start
    around(runner.RequestRunner, "_finish_transfer", "worker", None)  # or finished there after the socket thread
    around(transfers.Transfers, "run", "handler_in", "handler_out")
    around(transfers.Transfers, "start", "handler_in", "answered")
    around(server.KvferryServer, "_send_from_worker", None, "pushed")
    around(server.KvferryServer, "_forward_replies", None, "forwarded")
    atexit.register(lambda: Path(out).write_text(json.dumps(EVENTS)))
    return run_from_command_line(argv)


STAGES = ["pack_in", "pack_out", "ready_in", "ready_out", "encode_in", "encode_out", "sent", "read_in", "framed",
          "accept", "decode_in", "decode_out", "parse_in", "parse_out", "handler_in", "settle_in", "settle_out",
          "registration_in", "registration_out", "geometry_in", "geometry_out", "block_ids_in", "block_ids_out",
          "reserve_in", "reserve_out", "enqueue_in", "addresses_in", "addresses_out", "submit_in", "submit_out",
          "enqueued", "answered", "worker", "wait_in", "wait_out", "handler_out", "pushed", "forwarded",
          "reply_read", "flag_wait", "flag_seen", "call_out", "return"]  # fmt: skip


def timeline(calls: list[tuple[int, int]], events: list[tuple[str, int]]) -> dict[str, float]:
    """Median microseconds after the call of each stage's first stamp within the call."""
    events = sorted(events, key=lambda e: e[1])
    per_stage: dict[str, list[float]] = {s: [] for s in STAGES}
    j = 0
    for start, end in calls:
        while j < len(events) and events[j][1] < start:
            j += 1
        seen: dict[str, int] = {}
        k = j
        while k < len(events) and events[k][1] <= end:
            seen.setdefault(events[k][0], events[k][1])
            k += 1
        seen["return"] = end
        for stage, t in seen.items():
            if stage in per_stage:
                per_stage[stage].append((t - start) / 1e3)
    return {s: statistics.median(v) for s, v in per_stage.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--json")
    parser.add_argument("--busy-poll-us", default="0", help="the server's --busy-poll-us")
    parser.add_argument("--ipc", action="store_true", help="connect through the server's Unix socket")
    args = parser.parse_args()

    from kvferry.bench.timing import CopyCeiling
    from kvferry.cache import CacheEngine
    from kvferry.client import KvferryClient, connection
    from kvferry.client.done_flags import DoneFlags
    from kvferry.client.link import Link
    from kvferry.config import KvferryConfig
    from kvferry.formats import EngineKVFormat
    from kvferry.formats.synthetic import MODELS, make_paged

    fmt, chunk, bs, nb = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 256, 16, 1024
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dims = MODELS[args.model]
    kv = make_paged(fmt, dims, nb, bs, dtype=torch.bfloat16, device=device)
    chunk_bytes = 2 * dims.nl * chunk * dims.nh * dims.hs * 2
    events_file = tempfile.mktemp(suffix=".json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, __file__, "--serve", events_file, "--port", "0", "--no-http", "--chunk-size", str(chunk),
           "--l1-size-gb", "4", "--busy-poll-us", args.busy_poll_us]  # fmt: skip
    if args.ipc:
        cmd += ["--ipc", os.path.join(tempfile.mkdtemp(prefix="kvf-"), "server.sock")]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    endpoint = ""
    for line in proc.stderr:
        if "ready: zmq=" in line:
            endpoint = line.split(" ipc=")[1].split()[0] if args.ipc else line.split("ready: zmq=")[1].split()[0]
            break
    threading.Thread(target=proc.stderr.read, daemon=True).start()

    install_engine_probes()
    from kvferry.client import client as client_module
    from kvferry.client.ready_events import ReadyEvents

    around(client_module, "pack_ids", "pack_in", "pack_out")
    around(ReadyEvents, "record", "ready_in", "ready_out")
    around(connection, "encode_request", "encode_in", "encode_out")
    around(Link, "send", None, "sent")
    around(DoneFlags, "wait", "flag_wait", "flag_seen")
    take = connection.Connection._take_replies

    def take_replies(self: Any, link: Any) -> Any:
        got = take(self, link)
        if got:
            stamp("reply_read")
        return got

    connection.Connection._take_replies = take_replies  # type: ignore[method-assign]

    fresh = iter(range(1, 10**9))

    def tokens(n: int) -> list[int]:
        base = next(fresh) * chunk * 16
        return list(range(base, base + n * chunk))

    perm = torch.randperm(nb).tolist()
    results: dict[str, Any] = {"device": device, "model": args.model, "cases": {}}

    def run_case(name: str, call: Callable[[list[int], list[int]], Any], chunks: int, store: bool,
                 copy: CopyCeiling | None, warm: Callable[[list[int], list[int]], Any]) -> None:  # fmt: skip
        """`reps` calls, each on new tokens (a store) or on tokens `warm` stored first (a retrieve)."""
        ids = perm[: chunks * chunk // bs]
        kept = tokens(chunks)
        warm(kept, ids)
        reps = args.reps if chunks == 1 else max(10, args.reps // 4)
        calls: list[tuple[int, int]] = []
        for _ in range(reps):
            t = tokens(chunks) if store else kept
            sync()
            start = time.monotonic_ns()
            call(t, ids)
            stamp("call_out")  # what follows is the caller's sync (a memcpy's ceiling includes one too)
            sync()
            calls.append((start, time.monotonic_ns()))
            if copy is not None:
                copy.time_once()
        results["cases"][name] = {"calls": calls, "chunks": chunks, "memcpy_us": copy.best()[1] * 1e6 if copy else None}

    ceilings = {(c, d): CopyCeiling(torch.device(device), c * chunk_bytes, d) for c in (1, 16) for d in ("d2h", "h2d")}
    with KvferryClient(endpoint, timeout_s=120) as client:
        reg = client.register_kv_cache(kv, fmt, block_size=bs, namespace={"model": "timeline"})

        flags = dict(client._done_flags)
        for chunks in (1, 16):
            for signalled in (True, False):  # done flags (answered at enqueue), or answered after the copy
                client._done_flags.clear()
                client._done_flags.update(flags if signalled else {})
                tag = f"{chunks}chunk{'' if signalled else ' answered after the copy'}"
                store = lambda t, i: client.store(reg, t, i)  # noqa: E731
                run_case(f"server store {tag}", store, chunks, True, ceilings[chunks, "d2h"], store)
                run_case(f"server retrieve {tag}", lambda t, i: client.retrieve(reg, t, i), chunks, False,
                         ceilings[chunks, "h2d"], store)  # fmt: skip
    proc.terminate()
    proc.wait(timeout=60)
    server_events = [(str(name), int(t)) for name, t in json.loads(Path(events_file).read_text())]
    os.unlink(events_file)
    client_events = list(EVENTS)
    EVENTS.clear()

    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": chunk, "l1_size_gb": 4}})
    with CacheEngine(config, name="timeline") as engine:
        ns = engine.namespace_for("timeline", fmt, kv, block_size=bs)

        def engine_store(t: list[int], ids: list[int]) -> None:
            engine.store(t, kv, ids, fmt, namespace=ns, block_size=bs)

        for chunks in (1, 16):
            run_case(f"in-process store {chunks}chunk", engine_store, chunks, True, ceilings[chunks, "d2h"],
                     engine_store)  # fmt: skip
            run_case(f"in-process retrieve {chunks}chunk",
                     lambda t, i: engine.retrieve(t, kv, i, fmt, namespace=ns, block_size=bs), chunks, False,
                     ceilings[chunks, "h2d"], engine_store)  # fmt: skip
    inproc_events = list(EVENTS)

    for name, case in results["cases"].items():
        events = (server_events + client_events) if name.startswith("server") else inproc_events
        case["stages_us"] = timeline(case["calls"], events)
        durations = [(e - s) / 1e3 for s, e in case["calls"]]
        case["p50_us"] = statistics.median(durations)
        memcpy = case["memcpy_us"]
        ratio = f" ratio {memcpy / case['p50_us']:.3f} (memcpy {memcpy:.0f} us)" if memcpy else ""
        print(f"{name}: p50 {case['p50_us']:.0f} us{ratio}")
        print("   " + "  ".join(f"{s} {v:.0f}" for s, v in case["stages_us"].items()), flush=True)
        del case["calls"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], sys.argv[3:]))
    main()
