"""The unified-cache linker's offloads as SGLang takes their outcomes: in the order the offloads started (it pairs
the n-th outcome it takes with its n-th offload), each ended once every copy of it (a move) has (`stored`)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

log = logging.getLogger(__name__)

Move = tuple[int, "Future[int]"]  # a move's pages, and the tokens it moved


def stored(moves: list[Move]) -> bool:
    """Whether the ended ``moves`` of an offload stored (a cache that kept fewer pages than asked still did: they
    are looked up anew); a failure logged."""
    for _, future in moves:
        error = future.exception()
        if error is not None:
            log.warning("kvferry: a linker offload failed: %s: %s", type(error).__name__, error)
            return False
    return True


class OffloadOutcomes:
    """The offloads' outcomes in the order the offloads started, each taken once it and every one before it ended."""

    def __init__(self) -> None:
        self._outcomes: deque[Future[bool]] = deque()
        self._lock = threading.Lock()

    def add(self, outcome: Future[bool]) -> None:
        """The next offload's outcome (it may be done already)."""
        with self._lock:
            self._outcomes.append(outcome)

    def ended(self) -> int:
        with self._lock:
            return next((i for i, outcome in enumerate(self._outcomes) if not outcome.done()), len(self._outcomes))

    def take(self) -> bool:
        with self._lock:
            if not self._outcomes or not self._outcomes[0].done():
                return False
            return self._outcomes.popleft().result()

    def clear(self) -> None:
        """Wait for every offload under way, then drop every outcome."""
        with self._lock:
            outcomes = list(self._outcomes)
        for outcome in outcomes:
            outcome.exception()
        with self._lock:
            for outcome in outcomes:
                self._outcomes.remove(outcome)
