"""The server's KV event stream, followed by the reference consumer: after stores, evictions, spills to a disk tier,
the disk's own evictions and a restart, the consumer's index is what the server holds, nothing lost."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvferry.cache import CacheEngine, ChunkHasher
from kvferry.cache.events import ChunksRemoved, Record
from kvferry.client import KvferryClient
from kvferry.client.event_index import EventIndex, EventSubscriber, Stream
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.memory import HostPool
from kvferry.security import ClientCurve, SecurityConfig
from kvferry.server import KvferryServer
from kvferry.server.event_stream import EventStream
from kvferry.server.ports import ServerStartError
from kvferry.tiers import Tier, make_tier
from tests.server.serverkit import FMT_REAL, PER_CHUNK, REAL_CHUNK, REAL_NS, real_kv

OBJECT_BYTES = 4 * 2 * 2 * 32 * REAL_CHUNK * 2  # a chunk of the bf16 KV of real_kv: 64 KiB
NODE = "server-a"


class CountingIndex(EventIndex):
    """Counts every removal it applies, by medium and key."""

    def __init__(self) -> None:
        super().__init__()
        self.removals: Counter[tuple[str, bytes]] = Counter()

    def apply(self, node: str, records: Sequence[Record]) -> None:
        for record in records:
            if isinstance(record, ChunksRemoved):
                self.removals.update((record.medium, key) for key in record.keys)
        super().apply(node, records)


def _engine(tiers: list[Tier]) -> CacheEngine:
    """A cache engine of a 6-object pool over ``tiers``."""
    config = KvferryConfig.load(
        env={}, overrides={"cache": {"chunk_size": REAL_CHUNK, "watermark": 1.0, "eviction_batch": 1}}
    )
    return CacheEngine(config, pool=HostPool(6 * OBJECT_BYTES, pin=False), tiers=tiers)


class Node:
    """A server over a real cache engine, a 6-object pool and a disk tier of 4 objects."""

    def __init__(self, disk_dir: Path, events_port: int = 0, replay_port: int = 0) -> None:
        self.disk: Tier = make_tier(f"disk:{disk_dir}?size={4 * (OBJECT_BYTES + 4096)}")
        self.engine = _engine([self.disk])
        server_config = ServerConfig(port=0, http_port=None, events_port=events_port, events_replay_port=replay_port)
        self.server = KvferryServer(server_config, self.engine)
        self.server.start()
        self.endpoint = f"tcp://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()
        self.engine.close()
        self.disk.close()

    def pool_keys(self) -> set[bytes]:
        return {e.key for e in self.engine._res.index if e.readable and not e.tail}

    def disk_keys(self) -> set[bytes]:
        assert self.disk._held is not None
        return set(self.disk._held.keys())


def _stream(events: dict[str, Any]) -> Stream:
    """The stream of a server's ``stats()["events"]``, with its replay socket."""
    return Stream(NODE, f"tcp://127.0.0.1:{events['port']}", f"tcp://127.0.0.1:{events['replay_port']}")


def _settle(subscriber: EventSubscriber, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the consumer's index never matched the server"
        subscriber.poll(0.05)


def _store(node: Node, prompts: list[list[int]], seed: int) -> None:
    with KvferryClient(node.endpoint, timeout_s=20) as client:
        reg = client.register_kv_cache(real_kv(seed), FMT_REAL, namespace=REAL_NS)
        for tokens in prompts:
            assert client.store(reg, tokens, list(range(2 * PER_CHUNK))) == 2 * REAL_CHUNK


def _quiet(node: Node) -> Callable[[], bool]:
    """Every eviction's spill has finished (a spill in flight is still in the pool, and on its way to the disk)."""

    def done() -> bool:
        stats = node.engine.stats()
        return stats["tier_writes"] + stats["tier_write_failures"] == stats["evictions"]

    return done


@pytest.mark.timeout(120)
def test_the_consumer_follows_churn_and_a_restart(tmp_path: Path) -> None:
    node = Node(tmp_path / "disk")
    events = node.server.stats()["events"]
    stream = _stream(events)
    index = CountingIndex()
    subscriber = EventSubscriber([stream], index, replay_timeout_s=10)
    try:
        prompts = [list(range(1000 * p, 1000 * p + 2 * REAL_CHUNK)) for p in range(9)]
        _store(node, prompts, seed=1)  # 18 objects through a pool of 6 and a disk of 4
        _settle(subscriber, _quiet(node))
        _settle(subscriber, lambda: index.keys(NODE, "CPU") == node.pool_keys())
        _settle(subscriber, lambda: index.keys(NODE, "STORAGE") == node.disk_keys())
        stats = node.engine.stats()
        assert stats["evictions"] == 12 and len(node.pool_keys()) == 6 and len(node.disk_keys()) == 4
        cpu_removals = [n for (medium, _), n in index.removals.items() if medium == "CPU"]
        assert len(cpu_removals) == stats["evictions"] and set(cpu_removals) == {1}  # once per evicted object
        assert set(index.removals.values()) == {1}
        _check_against_lookups(node, index, prompts)
        survivors = node.disk_keys()
        ports = (events["port"], events["replay_port"])
        node.stop()

        node = Node(tmp_path / "disk", *ports)  # a restart: the pool is empty, the disk kept 4 objects
        _store(node, [list(range(50_000, 50_000 + 2 * REAL_CHUNK))], seed=2)  # a store: the stream moves on
        _settle(subscriber, lambda: index.keys(NODE, "CPU") == node.pool_keys() and len(node.pool_keys()) == 2)
        _settle(subscriber, lambda: index.keys(NODE, "STORAGE") == survivors == node.disk_keys())
        # Caught up with the new run to its last batch (from its replay, where it published before the consumer was
        # back, or live).
        _settle(subscriber, lambda: stream.last_seq == node.server.stats()["events"]["next_seq"] - 1)
        assert not index.stale
        assert node.server.stats()["events"]["dropped"] == 0 and node.engine.stats()["events_dropped"] == 0
    finally:
        subscriber.close()
        node.stop()


@pytest.mark.timeout(120)
def test_a_restart_that_published_everything_before_the_consumer_reconnected_is_caught_up(tmp_path: Path) -> None:
    """The restarted server publishes its new run (its resync, a store) while the consumer is still away: nothing
    more is published once it is back, and it learns the new run from the replay socket on reconnecting."""
    node = Node(tmp_path / "disk")
    events = node.server.stats()["events"]
    stream = _stream(events)
    index = CountingIndex()
    subscriber = EventSubscriber([stream], index, replay_timeout_s=10)
    try:
        _store(node, [list(range(2 * REAL_CHUNK))], seed=1)
        _settle(subscriber, lambda: index.keys(NODE, "CPU") == node.pool_keys() and len(node.pool_keys()) == 2)
        stream.sub.setsockopt(zmq.RECONNECT_IVL, 3000)  # back 3 s after the drop: the new run is published by then
        stream.sub.disconnect(stream.endpoint)  # (a connection takes the interval when it is made)
        stream.sub.connect(stream.endpoint)
        time.sleep(0.5)
        node.stop()
        node = Node(tmp_path / "disk", events["port"], events["replay_port"])
        _store(node, [list(range(70_000, 70_000 + 2 * REAL_CHUNK))], seed=2)
        stored = node.pool_keys()
        assert len(stored) == 2 and not stored & index.keys(NODE, "CPU")
        _settle(subscriber, lambda: index.keys(NODE, "CPU") == stored, timeout=20.0)
        assert not index.stale
    finally:
        subscriber.close()
        node.stop()


def _check_against_lookups(node: Node, index: EventIndex, prompts: list[list[int]]) -> None:
    """The consumer's longest prefix per medium is the server's pool lookup and its disk tier's run of hits."""
    ns = node.engine.namespace_for(REAL_NS["model"], FMT_REAL, real_kv(1), salt=REAL_NS["salt"])
    hasher = ChunkHasher(REAL_CHUNK, node.engine.config.cache.hash_algo)
    for tokens in prompts:
        keys = hasher.keys(tokens, ns)
        held: dict[str, Any] = index.longest_prefix(keys).get(NODE, {})
        pool_hit = node.engine.lookup_pool(tokens, namespace=ns)[0].hit_tokens
        on_disk = node.disk.contains_many(keys)
        disk_run = on_disk.index(False) if False in on_disk else len(keys)
        assert (held.get("CPU", 0) * REAL_CHUNK, held.get("STORAGE", 0)) == (pool_hit, disk_run)


def test_kvferry_events_answers_the_longest_prefix_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.cli.main import main

    node = Node(tmp_path / "disk")
    try:
        prompt = list(range(7000, 7000 + 2 * REAL_CHUNK + 9))
        _store(node, [prompt[: 2 * REAL_CHUNK]], seed=3)
        ns = node.engine.namespace_for(REAL_NS["model"], FMT_REAL, real_kv(1), salt=REAL_NS["salt"])
        fields = ("model", "kv_dtype", "layout", "world_size", "rank", "salt", "codec")
        (tmp_path / "prompt.json").write_text(json.dumps(prompt))
        events = node.server.stats()["events"]
        stream = f"a=tcp://127.0.0.1:{events['port']},tcp://127.0.0.1:{events['replay_port']}"
        status = main(
            ["events", stream, "--seconds", "0.5", "--json", "--chunk-size", str(REAL_CHUNK),
             "--tokens", str(tmp_path / "prompt.json"), "--namespace", json.dumps({f: getattr(ns, f) for f in fields})]
        )  # fmt: skip
        answer = json.loads(capsys.readouterr().out)
        assert status == 0 and answer["held"] == {"a": {"CPU": 2}} and not answer["stale"]
        assert answer["prefix_tokens"]["a"]["CPU"] == node.engine.lookup(prompt, namespace=ns) == 2 * REAL_CHUNK
        assert main(["events", "nonsense", "--seconds", "0"]) == 2  # not an endpoint: one line, status 2
    finally:
        node.stop()


def test_a_gap_is_filled_from_the_replay_socket(tmp_path: Path) -> None:
    node = Node(tmp_path / "disk")
    events = node.server.stats()["events"]
    stream = _stream(events)
    index = EventIndex()
    subscriber = EventSubscriber([stream], index, replay_timeout_s=10)
    try:
        stream.sub.setsockopt(zmq.UNSUBSCRIBE, b"")  # the SUB socket filters locally: nothing more gets through
        _store(node, [list(range(2 * REAL_CHUNK))], seed=4)
        _settle(subscriber, lambda: node.server.stats()["events"]["next_seq"] > stream.last_seq + 2)
        stream.sub.setsockopt(zmq.SUBSCRIBE, b"")
        _settle(subscriber, lambda: index.keys(NODE, "CPU") == node.pool_keys() and len(node.pool_keys()) == 2)
        assert stream.gaps >= 1 and not index.stale
    finally:
        subscriber.close()
        node.stop()


def test_dropped_events_end_in_a_re_announcement() -> None:
    """A queue of 3 records that nobody drains while 8 stores report: the publisher's next batch starts afresh."""
    engine = _engine([])
    ctx: zmq.Context[Any] = zmq.Context()
    config = ServerConfig(port=0, http_port=None, events_port=0, events_replay_port=0)
    publisher = EventStream(engine, config, ctx, interval_s=3600, heartbeat_s=3600, queue_records=3)
    stream = Stream(NODE, f"tcp://127.0.0.1:{publisher.port}", f"tcp://127.0.0.1:{publisher.replay_port}")
    index = EventIndex()
    subscriber = EventSubscriber([stream], index, replay_timeout_s=10)  # its replay request wakes the publisher
    try:
        assert stream.last_seq == 0 and index.keys(NODE, "CPU") == set()
        src = real_kv(5)
        ns = engine.namespace_for(REAL_NS["model"], FMT_REAL, src, salt=REAL_NS["salt"])
        for p in range(4):
            tokens = list(range(100 * p, 100 * p + 2 * REAL_CHUNK))
            engine.store(tokens, src, list(range(2 * PER_CHUNK)), FMT_REAL, namespace=ns)
        assert engine.stats()["events_dropped"] == 4 + 2 - 3  # 4 stores, 2 evictions; 3 records fit
        with ctx.socket(zmq.DEALER) as wake:  # any replay request: the publisher then sends what is queued
            wake.connect(f"tcp://127.0.0.1:{publisher.replay_port}")
            wake.send_multipart((b"", (10**6).to_bytes(8, "big")))
            assert wake.poll(10_000)
        pool = {e.key for e in engine._res.index if e.readable}
        _settle(subscriber, lambda: index.keys(NODE, "CPU") == pool and len(pool) == 6)
        assert stream.last_seq == 1 and not index.stale  # one batch: AllBlocksCleared, then the 6 chunks held
    finally:
        subscriber.close()
        publisher.stop(time.monotonic() + 5)
        ctx.destroy(linger=0)
        engine.close()


def test_with_curve_the_stream_serves_only_subscribers_with_an_allowed_key(tmp_path: Path) -> None:
    """The event stream is secured as the request socket is: a subscriber without an allowed key receives nothing
    (not even a replay), one with it follows the stores; a server shared by tenants publishes no stream."""
    server_keys, client_keys, stranger = zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair()
    (tmp_path / "clients").write_text(client_keys[0].decode() + "\n")
    security = SecurityConfig(curve_secret_key=server_keys[1].decode(), curve_client_keys=str(tmp_path / "clients"))
    engine = _engine([])
    server = KvferryServer(
        ServerConfig(port=0, http_port=None, events_port=0, events_replay_port=0), engine, security=security
    )
    server.start()
    streams = {
        who: Stream(who, f"tcp://127.0.0.1:{server.events_port}", f"tcp://127.0.0.1:{server.events_replay_port}")
        for who in ("member", "stranger")
    }
    member = EventSubscriber(
        [streams["member"]],
        EventIndex(),
        replay_timeout_s=5,
        curve=ClientCurve(server_public=server_keys[0], public=client_keys[0], secret=client_keys[1]),
    )
    outsider = EventSubscriber(
        [streams["stranger"]],
        EventIndex(),
        replay_timeout_s=1,
        curve=ClientCurve(server_public=server_keys[0], public=stranger[0], secret=stranger[1]),
    )
    try:
        src = real_kv(6)
        ns = engine.namespace_for(REAL_NS["model"], FMT_REAL, src, salt=REAL_NS["salt"])
        engine.store(list(range(2 * REAL_CHUNK)), src, list(range(2 * PER_CHUNK)), FMT_REAL, namespace=ns)
        pool = {e.key for e in engine._res.index if e.readable}
        _settle(member, lambda: member.index.keys("member", "CPU") == pool and len(pool) == 2)
        outsider.poll(1.0)
        assert outsider.index.keys("stranger", "CPU") == set() and streams["stranger"].last_seq == -1
    finally:
        member.close()
        outsider.close()
        server.stop()
        engine.close()
    tenants = SecurityConfig(
        curve_secret_key=server_keys[1].decode(),
        tenants=[{"name": "a", "public_key": client_keys[0].decode(), "namespaces": [{"model": "m"}]}],
    )
    with pytest.raises(ServerStartError, match=r"events_port with security\.tenants"):
        KvferryServer(ServerConfig(port=0, http_port=None, events_port=0), _engine([]), security=tenants).start()
