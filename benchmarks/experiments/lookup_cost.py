"""Question: what does one LOOKUP of a 4096-token prompt (16 chunks, all hit) cost in CPU time, piece by piece, on
each side of the server's socket, and what is left for the rest?

In one process, no socket: the client's packing of the token ids (a Python list, as vLLM holds them), the server's
whole handling of the request's bytes (`KvferryServer._accept`, reply encoded; a PING's alongside), and the
pieces of the latter: decoding, argument validation, the cache's `lookup_pool` (the chunk keys, the index walk,
the lock), the reply's encoding. Medians of 3000 calls, twice.

    PYTHONPATH=src python3 benchmarks/experiments/lookup_cost.py

Answer (2026-12-02, H200 host, 3c2dd17): the client's packing 24.5 / 36.3 us, the server's handling 31.8 / 41.0
(a PING's 6.7 / 7.4): decoding 2.2-2.4, validation 2.0-2.2, `lookup_pool` 15.4-16.4, the reply 0.8-0.9. At >= 50k
LOOKUPs/s each may cost 20 us: the server's Python alone allows 24-31k/s, one client thread's packing 28-41k/s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.server.config import ServerConfig
from kvferry.server.protocol import Op, decode_request, encode_request, encode_result, pack_ids, unpack_ids
from kvferry.server.requests import parse_args
from kvferry.server.server import KvferryServer

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def median_us(call: Callable[[], object], n: int = 3000) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    engine = CacheEngine(KvferryConfig.load(overrides={"cache": {"l1_size_gb": 0.5}}))
    paged = make_paged(FMT, MODELS["qwen2.5-0.5b"], 300, 16, torch.bfloat16)
    ns = engine.namespace_for("m", FMT, paged)
    tokens = list(range(1000, 1000 + 4096))
    engine.store(tokens, paged, np.random.default_rng(0).permutation(300)[:256].tolist(), FMT, namespace=ns)
    server = KvferryServer(ServerConfig(port=0, http_port=None), engine)  # not started: its handling only
    key_space = {"model": ns.model, "kv_dtype": ns.kv_dtype, "layout": ns.layout}
    lookup = encode_request(Op.LOOKUP, 1, {"tokens": pack_ids(tokens, "tokens"), "lock": False, "namespace": key_space})
    ping = encode_request(Op.PING, 1, {})
    request = decode_request(memoryview(lookup))
    args = parse_args(request.op, request.args, request.id)
    ids = unpack_ids(args.tokens, "tokens")
    identity = b"lookup-cost"
    assert server._accept(identity, memoryview(lookup), None, None) is not None
    cases: dict[str, Callable[[], object]] = {
        "client: pack": lambda: pack_ids(tokens, "tokens"),
        "server: LOOKUP": lambda: server._accept(identity, memoryview(lookup), None, None),
        "PING": lambda: server._accept(identity, memoryview(ping), None, None),
        "decode": lambda: decode_request(memoryview(lookup)),
        "validate": lambda: parse_args(request.op, request.args, request.id),
        "lookup_pool": lambda: engine.lookup_pool(ids, namespace=ns),
        "reply": lambda: encode_result(1, {"tokens": 4096, "pending": 0, "lock": None}),
    }
    for _ in range(2):
        print(", ".join(f"{name} {median_us(call):.1f}" for name, call in cases.items()) + " (us)")
    engine.close()


if __name__ == "__main__":
    main()
