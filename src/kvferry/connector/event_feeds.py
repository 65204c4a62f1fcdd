"""Where a connector's `BlockEvents` read the cache's records: the cache's own queue when it lives in this process
(`CacheFeed`), a kvferry server's KV event stream otherwise (`StreamFeed`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvferry.cache import CacheEngine
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.events import AllCleared, Record
from kvferry.client.event_index import EventIndex, EventSubscriber, Stream
from kvferry.connector.block_events import BlockEvents, RecordFeed
from kvferry.connector.layer_parts import engine_of
from kvferry.connector.settings import ConnectorSettings
from kvferry.security import ClientCurve

log = logging.getLogger(__name__)


class CacheFeed:
    """A cache engine in this process: its event hooks fill a bounded queue (``capacity`` records; a full one
    drops, and the next `take` has the cache re-announce what it holds)."""

    def __init__(self, engine: CacheEngine, capacity: int = 100_000) -> None:
        self._queue = EventQueue(capacity)
        self._source = engine.publish_events(self._queue)
        self._losses = 0

    @property
    def losses(self) -> int:
        return self._losses

    def take(self) -> list[Record]:
        records, lost = self._queue.take()
        if lost:
            self._losses += 1
            log.warning("kvferry: %d KV event records dropped (queue full); the cache re-announces what it holds", lost)
            self._source.resync()
            records += self._queue.take()[0]
        return records

    def close(self) -> None:
        return  # the hooks go with the cache engine


class _Collected(EventIndex):
    """What the subscriber applies, kept as records for `StreamFeed.take` (filled by the feed's thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.records: list[Record] = []
        self.losses = 0

    def apply(self, node: str, records: Sequence[Record]) -> None:
        with self.lock:
            self.records += records

    def forget(self, node: str) -> None:
        with self.lock:
            self.losses += 1
            self.records.append(AllCleared())  # a hole no replay fills: nothing announced before it stands


class StreamFeed:
    """A kvferry server's KV event stream (``endpoint``, and its replay socket ``replay_endpoint``), followed by a
    thread of its own: a replay after a gap waits on the server (up to ``replay_timeout_s``), never the caller of
    `take`, which is the engine's scheduler."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        curve: ClientCurve | None = None,
        *,
        replay_timeout_s: float = 5.0,
    ) -> None:
        self._collected = _Collected()
        self._stopping = threading.Event()

        def follow() -> None:
            # zmq sockets stay in the thread that made them: the subscriber is made, polled and closed here, so
            # the first replay (what the server published before) does not hold up the engine's start either
            subscriber = None
            try:
                stream = Stream("server", endpoint, replay_endpoint)
                subscriber = EventSubscriber([stream], self._collected, replay_timeout_s=replay_timeout_s, curve=curve)
                while not self._stopping.is_set():
                    subscriber.poll(0.1)
            except Exception:
                log.exception("kvferry: the KV event stream %s is not followed", endpoint)
                self._collected.forget("server")
            finally:
                if subscriber is not None:
                    subscriber.close()

        self._thread = threading.Thread(target=follow, name="kvferry-event-feed", daemon=True)
        self._thread.start()

    @property
    def losses(self) -> int:
        return self._collected.losses

    def take(self) -> list[Record]:
        with self._collected.lock:
            records, self._collected.records = self._collected.records, []
        return records

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()


def block_events_for(
    settings: ConnectorSettings,
    lookups: Any,
    *,
    block_size: int,
    chunk_size: int,
    groups: Sequence[str] = (),
) -> BlockEvents | None:
    """A scheduler half's `BlockEvents` (an engine's ``block_size``, the cache's ``chunk_size``, ``groups``: a
    model's KV cache groups as its key spaces name them, none for one group): from the cache engine behind
    ``lookups`` (embedded mode) or the server's stream (server mode, ``settings.events_url``); None, with the reason
    logged, where there is neither or the stream cannot be followed (events are an extra: the connector serves on
    without them)."""
    feed: RecordFeed
    engine = engine_of(lookups)
    if engine is None and not (settings.mode == "server" and settings.events_url):
        log.warning(
            "kvferry: the engine publishes KV events, but kvferry's blocks are not among them: server mode needs the "
            "server's event stream in the connector's events_url (docs/events.md)"
        )
        return None
    try:
        if engine is not None:
            feed = CacheFeed(engine)
        else:
            endpoint, _, replay = str(settings.events_url).partition(",")
            feed = StreamFeed(endpoint, replay or None, settings.client_curve())
    except Exception as exc:
        log.error(
            "kvferry: kvferry's blocks are not announced in the engine's KV events: %s: %s", type(exc).__name__, exc
        )
        return None
    return BlockEvents(feed, block_size=block_size, chunk_size=chunk_size, groups=groups)
