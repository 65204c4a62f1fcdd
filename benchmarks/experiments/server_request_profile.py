"""Question: where does a request through `kvferry server` spend the time beyond what the cache engine itself takes?

Answer (2026-12-01, H200 host, 7cb8832): outside the server. PING: client p50 251 us, the server's own time 36 us
(a bare ZMQ round trip there: 69 us); LOOKUP of 256 tokens: 297 / 77 us. The server's threads sit in their poll;
the client's caller waits on its future while its I/O thread polls: the hops between threads (the caller, the
client's I/O thread, ZMQ's I/O threads, the server's loop) cost ~150 us a request on that host.

Runs a server (its own process, as users run it) and, in this process, phases of PING, LOOKUP, one-chunk STORE and
one-chunk RETRIEVE (llama3-8b geometry; KV on the GPU when there is one). For each phase it prints the client's
p50, the server's own mean time from receiving a request to queueing its reply (its Prometheus histogram), and,
where py-spy is installed, the hottest stacks of the server and of this client while the phase runs (written to
OUT/profile_<phase>_<who>.txt, beside py-spy's collapsed stacks in .raw).

    PYTHONPATH=src python3 benchmarks/experiments/server_request_profile.py OUT [seconds per phase] [--ipc]
        [--rate HZ]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from kvferry.client import KvferryClient
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_means(http: str) -> dict[str, float]:
    """Mean server-side seconds per op, from its histogram's sum and count."""
    text = urllib.request.urlopen(f"{http}/metrics").read().decode()
    sums = dict(re.findall(r'kvferry_server_request_seconds_sum\{op="(\w+)"\} (\S+)', text))
    counts = dict(re.findall(r'kvferry_server_request_seconds_count\{op="(\w+)"\} (\S+)', text))
    return {op: float(sums[op]) / float(counts[op]) for op in sums if float(counts.get(op, 0))}


def top_stacks(raw: Path, n: int = 25) -> str:
    """The `n` commonest innermost-four-frame stacks of a py-spy raw (collapsed) file."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        counts[" ; ".join(frames[-4:])] += int(samples)
    total = sum(counts.values()) or 1
    return "\n".join(f"{c * 100 / total:5.1f}%  {s}" for s, c in counts.most_common(n))


def profiled(pid: int, seconds: float, out: Path, rate: int) -> subprocess.Popen[bytes] | None:
    if shutil.which("py-spy") is None:
        return None
    cmd = ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-f", "raw", "-o", str(out), "-r", str(rate)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("seconds", type=float, nargs="?", default=4.0)
    parser.add_argument("--ipc", action="store_true", help="through the server's Unix socket")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    args = parser.parse_args()
    out, seconds = args.out, args.seconds
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvferry.server", "--port", str(port), "--http-port", str(http_port)]
    endpoint = f"tcp://127.0.0.1:{port}"
    if args.ipc:
        endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvf-')}/server.sock"
        cmd += ["--ipc", endpoint.removeprefix("ipc://")]
    server = subprocess.Popen([*cmd, "--chunk-size", "256", "--l1-size-gb", "4"], stderr=subprocess.PIPE, text=True)
    atexit.register(server.kill)  # also when this script fails: the server holds this process's stdout
    assert server.stderr is not None
    for line in server.stderr:
        if "ready" in line:
            break
    threading.Thread(target=server.stderr.read, daemon=True).start()
    http = f"http://127.0.0.1:{http_port}"
    kv = make_paged(FMT, MODELS["llama3-8b"], 1024, 16, device=device)
    client = KvferryClient(endpoint, timeout_s=60)
    reg = client.register_kv_cache(kv, FMT, block_size=16, namespace={"model": "profile"})
    perm = torch.randperm(1024).tolist()
    ids, ids16 = perm[:16], perm[:256]
    fresh, fresh16 = iter(range(10**9)), iter(range(10**5))

    def new_tokens16() -> list[int]:
        base = 2**31 + next(fresh16) * 4096
        return list(range(base, base + 4096))

    kept, kept16 = list(range(256)), list(range(10**6, 10**6 + 4096))
    phases: dict[str, Callable[[], object]] = {
        "ping": client.ping,
        "lookup": lambda: client.lookup(kept, registration=reg),
        "store_1chunk": lambda: client.store(reg, [next(fresh) * 1000 + i for i in range(256)], ids),
        "retrieve_1chunk": lambda: client.retrieve(reg, kept, ids[::-1]),
        "store_16chunk": lambda: client.store(reg, new_tokens16(), ids16),
        "retrieve_16chunk": lambda: client.retrieve(reg, kept16, ids16[::-1]),
    }
    print(f"device {device}; {seconds:.0f} s per phase")
    for name, call in phases.items():
        client.store(reg, kept, ids)  # the stores before may have evicted it: lookups and retrieves must hit
        client.store(reg, kept16, ids16)
        for _ in range(20):
            call()
        before = server_means(http)
        spies = [profiled(server.pid, seconds, out / f"profile_{name}_server.raw", args.rate),
                 profiled(os.getpid(), seconds, out / f"profile_{name}_client.raw", args.rate)]  # fmt: skip
        samples, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t)
        for spy in spies:
            if spy is not None:
                spy.wait(timeout=60)
        after = server_means(http)
        op = name.split("_")[0].upper()
        server_us = after.get(op, 0.0) * 1e6
        print(f"{name}: client p50 {statistics.median(samples) * 1e6:.0f} us over {len(samples)} requests; "
              f"server mean (received -> reply queued, all so far) {server_us:.0f} us; before this phase "
              f"{before.get(op, 0.0) * 1e6:.0f} us", flush=True)  # fmt: skip
        for who in ("server", "client"):
            raw = out / f"profile_{name}_{who}.raw"
            if raw.exists():
                (out / f"profile_{name}_{who}.txt").write_text(top_stacks(raw))
    client.close()
    server.terminate()
    server.wait(timeout=30)


if __name__ == "__main__":
    main()
