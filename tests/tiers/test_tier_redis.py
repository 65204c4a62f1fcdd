import signal
import threading
import time

import pytest
import torch

from kvferry.tiers import RedisTier, make_tier
from tests.tiers.tierkit import AlignedAlloc, RedisServer, key, plain_alloc, random_tensor, redis_key_count, same_bits

pytestmark = pytest.mark.redis

SMALL = (2, 1, 16, 100)  # 6400 B: read through redis-py's own buffer
LARGE = (2, 2, 256, 512)  # 1 MiB of bf16: read with recv_into straight into one buffer


@pytest.fixture(params=["redis_url", "cluster_url"])
def any_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param)


def _tier(url: str, **params: str) -> RedisTier:
    query = "&".join(f"{k}={v}" for k, v in {"timeout": "2s", **params}.items())
    tier = make_tier(f"{url}?{query}")
    assert isinstance(tier, RedisTier)
    return tier


def _raw_value(server: RedisServer, tier: RedisTier, k: bytes) -> bytes:
    return server.client().get(tier._redis_key(k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8])
def test_round_trip_bit_exact(any_url: str, dtype: torch.dtype) -> None:
    tier = _tier(any_url)
    try:
        objs = {i: random_tensor(LARGE if i % 2 else SMALL, dtype, seed=i) for i in range(6)}
        assert all(f.result() for f in [tier.put(key(i), obj) for i, obj in objs.items()])
        alloc = AlignedAlloc()
        got = [tier.get(key(i), alloc if i < 3 else plain_alloc) for i in objs]
        assert all(same_bits(f.result(), objs[i]) for i, f in zip(objs, got, strict=True))
        assert tier.get(key("absent"), alloc).result() is None
        assert tier.contains_many([key(0), key("absent"), key(5)]) == [True, False, True]
        assert tier.stats()["used_bytes"] is None  # stats() never asks the server; check() does
        assert tier.check()
        stats = tier.stats()
        assert stats["ops"]["get"] == {"hit": 6, "miss": 1} and stats["healthy"]
        assert stats["capacity_bytes"] is None and stats["used_bytes"] > 6 * 6400
        assert tier.evict(1 << 20) == 0
        tier.delete(key(0))
        assert not tier.contains(key(0))
    finally:
        tier.close()


def test_cluster_spreads_objects_over_all_primaries(cluster_url: str, redis_cluster: list[RedisServer]) -> None:
    tier = _tier(cluster_url)
    try:
        futures = [tier.put(key(i), random_tensor(SMALL, torch.uint8, seed=i)) for i in range(30)]
        assert all(f.result() for f in futures)
        counts = [node.client().dbsize() for node in redis_cluster]
        assert sum(counts) == 30 and min(counts) > 0
    finally:
        tier.close()


def test_requests_arriving_together_share_pipelines(redis_url: str) -> None:
    tier = _tier(redis_url, workers="1", batch="8")
    sizes: list[int] = []
    first_started, release = threading.Event(), threading.Event()
    run = tier._batcher._run

    def recording_run(batch: list) -> None:
        sizes.append(len(batch))
        first_started.set()
        release.wait(10)  # the first batch holds the only worker while the rest queue up
        run(batch)

    tier._batcher._run = recording_run
    try:
        objs = [random_tensor(SMALL, torch.float16, seed=i) for i in range(17)]
        futures = [tier.put(key(0), objs[0])]
        assert first_started.wait(10)
        futures += [tier.put(key(i), obj) for i, obj in enumerate(objs) if i]
        release.set()
        assert all(f.result() for f in futures)
        assert sizes == [1, 8, 8]
        got = [tier.get(key(i), plain_alloc) for i in range(17)]
        assert all(same_bits(f.result(), obj) for f, obj in zip(got, objs, strict=True))
    finally:
        tier.close()


def test_failing_alloc_is_a_miss_that_spares_the_rest_of_the_batch(redis_url: str) -> None:
    tier = _tier(redis_url, workers="1")
    try:
        objs = [random_tensor(SMALL, torch.uint8, seed=i) for i in range(3)]
        assert all(f.result() for f in [tier.put(key(i), o) for i, o in enumerate(objs)])

        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if shape == SMALL and not hasattr(alloc, "failed"):
                alloc.failed = True
                raise MemoryError("pool broke")
            return plain_alloc(shape, dtype)

        got = [f.result() for f in [tier.get(key(i), alloc) for i in range(3)]]
        assert got[0] is None and same_bits(got[1], objs[1]) and same_bits(got[2], objs[2])
        assert tier.stats()["ops"]["get"] == {"error": 1, "hit": 2} and tier.healthy
    finally:
        tier.close()


def _flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        lambda v: _flip(v, len(v) - 7),  # payload bit
        lambda v: _flip(v, 30),  # header bit
        lambda v: v[: len(v) - 100],  # truncated
        lambda v: b"written by someone else",
    ],
    ids=["payload-bit", "header-bit", "truncated", "foreign"],
)
def test_damaged_value_is_a_miss_and_deleted(redis_url: str, redis_server: RedisServer, damage) -> None:
    tier = _tier(redis_url)
    try:
        assert tier.put(key(1), random_tensor(LARGE, torch.bfloat16, seed=1)).result()
        redis_key = tier._redis_key(key(1))
        redis_server.client().set(redis_key, damage(_raw_value(redis_server, tier, key(1))))
        alloc = AlignedAlloc()
        assert tier.get(key(1), alloc, alloc.free).result() is None
        assert alloc.allocated == 0  # verified before asking the pool for memory
        assert redis_server.client().exists(redis_key) == 0
        sample = {"tier": tier.name, "op": "get", "result": "corrupt"}
        assert tier.metrics_registry.get_sample_value("kvferry_tier_ops_total", sample) >= 1
    finally:
        tier.close()


def test_server_killed_mid_run_gives_misses_then_recovers(own_redis: RedisServer) -> None:
    tier = _tier(own_redis.url, timeout="1s", backoff="100ms", backoff_max="200ms")
    try:
        objs = [random_tensor(LARGE, torch.bfloat16, seed=i) for i in range(12)]
        assert tier.put(key(0), objs[0]).result()
        in_flight = [tier.put(key(i), obj) for i, obj in enumerate(objs)]
        own_redis.kill()
        assert all(isinstance(f.result(timeout=10), bool) for f in in_flight)
        assert tier.get(key(0), plain_alloc).result(timeout=10) is None
        assert not tier.healthy and not tier.contains(key(0))
        tier.delete(key(0))  # no exception either
        assert tier.stats()["ops"]["get"] == {"unavailable": 1}
        sample = {"tier": tier.name}
        assert tier.metrics_registry.get_sample_value("kvferry_tier_healthy", sample) == 0

        own_redis.start()
        time.sleep(0.25)
        assert tier.put(key(1), objs[1]).result()
        assert tier.healthy and tier.metrics_registry.get_sample_value("kvferry_tier_healthy", sample) == 1
        assert same_bits(tier.get(key(1), plain_alloc).result(), objs[1])
        assert redis_key_count(own_redis) == 1  # the restarted server kept nothing; no persistence
    finally:
        tier.close()


def test_hung_server_times_out_into_misses(own_redis: RedisServer) -> None:
    tier = _tier(own_redis.url, timeout="200ms", backoff="100ms", backoff_max="100ms")
    try:
        obj = random_tensor(SMALL, torch.uint8, seed=1)
        assert tier.put(key(1), obj).result()
        own_redis.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert tier.get(key(1), plain_alloc).result(timeout=10) is None
            assert time.monotonic() - started < 2 and not tier.healthy
        finally:
            own_redis.process.send_signal(signal.SIGCONT)
        time.sleep(0.15)
        assert same_bits(tier.get(key(1), plain_alloc).result(), obj) and tier.healthy
    finally:
        tier.close()


def test_check_finds_an_idle_server_down_and_stats_never_wait_for_it(own_redis: RedisServer) -> None:
    tier = _tier(own_redis.url, timeout="300ms", backoff="100ms", backoff_max="100ms")
    try:
        assert tier.check() and tier.used_bytes is not None
        own_redis.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(20):
                tier.stats()
            assert time.monotonic() - started < 0.2  # no round trip: the answer is what was last seen
            assert not tier.check() and not tier.healthy and tier.used_bytes is None
            sample = {"tier": tier.name}
            assert tier.metrics_registry.get_sample_value("kvferry_tier_healthy", sample) == 0
        finally:
            own_redis.process.send_signal(signal.SIGCONT)
        time.sleep(0.15)
        assert tier.check() and tier.healthy
    finally:
        tier.close()


def test_server_out_of_memory_refuses_puts_but_stays_healthy(own_redis: RedisServer) -> None:
    own_redis.client().config_set("maxmemory", 4 << 20)
    own_redis.client().config_set("maxmemory-policy", "noeviction")
    tier = _tier(own_redis.url)
    try:
        results = [tier.put(key(i), random_tensor(LARGE, torch.uint8, seed=i)).result() for i in range(8)]
        assert results[0] and not results[-1]
        assert tier.healthy and tier.stats()["ops"]["put"]["full"] >= 1
        assert same_bits(tier.get(key(0), plain_alloc).result(), random_tensor(LARGE, torch.uint8, seed=0))
    finally:
        tier.close()


def test_unreachable_cluster_is_misses_not_exceptions() -> None:
    tier = make_tier("redis+cluster://127.0.0.1:1?connect_timeout=100ms&timeout=100ms&backoff=5")
    try:
        assert tier.put(key(1), random_tensor(SMALL, torch.uint8, seed=1)).result() is False
        assert tier.get(key(1), plain_alloc).result() is None
        assert not tier.contains(key(1)) and not tier.healthy and tier.used_bytes is None
        assert tier.stats()["ops"]["put"] == {"unavailable": 1}
    finally:
        tier.close()
