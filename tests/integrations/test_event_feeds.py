"""`StreamFeed` (kvferry.connector.event_feeds): a server's KV event stream followed on a thread of the feed's own,
so the engine's scheduler, which calls `take` every step, never waits on the network: records arrive, a replay that
is never answered holds up no `take`, an endpoint that cannot be followed is one counted loss, and `close` ends
the thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import zmq

from kvferry.cache.events import AllCleared, ChunksStored, Record
from kvferry.config import ServerConfig
from kvferry.connector.event_feeds import StreamFeed
from kvferry.formats import EngineKVFormat
from kvferry.server import KvferryServer
from tests.cache.cachekit import CHUNK, NB, cache_engine, make_paged, random_blocks, random_tokens

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def _collect(feed: StreamFeed, until: Callable[[list[Record]], bool], timeout_s: float = 30.0) -> list[Record]:
    got: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while not until(got) and time.monotonic() < deadline:
        got += feed.take()
        time.sleep(0.01)
    return got


def _stored_keys(records: list[Record]) -> set[bytes]:
    return {key for r in records if isinstance(r, ChunksStored) for key in r.keys}


def test_a_servers_records_arrive_what_was_published_before_included() -> None:
    paged = make_paged(FMT, NB, seed=1)
    with cache_engine(64, FMT, paged) as engine:
        server = KvferryServer(ServerConfig(port=0, http_port=None, events_port=0, events_replay_port=0), engine)
        server.start()
        try:
            first, second = random_tokens(2 * CHUNK, seed=1), random_tokens(2 * CHUNK, seed=2)
            engine.store(first, paged, random_blocks(2 * CHUNK // 16, 1), FMT)  # before the feed subscribed
            keys = set(engine.chunk_keys(first))
            feed = StreamFeed(f"tcp://127.0.0.1:{server.events_port}", f"tcp://127.0.0.1:{server.events_replay_port}")
            try:
                assert keys <= _stored_keys(_collect(feed, lambda got: keys <= _stored_keys(got)))  # replayed
                engine.store(second, paged, random_blocks(2 * CHUNK // 16, 2), FMT)
                more = set(engine.chunk_keys(second))
                assert more <= _stored_keys(_collect(feed, lambda got: more <= _stored_keys(got)))  # live
                assert feed.losses == 0
            finally:
                started = time.monotonic()
                feed.close()
                assert time.monotonic() - started < 2.0
        finally:
            server.stop()


def test_a_replay_never_answered_holds_up_no_take() -> None:
    """A publisher whose replay socket takes requests and never answers: the feed's thread waits on it (up to its
    replay timeout), each `take` returns at once meanwhile."""
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    try:
        pub_port, replay_port = (
            pub.bind_to_random_port("tcp://127.0.0.1"),
            router.bind_to_random_port("tcp://127.0.0.1"),
        )
        feed = StreamFeed(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", replay_timeout_s=3.0)
        try:
            assert router.poll(5000)  # the feed's first replay request: it now waits for an answer
            slowest = 0.0
            for _ in range(50):
                started = time.monotonic()
                assert feed.take() == []
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.01)
            assert slowest < 0.05
        finally:
            feed.close()
    finally:
        ctx.destroy(linger=0)


def test_an_endpoint_that_cannot_be_followed_is_one_counted_loss(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="kvferry.connector.event_feeds"):
        feed = StreamFeed("tcp://127.0.0.1:not-a-port", None)
        got = _collect(feed, lambda got: bool(got), timeout_s=10.0)
        feed.close()
    assert got == [AllCleared()] and feed.losses == 1  # what was announced before stands no more
    assert "is not followed" in caplog.text
