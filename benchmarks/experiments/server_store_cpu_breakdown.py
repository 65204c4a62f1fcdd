"""Question: where does a 16-chunk STORE of CPU KV through `kvferry server` spend its time, against the same store
through a `CacheEngine` in the engine's process?

Answer (2026-12-01, CPU machine: AMD EPYC, 2 cores, AVX2; qwen2.5-0.5b geometry, 16 chunks = 48 MiB, 256 scattered
blocks, back-to-back stores of new prefixes; 2 runs): the client's p50 10.4-11.3 ms; the server's own time per STORE
(received to reply queued) 9.7-9.9 ms, of which the cache's copy 9.0 ms; the same store in process 8.0-8.1 ms (copy
included). So 0.7-1.4 ms is the round trip and the server's Python around the copy, and ~1 ms the copy itself being
slower in the server process than in the engine's, from the same shared-memory KV into a pool of the same size. A
plain copy of 48 MiB runs at ~9 GB/s here (~5.3 ms): the copy, in either process, is most of the gap to the 0.7 goal.

One chunk (2026-12-02, same machine, `... 6 1`, 2 runs): the client's p50 2.5-2.8 ms, the server's own time 2.0-2.2,
the cache's copy in the server 1.5-1.7 ms against 0.5 ms in process. In process on kvferry's own copy threads, as
the server runs them (`use_own_threads`, set by hand for a third and fourth run), the copy took 0.8-0.9 ms in one
run and 1.4 ms in another whose server copy took 1.2-1.6: most of a 3 MiB copy's extra time in the server is its
own-threads mode (a pool hand-off to Python threads instead of OpenMP's spinning ones); this machine's spread
between runs (2x) is too wide to say whether anything else adds to it. The server's Python around the copy ~0.5 ms.

After other work in the engine's process (2026-12-02, same machine, 0bd15c5, `... 4 16 numpy|torch`, 3 runs each,
alternating): each store followed by a plain copy of its bytes in the engine's process. After numpy's copy (one
thread) the server's copy took 9.5-9.9 ms (client p50 11.8-12.4); after torch's `copy_` (OpenMP threads, which spin
for milliseconds once done) 13.1-14.9 ms (client 16.4-18.4), and 9.5-10.9 ms (client 11.9-13.3, 3 runs) with
`OMP_WAIT_POLICY=PASSIVE` in the engine. In process the copy took 8.4-10.0 ms either way (8.6-10.6 passive). So an
engine whose torch ops spin takes the cores the server copies on: a server of CPU KV wants cores of its own.

    PYTHONPATH=src python3 benchmarks/experiments/server_store_cpu_breakdown.py [seconds] [chunks, default 16]
        [after each store: none (default), numpy or torch, a copy of its bytes in this process]
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
NB = 600  # 16 chunks of 256 tokens take 256 of the 600 blocks


def server_mean_s(http: str, op: str) -> float:
    text = urllib.request.urlopen(f"{http}/metrics").read().decode()
    total = float(re.search(rf'kvferry_server_request_seconds_sum\{{op="{op}"\}} (\S+)', text).group(1))
    count = float(re.search(rf'kvferry_server_request_seconds_count\{{op="{op}"\}} (\S+)', text).group(1))
    return total / count


def timed_stores(
    store: Callable[[list[int]], object],
    prefixes: Iterator[int],
    seconds: float,
    tokens_per_store: int,
    after: Callable[[], object],
) -> list[float]:
    """Seconds of each store of a new prefix, back to back for `seconds`, each followed by `after()` (not timed)."""
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        base = next(prefixes) * 100_000
        tokens = [base + i for i in range(tokens_per_store)]
        started = time.perf_counter()
        store(tokens)
        latencies.append(time.perf_counter() - started)
        after()
    return latencies


def other_work(kind: str, nbytes: int) -> Callable[[], object]:
    """What the engine's process does between stores: nothing, or a plain copy of `nbytes` by numpy or by torch."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    if kind == "numpy":
        src_np, dst_np = src.numpy(), dst.numpy()
        return lambda: np.copyto(dst_np, src_np)
    if kind == "torch":
        return lambda: dst.copy_(src)
    return lambda: None


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    tokens = 256 * (int(sys.argv[2]) if len(sys.argv) > 2 else 16)
    after = other_work(sys.argv[3] if len(sys.argv) > 3 else "none", tokens * 12 << 10)  # 12 KiB a qwen token
    cmd = [sys.executable, "-m", "kvferry.server", "--port", "0", "--http-port", "0", "--l1-size-gb", "1"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        ready = re.compile(r"ready: zmq=(tcp://\S+) http=(http://\S+)")
        endpoint, http = next(m.groups() for line in server.stderr if (m := ready.search(line)))
        paged = make_paged(FMT, MODELS["qwen2.5-0.5b"], NB, 16, torch.bfloat16)
        for tensor in paged:
            tensor.normal_()
        ids = np.random.default_rng(0).permutation(NB)[: tokens // 16].tolist()
        prefixes = iter(range(1, 1 << 30))
        with KvferryClient(endpoint) as client:
            reg = client.register_kv_cache(paged, FMT, namespace={"model": "m"})  # KV now in shared memory
            latencies = timed_stores(lambda t: client.store(reg, t, ids), prefixes, seconds, tokens, after)
            cache = client.stats()["cache"]
        print(f"through the server: client p50 {statistics.median(latencies) * 1e3:.1f} ms over {len(latencies)}")
        print(f"  the server's own time per STORE {server_mean_s(http, 'STORE') * 1e3:.1f} ms")
        print(f"  the cache's copy per STORE {cache['store_seconds'] / cache['stores'] * 1e3:.1f} ms")
        with CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 1}})) as engine:
            ns = engine.namespace_for("m", FMT, paged)

            def in_process(t: list[int]) -> int:
                return engine.store(t, paged, ids, FMT, namespace=ns)

            latencies = timed_stores(in_process, prefixes, seconds, tokens, after)
            own = engine.stats()
        print(f"in process: p50 {statistics.median(latencies) * 1e3:.1f} ms over {len(latencies)}")
        print(f"  the cache's copy per store {own['store_seconds'] / own['stores'] * 1e3:.1f} ms")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
