"""`kvferry server` over real tiers (a disk directory, a redis-server it may lose): a frozen or dead Redis costs
only the requests that need it, and /health, /stats and /metrics say what state the tiers are in."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.client import KvferryClient
from tests.server.serverkit import FMT_REAL, REAL_CHUNK, REAL_NS, ServerProcess, freeze, real_kv, wait_for
from tests.tiers.tierkit import NO_REDIS_REASON, REDIS_CLI, REDIS_SERVER, RedisServer

pytestmark = pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI), reason=NO_REDIS_REASON)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    if server.process is not None:
        server.process.send_signal(signal.SIGCONT)
    server.kill()


def _server(redis: RedisServer, disk: Path, *flags: str) -> ServerProcess:
    return ServerProcess(
        "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.05", "--heartbeat-interval", "0.2",
        "--heartbeat-timeout", "3", "--tier-check-interval", "0.2",
        "--l2", f"disk:{disk}?size=64MB", "--l2", f"{redis.url}?timeout=2s&backoff=5s&backoff_max=5s", *flags,
    )  # fmt: skip


def _get(server: ServerProcess, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as response:
        body = response.read()
    return body.decode() if path == "/metrics" else json.loads(body)


def test_a_frozen_redis_slows_only_the_lookups_that_ask_it(redis: RedisServer, tmp_path: Path) -> None:
    server = _server(redis, tmp_path / "disk")
    try:
        with KvferryClient(server.endpoint) as asker, KvferryClient(server.endpoint) as other:
            kv = real_kv(seed=1)
            reg = other.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
            cached = list(range(REAL_CHUNK))
            assert other.store(reg, cached, list(range(REAL_CHUNK // 16))) == REAL_CHUNK
            asking = asker.register_kv_cache(real_kv(seed=3), FMT_REAL, namespace=REAL_NS)
            freeze(redis.process.pid)  # type: ignore[union-attr]
            started = time.monotonic()
            new_prompt = asker.lookup_async(list(range(9000, 9000 + 4 * REAL_CHUNK)), registration=asking)
            slowest = 0.0
            while not new_prompt.done():
                sent = time.monotonic()
                other.ping()
                assert other.lookup(cached, registration=reg).tokens == REAL_CHUNK  # all in the pool
                slowest = max(slowest, time.monotonic() - sent)
                time.sleep(0.01)
            assert new_prompt.result().tokens == 0
            assert time.monotonic() - started >= 1.5  # it did wait for Redis (timeout=2s)...
            assert slowest < 0.5  # ...and nobody else did
            health = _get(server, "/health")
            assert health["status"] == "degraded" and health["unhealthy_tiers"] == [redis.url]
    finally:
        redis.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        assert server.stop() == 0


def test_health_stats_and_metrics_follow_the_tiers(redis: RedisServer, tmp_path: Path) -> None:
    server = _server(redis, tmp_path / "disk")
    try:
        with KvferryClient(server.endpoint) as client:
            kv = real_kv(seed=2)
            reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
            tokens = list(range(3 * REAL_CHUNK))
            assert client.store(reg, tokens, list(range(3 * REAL_CHUNK // 16))) == 3 * REAL_CHUNK
            assert client.lookup(tokens + list(range(5000, 5000 + REAL_CHUNK)), registration=reg).tokens == 3 * 64
            assert _get(server, "/health")["status"] == "ok"
            metrics = _get(server, "/metrics")
            disk = f"disk:{tmp_path / 'disk'}"
            assert f'kvferry_tier_ops_total{{op="contains",result="ok",tier="{disk}"}}' in metrics
            assert f'kvferry_tier_healthy{{tier="{redis.url}"}} 1.0' in metrics
            assert 'kvferry_cache_hit_tokens_total{engine="server"} 192.0' in metrics
            assert "kvferry_server_requests_total" in metrics
            stats = _get(server, "/stats")
            cache = stats["cache"]
            assert (cache["hit_tokens"], cache["miss_tokens"], cache["objects"], cache["locks"]) == (192, 64, 3, 0)
            assert cache["pool"]["used_bytes"] == cache["pool_used_bytes"] > 0 and cache["evictions"] == 0
            assert [(t["name"], t["healthy"]) for t in cache["tiers"]] == [(disk, True), (redis.url, True)]
            assert len(stats["sessions"]) == 1

            redis.kill()  # nobody asks the tiers now: the server must notice by itself
            wait_for(lambda: _get(server, "/health")["status"] == "degraded", "/health to see Redis gone")
            assert _get(server, "/health")["unhealthy_tiers"] == [redis.url]
            assert f'kvferry_tier_healthy{{tier="{redis.url}"}} 0.0' in _get(server, "/metrics")
            assert client.lookup(tokens, registration=reg).tokens == 3 * REAL_CHUNK  # the pool still serves
            redis.start()
            wait_for(lambda: _get(server, "/health")["status"] == "ok", "/health to see Redis back", 15.0)
    finally:
        assert server.stop() == 0


def test_stats_never_wait_for_a_frozen_tier(redis: RedisServer, tmp_path: Path) -> None:
    server = _server(redis, tmp_path / "disk")
    try:
        freeze(redis.process.pid)  # type: ignore[union-attr]
        answers: list[float] = []

        def scrape() -> None:
            for path in ("/health", "/stats", "/metrics"):
                started = time.monotonic()
                _get(server, path)
                answers.append(time.monotonic() - started)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        with KvferryClient(server.endpoint) as client:
            started = time.monotonic()
            client.stats()
            answers.append(time.monotonic() - started)
        scraper.join(10)
        assert len(answers) == 4 and max(answers) < 0.5
    finally:
        redis.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        assert server.stop() == 0
