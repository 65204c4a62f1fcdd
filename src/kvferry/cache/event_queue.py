"""The bounded queue between the cache's hooks and whoever publishes its events.

The hooks run on the cache's own threads, some under its lock: ``put`` appends a record and never blocks or
waits for room. A full queue drops the record and counts it; the publisher sees the count on its next ``take``,
and then has the cache re-announce what it holds (``CacheEngine.resync_events``), so a consumer's picture is
whole again after the marker (``AllCleared``) that starts the re-announcement.
"""

from __future__ import annotations

import threading
from collections import deque

from kvferry.cache.events import Record


class EventQueue:
    """Records waiting to be published, at most ``capacity`` of them. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be >= 1")
        self.capacity = capacity
        self._records: deque[Record] = deque()
        self._lock = threading.Lock()
        self._lost = 0  # dropped since the last take
        self.dropped = 0  # dropped since the start

    def put(self, record: Record) -> None:
        """Queue ``record``, or drop it (counted) when the queue is full."""
        with self._lock:
            if len(self._records) < self.capacity:
                self._records.append(record)
            else:
                self._lost += 1
                self.dropped += 1

    def take(self) -> tuple[list[Record], int]:
        """Every queued record, oldest first, and how many were dropped since the last take."""
        with self._lock:
            records = list(self._records)
            self._records.clear()
            lost, self._lost = self._lost, 0
        return records, lost

    def replace(self, records: list[Record]) -> None:
        """Drop what is queued (a re-announcement supersedes it) and queue ``records`` instead, whatever their
        number: the caller holds the locks under which the cache puts its records, so none can come between."""
        with self._lock:
            self._records.clear()
            self._records.extend(records)
            self._lost = 0  # whatever was dropped, the re-announcement covers it

    def __len__(self) -> int:
        return len(self._records)
