"""Where a connector's `BlockEvents` read the cache's records: the cache's own queue when it lives in this process
(`CacheFeed`), a kvferry server's KV event stream otherwise (`StreamFeed`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvferry.cache import CacheEngine
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.events import AllCleared, Record
from kvferry.client.event_index import EventIndex, EventSubscriber, Stream
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
