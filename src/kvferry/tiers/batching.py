"""Turn single-object requests into pipelined batches without delaying any of them.

Each worker thread blocks for one request, then takes whatever else has queued up meanwhile (up to a count
and a byte limit) and runs it all as one batch -- for Redis, one pipeline round trip. A lone request is not
held back waiting for company; batching happens exactly when requests arrive faster than they are served.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

log = logging.getLogger(__name__)


class BatchItem(Protocol):
    nbytes: int  # what the request moves, for the batch byte limit
    future: Future  # completed by the runner; if it forgets, the batcher completes it with `miss`
    miss: object


class Batcher:
    def __init__(
        self,
        run: Callable[[list], None],
        *,
        workers: int,
        max_items: int,
        max_bytes: int,
        name: str,
    ) -> None:
        if workers < 1 or max_items < 1 or max_bytes < 1:
            raise ValueError(f"workers={workers}, max_items={max_items}, max_bytes={max_bytes} must all be >= 1")
        self._run = run
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._queue: queue.SimpleQueue[BatchItem | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # orders submit() against close()'s stop marker
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, item: BatchItem) -> bool:
        """Queue `item`; False once the batcher is closed."""
        with self._lock:
            if self._closed:
                return False
            self._queue.put(item)
            return True

    def close(self) -> None:
        """Run everything queued so far, then stop the workers."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.put(None)  # let the other workers see it too
                return
            batch = [first]
            nbytes = first.nbytes
            while len(batch) < self._max_items and nbytes < self._max_bytes:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
                nbytes += item.nbytes
            try:
                self._run(batch)
            except Exception:
                log.exception("%s: batch of %d failed", threading.current_thread().name, len(batch))
            finally:
                for item in batch:
                    if not item.future.done():
                        item.future.set_result(item.miss)
