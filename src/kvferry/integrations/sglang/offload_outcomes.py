"""The unified-cache linker's offloads as SGLang takes their outcomes: in the order the offloads started (it pairs
the n-th outcome it takes with its n-th offload), each ended once every copy of it (a move) has (`stored`).

An offload whose copies run on this process's GPU ends when the GPU has copied them (`copy_end`): SGLang may then
reuse the pages, and the poll that tells it so queries the copies' ends itself instead of waiting for the worker that
saw them end to resolve the offload's future and make its pages readable (0.1-0.4 ms more of a 64-page offload on
a GPU host). A lookup in that short while misses them (as through a server, which answers at the copy's end too).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from kvferry.integrations.sglang.load_counter import CopyEnd

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
    ends: list[CopyEnd] | None  # its copies on this process's GPU, where all of it is
    copied: bool = False  # every one of them seen ended

    def ended(self) -> bool:
        if self.outcome.done() or self.copied:
            return True
        if not self.ends:
            return False
        try:
            self.copied = all(end.done() for end in self.ends)
        except Exception:  # a failed copy's end: its future says how it went
            log.debug("kvferry: querying an offload's copy", exc_info=True)
        return self.copied


class OffloadOutcomes:
    """The offloads' outcomes in the order the offloads started, each taken once it and every one before it ended."""

    def __init__(self) -> None:
        self._offloads: deque[_Offload] = deque()
        self._lock = threading.Lock()

    def add(self, outcome: Future[bool], ends: list[CopyEnd] | None = None) -> None:
        """The next offload's outcome (it may be done already), and ``ends``: the ends of its copies on this
        process's GPU, when it has some and every move of it is one of them or has ended (its outcome then comes
        once they have)."""
        with self._lock:
            self._offloads.append(_Offload(outcome, ends or None))

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
