"""Question: how much of a synchronous request's round trip through `kvferry server` do the client's own thread
hops cost, and what is left once the calling thread reads its reply off the socket itself?

Answer (2026-12-01, CPU machine, 2 cores): PING p50 through the client library with a background I/O thread
(8ca58e2): 312-424 us; with the caller reading its own reply (the leader, this tree): 275-320 us; a bare DEALER in
the calling thread, the same frames: 203-256 us. LOOKUP of 4096 tokens (16 chunks): 561-700 / 529-600 / 330-430 us
(the library also packs the 4096 token ids, ~35-60 us). The rest of the gap is Python per request (futures, the
pending table, one poll wait) on a machine whose two cores also run the server.

Starts a server (its own process) and times, in this process, N requests each: the library's ping() and lookup()
(a 4096-token prompt, a miss), then the same requests on a raw DEALER socket in this thread (send, blocking recv).
Run it against another tree by putting that tree's src first on PYTHONPATH.

    PYTHONPATH=src python3 benchmarks/experiments/client_thread_hops.py [requests]
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import zmq

from kvferry.client import KvferryClient
from kvferry.server.protocol import Op, decode_reply, encode_request, pack_ids

NAMESPACE = {"model": "m", "kv_dtype": "torch.bfloat16", "layout": "x", "world_size": 1, "rank": 0, "salt": ""}
TOKENS = list(range(4096))


def p50_us(n: int, call: Callable[[int], object]) -> float:
    times = []
    for i in range(n):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    cmd = [sys.executable, "-m", "kvferry.server", "--port", "0", "--http-port", "0", "--l1-size-gb", "0.1"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        endpoint = next(m.group(1) for line in server.stderr if (m := re.search(r"ready: zmq=(tcp://\S+)", line)))
        with KvferryClient(endpoint) as client:
            client.wait_available(10)
            print(f"library ping p50 {p50_us(n, lambda i: client.ping()):.0f} us")
            lookup = p50_us(n, lambda i: client.lookup(TOKENS, namespace=NAMESPACE))
            print(f"library lookup p50 {lookup:.0f} us")
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        dealer.connect(endpoint)

        def raw(op: Op, args: dict[str, object]) -> Callable[[int], object]:
            def call(i: int) -> object:
                dealer.send(encode_request(op, i + 1, args))
                return decode_reply(dealer.recv())

            return call

        raw(Op.PING, {})(0)
        print(f"raw DEALER ping p50 {p50_us(n, raw(Op.PING, {})):.0f} us")
        args = {"tokens": pack_ids(TOKENS, "tokens"), "namespace": NAMESPACE}
        print(f"raw DEALER lookup p50 {p50_us(n, raw(Op.LOOKUP, args)):.0f} us (token ids packed once)")
        dealer.close(linger=0)
        context.term()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
