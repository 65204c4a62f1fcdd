"""One client's death, a slow tier or a stale request costs the other clients nothing (over the fake engine)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvferry.cache import CacheNamespace
from kvferry.client import KvferryClient, ServerError
from kvferry.config import ServerConfig
from kvferry.protocol.messages import pack_ids
from kvferry.server import KvferryServer
from tests.server.serverkit import (
    FMT_REAL,
    PER_CHUNK,
    REAL_CHUNK,
    REAL_NB,
    REAL_NS,
    FakeEngine,
    ServerProcess,
    real_kv,
    wait_for,
)

KEY_SPACE = {"model": "m", "kv_dtype": "bfloat16", "layout": "fake:3"}
TOKENS = list(range(100, 108))  # two 4-token chunks


def _cache_prompt(engine: FakeEngine) -> None:
    """Put TOKENS in the fake engine's cache directly (in the explicit key space above)."""
    for key in engine._keys(np.asarray(TOKENS, dtype="<u4"), CacheNamespace(**KEY_SPACE)):
        engine.objects[key] = torch.zeros(1)


def _frame(request_id: int, op: str, args: dict[str, Any], **envelope: Any) -> bytes:
    return msgpack.packb({"v": 1, "id": request_id, "op": op, "args": args, **envelope})


@pytest.fixture
def patient_server(engine: FakeEngine) -> Iterator[KvferryServer]:
    """A server whose heartbeat sweep would take 30 s: anything freed sooner was freed by the disconnect."""
    config = ServerConfig(port=0, http_port=0, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0)
    server = KvferryServer(config, engine)
    server.start()
    yield server
    server.stop()


def test_requests_queued_by_a_killed_client_do_not_reopen_its_session(
    patient_server: KvferryServer, engine: FakeEngine
) -> None:
    _cache_prompt(engine)
    lookup = {"tokens": pack_ids(TOKENS, "tokens"), "lock": True, "namespace": KEY_SPACE}
    engine.pool_gate.clear()  # the first lookup holds the socket loop: the rest queue up behind it
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{patient_server.port}")
    for i in range(3000):
        sock.send(_frame(i, "LOOKUP", lookup))
    sock.close(linger=5000)  # all of them on the wire, then the connection drops
    ctx.term()
    time.sleep(0.3)  # the disconnect is seen while 2999 lookups wait
    engine.pool_gate.set()
    wait_for(lambda: patient_server.metrics.sessions_ended.labels("disconnect")._value.get() == 1, "the disconnect")
    wait_for(lambda: not engine.locks and len(patient_server.stats()["sessions"]) == 0, "every lock freed", 5.0)
    time.sleep(0.3)
    assert not engine.locks and patient_server.stats()["sessions"] == []  # nothing took a lock afterwards
    # Those read after the disconnect were refused; ZMQ drops the rest of a departed peer's frames.
    refused = patient_server.metrics.requests.answered("?", "SESSION_ENDED")
    assert refused > 0 and engine.fake_calls._value.get() + refused <= 3000


def test_a_session_ended_by_its_silence_is_not_reopened(server: KvferryServer) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        sock.send(_frame(1, "PING", {}))
        assert sock.poll(5000) and msgpack.unpackb(sock.recv())["ok"]
        wait_for(lambda: server.stats()["sessions"] == [], "the silent session to time out")
        sock.send(_frame(2, "PING", {}))
        assert sock.poll(5000)
        reply = msgpack.unpackb(sock.recv())
        assert (reply["id"], reply["ok"], reply["error"]["code"]) == (2, False, "SESSION_ENDED")
        assert server.stats()["sessions"] == []
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_slow_tier_slows_only_the_lookups_that_need_it(endpoint: str, engine: FakeEngine) -> None:
    _cache_prompt(engine)
    engine.tier_seconds = 2.0  # every lookup that misses in the pool waits this long for "the tier"
    with KvferryClient(endpoint, timeout_s=10) as asker, KvferryClient(endpoint, timeout_s=10) as other:
        started = time.monotonic()
        missing = asker.lookup_async(list(range(500, 508)), namespace=KEY_SPACE)
        pings = []
        while not missing.done():
            sent = time.monotonic()
            other.ping()
            assert other.lookup(TOKENS, namespace=KEY_SPACE).tokens == 8  # a pool hit needs no tier
            pings.append(time.monotonic() - sent)
            time.sleep(0.02)
        assert missing.result().tokens == 0 and time.monotonic() - started >= 1.9
        assert len(pings) > 20 and max(pings) < 0.5


def test_a_request_past_its_deadline_is_not_run(endpoint: str, engine: FakeEngine) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        lookup = {"tokens": pack_ids(TOKENS, "tokens"), "namespace": KEY_SPACE}
        sock.send(_frame(1, "LOOKUP", lookup, deadline=time.time() - 1))
        sock.send(_frame(2, "LOOKUP", lookup, deadline=time.time() + 60))
        replies = {}
        for _ in range(2):
            assert sock.poll(5000)
            reply = msgpack.unpackb(sock.recv())
            replies[reply["id"]] = reply
        assert replies[1]["error"]["code"] == "DEADLINE_EXCEEDED" and replies[2]["ok"]
        assert engine.fake_calls._value.get() == 1
        sock.send(_frame(3, "PING", {}, deadline="soon"))
        assert sock.poll(5000) and msgpack.unpackb(sock.recv())["error"]["code"] == "MALFORMED"
    finally:
        sock.close(linger=0)
        ctx.term()


class _DownTier:
    """What the server reads of a tier that is down (as `Tier` reports it, without I/O)."""

    name = "redis://127.0.0.1:1"
    healthy = False
    checks = 0

    def check(self) -> bool:
        _DownTier.checks += 1
        return False

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "healthy": False, "retry_in_s": 1.0}


def test_health_names_a_tier_that_is_down_and_stats_carry_the_cache(engine: FakeEngine) -> None:
    engine.tiers = [_DownTier()]
    server = KvferryServer(ServerConfig(port=0, http_port=0, tier_check_interval_s=0.05), engine)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.http_port}"
        with urllib.request.urlopen(base + "/health", timeout=10) as response:
            health = json.loads(response.read())
        assert health["status"] == "degraded" and health["unhealthy_tiers"] == ["redis://127.0.0.1:1"]
        wait_for(lambda: _DownTier.checks >= 2, "the tier to be probed again")
        with urllib.request.urlopen(base + "/stats", timeout=10) as response:
            stats = json.loads(response.read())
        assert stats["cache"] == {"objects": 0, "locks": 0} and stats["sessions"] == []
    finally:
        server.stop()
    assert server.health()["status"] == "stopping"


def test_a_client_with_bad_block_ids_cannot_flush_the_cache() -> None:
    """Through a real server with a small pool: refused requests evict nothing, hit or miss."""
    server = ServerProcess("--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.001")
    try:
        with KvferryClient(server.endpoint) as owner, KvferryClient(server.endpoint) as attacker:
            reg = owner.register_kv_cache(real_kv(seed=1), FMT_REAL, namespace=REAL_NS)
            cached = [list(range(i * 1000, i * 1000 + REAL_CHUNK)) for i in range(14)]  # 14 of 16 objects
            for tokens in cached:
                assert owner.store(reg, tokens, list(range(PER_CHUNK))) == REAL_CHUNK
            before = owner.stats()["cache"]
            assert (before["objects"], before["evictions"]) == (14, 0)
            bad = attacker.register_kv_cache(real_kv(seed=2), FMT_REAL, namespace=REAL_NS)
            outside = [REAL_NB + 1] * (4 * PER_CHUNK)
            for i in range(3):
                with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*outside the pool"):
                    attacker.store(bad, list(range(50_000 + i, 50_000 + i + 4 * REAL_CHUNK)), outside)
            after = owner.stats()["cache"]
            assert (after["objects"], after["evictions"]) == (14, 0)
            assert after["pool_used_bytes"] == before["pool_used_bytes"]
            with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*outside the pool"):  # cached: no copy needed
                attacker.store(bad, cached[0], outside[:PER_CHUNK])
            with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*outside the pool"):  # a miss: nothing to copy
                attacker.retrieve(bad, list(range(90_000, 90_000 + REAL_CHUNK)), outside[:PER_CHUNK])
            assert all(owner.lookup(tokens, registration=reg).tokens == REAL_CHUNK for tokens in cached)
    finally:
        assert server.stop() == 0


def test_pages_stored_and_retrieved_in_one_request_each() -> None:
    """Through a real server: pages (each chunk keyed alone) stored in one STORE come back, with a page stored on
    its own, in one RETRIEVE (``pages``), each into its own blocks, up to the first page the cache lacks."""
    server = ServerProcess("--chunk-size", str(REAL_CHUNK))
    try:
        with KvferryClient(server.endpoint) as client:
            src, dst = real_kv(seed=1), real_kv(seed=2)
            reg_src = client.register_kv_cache(src, FMT_REAL, namespace=REAL_NS)
            reg_dst = client.register_kv_cache(dst, FMT_REAL, namespace=REAL_NS)
            pages = [list(range(i * 1000, i * 1000 + REAL_CHUNK)) for i in range(4)]
            assert client.store(reg_src, pages[0] + pages[1], list(range(2 * PER_CHUNK)), pages=True) == 2 * REAL_CHUNK
            assert client.store(reg_src, pages[3], list(range(3 * PER_CHUNK, 4 * PER_CHUNK))) == REAL_CHUNK  # alone
            assert client.lookup(pages[1], registration=reg_src).tokens == REAL_CHUNK  # a one-chunk prefix
            blocks = list(range(40, 40 + 4 * PER_CHUNK))
            untouched = [layer[:, blocks[2 * PER_CHUNK :]].clone() for layer in dst]
            tokens = [t for page in pages for t in page]  # page 2 was never stored
            assert client.retrieve(reg_dst, tokens, blocks, pages=True) == 2 * REAL_CHUNK
            for layer_src, layer_dst in zip(src, dst, strict=True):
                assert torch.equal(layer_dst[:, blocks[: 2 * PER_CHUNK]], layer_src[:, : 2 * PER_CHUNK])
            assert all(torch.equal(d[:, blocks[2 * PER_CHUNK :]], u) for d, u in zip(dst, untouched, strict=True))
            swapped = pages[3] + pages[0]
            assert client.retrieve(reg_dst, swapped, blocks[: 2 * PER_CHUNK], pages=True) == 2 * REAL_CHUNK
            for layer_src, layer_dst in zip(src, dst, strict=True):
                assert torch.equal(layer_dst[:, blocks[:PER_CHUNK]], layer_src[:, 3 * PER_CHUNK : 4 * PER_CHUNK])
    finally:
        assert server.stop() == 0
