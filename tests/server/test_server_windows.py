"""A server's lookups from a chunk on (a sliding window's) and its DEMOTE op, over a real cache engine: an evicted
chunk before the window does not shorten a window's hit, and demoted chunks are the first the pool evicts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient, ServerError
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.memory import HostPool
from kvferry.protocol.messages import pack_ids
from kvferry.server import KvferryServer
from tests.server.serverkit import FMT_REAL, PER_CHUNK, REAL_CHUNK, REAL_NS, raw_request, real_kv

CHUNK_BYTES = 4 * 2 * REAL_CHUNK * 2 * 32 * 2  # serverkit's real KV: 4 layers, K and V, 2 heads of 32, bf16


@pytest.fixture
def served() -> Iterator[tuple[CacheEngine, KvferryServer]]:
    config = KvferryConfig.load(
        env={}, overrides={"cache": {"chunk_size": REAL_CHUNK, "watermark": 1.0, "eviction_batch": 1}}
    )
    engine = CacheEngine(config, pool=HostPool(10 * CHUNK_BYTES, pin=False))
    server = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    server.start()
    yield engine, server
    server.stop()
    engine.close()


def _tokens(base: int, chunks: int) -> list[int]:
    return list(range(base, base + chunks * REAL_CHUNK))


def _explicit(engine: CacheEngine) -> dict[str, str]:
    """The key space of `real_kv` as a process without KV names it (a raw request's session has no registration)."""
    namespace = engine.namespace_for(REAL_NS["model"], FMT_REAL, real_kv(1), salt=REAL_NS["salt"])
    return {**REAL_NS, "kv_dtype": namespace.kv_dtype, "layout": namespace.layout}


def _evict(engine: CacheEngine, tokens: list[int], chunk: int) -> None:
    namespace = engine.namespace_for(REAL_NS["model"], FMT_REAL, real_kv(1), salt=REAL_NS["salt"])
    with engine._res.lock:
        entry = engine._res.index.get(engine.chunk_keys(tokens, namespace=namespace)[chunk])
        assert entry is not None
        engine._res.detach_locked(entry)


def test_a_lookup_from_a_chunk_on_hits_past_an_evicted_earlier_chunk(
    served: tuple[CacheEngine, KvferryServer],
) -> None:
    engine, server = served
    endpoint = f"tcp://127.0.0.1:{server.port}"
    with KvferryClient(endpoint, timeout_s=10) as client:
        reg = client.register_kv_cache(real_kv(1), FMT_REAL, namespace=REAL_NS)
        tokens = _tokens(0, 4)
        assert client.store(reg, tokens, list(range(4 * PER_CHUNK))) == 4 * REAL_CHUNK
        _evict(engine, tokens, 0)  # outside the window at the hit's end: not needed there
        assert client.lookup(tokens, registration=reg).tokens == 0  # every chunk from token 0: a miss
        assert client.lookup(tokens, registration=reg, first_chunk=2).tokens == 4 * REAL_CHUNK
        assert client.lookup(tokens, registration=reg, first_chunk=9).tokens == 4 * REAL_CHUNK  # past the end
        _evict(engine, tokens, 2)
        assert client.lookup(tokens, registration=reg, first_chunk=1).tokens == 2 * REAL_CHUNK  # up to the gap
        found = client.lookup(tokens, registration=reg, first_chunk=3, lock=True)
        assert found.tokens == 4 * REAL_CHUNK and found.lock is not None
        assert client.free_lookup_locks(found.lock)
        # A bad value is an error naming it; the server serves on
        packed = pack_ids(tokens, "tokens")
        for bad in (-1, "2", True, 1.5, None):
            reply = raw_request(
                endpoint, "LOOKUP", {"tokens": packed, "namespace": _explicit(engine), "first_chunk": bad}
            )
            assert reply["ok"] is False and reply["error"]["code"] == "BAD_ARGUMENT", reply
            assert "'first_chunk'" in reply["error"]["message"]
        huge = raw_request(
            endpoint, "LOOKUP", {"tokens": packed, "namespace": _explicit(engine), "first_chunk": 2**64 - 1}
        )
        assert huge["result"]["tokens"] == 4 * REAL_CHUNK  # past the prompt's chunks: none of them needed
        assert client.lookup(tokens, registration=reg, first_chunk=3).tokens == 4 * REAL_CHUNK


def test_demoted_chunks_are_evicted_first(served: tuple[CacheEngine, KvferryServer]) -> None:
    engine, server = served
    endpoint = f"tcp://127.0.0.1:{server.port}"
    with KvferryClient(endpoint, timeout_s=10) as client:
        reg = client.register_kv_cache(real_kv(1), FMT_REAL, namespace=REAL_NS)
        old, windowed, new = _tokens(0, 4), _tokens(10_000, 4), _tokens(20_000, 4)
        ids = list(range(4 * PER_CHUNK))
        assert client.store(reg, old, ids) == client.store(reg, windowed, ids) == 4 * REAL_CHUNK
        # The window at the end of `windowed` no longer needs its first two chunks: they go first, before the
        # chunks of `old` (stored earlier, so first in plain LRU order)
        assert client.demote_async(windowed, range(2), registration=reg).result(timeout=10) == 2
        assert client.demote_async(windowed, range(2), registration=reg).result(timeout=10) == 2  # idempotent
        assert client.demote_async(_tokens(30_000, 2), range(2), registration=reg).result(timeout=10) == 2  # none
        assert client.store(reg, new, ids) == 4 * REAL_CHUNK  # the pool holds 10 chunks: 2 are evicted
        assert client.lookup(old, registration=reg).tokens == 4 * REAL_CHUNK
        assert client.lookup(windowed, registration=reg).tokens == 0
        assert client.lookup(windowed, registration=reg, first_chunk=2).tokens == 4 * REAL_CHUNK
        assert client.lookup(new, registration=reg).tokens == 4 * REAL_CHUNK
        assert engine.stats()["evictions"] == 2


def test_demote_through_a_namespace_and_malformed_demotes(served: tuple[CacheEngine, KvferryServer]) -> None:
    engine, server = served
    endpoint = f"tcp://127.0.0.1:{server.port}"
    explicit = _explicit(engine)
    with KvferryClient(endpoint, timeout_s=10) as client:
        reg = client.register_kv_cache(real_kv(1), FMT_REAL, namespace=REAL_NS)
        tokens = _tokens(0, 3)
        assert client.store(reg, tokens, list(range(3 * PER_CHUNK))) == 3 * REAL_CHUNK
        assert client.demote_async(tokens, range(1, 3), namespace=explicit).result(timeout=10) == 2
        packed = pack_ids(tokens, "tokens")
        for args, code in (
            ({"tokens": b"\x01\x02\x03", "num_chunks": 1}, "BAD_ARGUMENT"),  # not whole uint32 ids
            ({"tokens": packed, "num_chunks": -1}, "BAD_ARGUMENT"),
            ({"tokens": packed, "num_chunks": [1]}, "BAD_ARGUMENT"),
            ({"tokens": packed}, "BAD_ARGUMENT"),
            ({"tokens": packed, "num_chunks": 1, "registration": 7, "namespace": explicit}, "BAD_ARGUMENT"),
            ({"tokens": packed, "num_chunks": 1, "registration": 7}, "UNKNOWN_REGISTRATION"),
        ):
            reply = raw_request(
                endpoint, "DEMOTE", {"namespace": explicit, **args} if "registration" not in args else args
            )
            assert reply["ok"] is False and reply["error"]["code"] == code, (args, reply)
        # Counts as large as msgpack carries name no more work than the prompt's chunks
        for first, count, demoted in ((2**64 - 1, 2**64 - 1, 0), (0, 2**64 - 1, 3), (2, 2**63, 1)):
            args = {"tokens": packed, "first_chunk": first, "num_chunks": count, "namespace": explicit}
            assert raw_request(endpoint, "DEMOTE", args)["result"]["chunks"] == demoted
        with pytest.raises(ValueError, match="consecutive chunk indices"):
            client.demote_async(tokens, range(2, 0, -1), registration=reg)
        with pytest.raises(ServerError, match="UNKNOWN_REGISTRATION"):
            client.demote_async(tokens, range(1), registration=reg + 99).result(timeout=10)
        assert client.lookup(tokens, registration=reg).tokens == 3 * REAL_CHUNK  # demoted, not dropped
