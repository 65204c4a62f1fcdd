"""The unified-cache linker's offloads as SGLang takes their outcomes: in the order the offloads started (it pairs
the n-th outcome it takes with its n-th offload), each ended once every copy of it (a move) has (`stored`).

An offload ends when its copies have (`kvferry.connector.copy_ends`): SGLang may then reuse the pages, and the poll
that tells it so looks at the copies' ends itself (a CUDA event in process, a done flag through a server) instead of
waiting for the thread that saw them end to resolve the offload's future (in process, after making the pages
readable: 0.1-0.4 ms more of a 64-page offload on a GPU host). The cache finishes that bookkeeping before it is
read (`kvferry.cache.steps.StoredEarly`), so a lookup after the offload ended finds the pages.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

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


@dataclass
class _Offload:
    outcome: Future[bool]
    copied_probes: list[Callable[[], bool]] | None  # whether each of its copies has ended (`copied_probe`)
    copied: bool = False  # every one of them seen ended

    def ended(self) -> bool:
        if self.outcome.done() or self.copied:
            return True
        if not self.copied_probes:
            return False
        try:
            self.copied = all(copied() for copied in self.copied_probes)
        except Exception:  # a copy that failed on the GPU: its future says how it went
            log.debug("kvferry: querying an offload's copy", exc_info=True)
        return self.copied


class OffloadOutcomes:
    """The offloads' outcomes in the order the offloads started, each taken once it and every one before it ended."""

    def __init__(self) -> None:
        self._offloads: deque[_Offload] = deque()
        self._lock = threading.Lock()

    def add(self, outcome: Future[bool], copied_probes: list[Callable[[], bool]] | None = None) -> None:
        """The next offload's outcome (it may be done already), and ``copied_probes``: whether each of its copies
        has ended, where every move of it has one or has ended (it then ends once they say so)."""
        with self._lock:
            self._offloads.append(_Offload(outcome, copied_probes or None))

    def ended(self) -> int:
        with self._lock:
            return next((i for i, offload in enumerate(self._offloads) if not offload.ended()), len(self._offloads))

    def take(self) -> bool:
        """The oldest offload's outcome (True: stored), taken; False where it has not ended. One taken at its
        copies' end is stored: what fails after (making its pages readable) leaves them a miss, logged by
        `stored`."""
        with self._lock:
            if not self._offloads or not self._offloads[0].ended():
                return False
            outcome = self._offloads.popleft().outcome
        return outcome.result() if outcome.done() else True

    def clear(self) -> None:
        """Wait for every offload under way, then drop every outcome."""
        with self._lock:
            offloads = list(self._offloads)
        for offload in offloads:
            offload.outcome.exception()
        with self._lock:
            for offload in offloads:
                self._offloads.remove(offload)
