"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvferry.cache.policies.base import EvictionPolicy

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """Three FIFO queues: a small probationary queue S, a main queue M and a ghost queue G of keys only.

    New keys enter S (or M, if G remembers them as recently evicted from S). Evicting from S: a key accessed
    at least once since it entered moves to M; otherwise it leaves, and G remembers it. Evicting from M is
    CLOCK-like: a key with accesses left has its counter decremented and goes back to M's tail. S is the
    eviction source while it holds at least ``small_ratio`` of the tracked keys. One-hit prefixes (most
    prompts' tails) thus leave quickly without flushing the shared system-prompt chunks in M.

    Sizes are counted in objects, not bytes (a cache's objects mostly share one shape). Keys rejected by
    ``can_evict`` keep their place and counter.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        if not 0 < small_ratio < 1:
            raise ValueError(f"small_ratio={small_ratio!r} must be in (0, 1)")
        self._small_ratio = small_ratio
        self._small: OrderedDict[bytes, int] = OrderedDict()  # key -> access count, oldest first
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        # The ghost remembers as many keys as the cache has held at most (its capacity in objects, as far as
        # a policy that only sees keys can tell).
        self._ghost_limit = 1

    def insert(self, key: bytes) -> None:
        if key in self._small or key in self._main:
            raise KeyError(f"S3FIFOPolicy.insert: key {key.hex()[:16]}... is already tracked")
        if key in self._ghost:  # evicted from S recently and wanted again: it belongs in M
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0
        self._ghost_limit = max(self._ghost_limit, len(self))

    def touch(self, key: bytes) -> None:
        for queue in (self._small, self._main):
            freq = queue.get(key)
            if freq is not None:
                queue[key] = min(freq + 1, _MAX_FREQ)
                return

    def demote(self, key: bytes) -> None:
        """To the head of the probation queue with no access counted: the next eviction from S takes it."""
        if key in self._small or key in self._main:
            self._main.pop(key, None)
            self._small[key] = 0
            self._small.move_to_end(key, last=False)

    def remove(self, key: bytes) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)
        self._ghost.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        while len(victims) < n:
            key = self._evict_one(can_evict)
            if key is None:
                break
            victims.append(key)
        return victims

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def queue_of(self, key: bytes) -> str | None:
        """'small', 'main' or 'ghost' (None if unknown): where ``key`` is, for tests and debugging."""
        for name, queue in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if key in queue:
                return name
        return None

    def _evict_one(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        small_first = not self._main or len(self._small) >= self._small_ratio * len(self)
        order = (self._evict_small, self._evict_main) if small_first else (self._evict_main, self._evict_small)
        for evict_from in order:
            key = evict_from(can_evict)
            if key is not None:
                return key
        return None

    def _evict_small(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        passed_over: list[tuple[bytes, int]] = []
        victim = None
        while self._small:
            key, freq = self._small.popitem(last=False)
            if not can_evict(key):
                passed_over.append((key, freq))
            elif freq > 0:
                self._main[key] = freq  # reused while on probation: keeps its count in M
            else:
                victim = key
                self._remember(key)
                break
        _restore_front(self._small, passed_over)
        return victim

    def _evict_main(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        passed_over: list[tuple[bytes, int]] = []
        victim = None
        # Each evictable key is re-queued at most _MAX_FREQ times, so this ends within the bound.
        for _ in range((_MAX_FREQ + 1) * len(self._main) + 1):
            if not self._main:
                break
            key, freq = self._main.popitem(last=False)
            if not can_evict(key):
                passed_over.append((key, freq))
            elif freq > 0:
                self._main[key] = freq - 1
            else:
                victim = key
                break
        _restore_front(self._main, passed_over)
        return victim

    def _remember(self, key: bytes) -> None:
        self._ghost[key] = None
        while len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)


def _restore_front(queue: OrderedDict[bytes, int], passed_over: list[tuple[bytes, int]]) -> None:
    """Put keys passed over (pinned) back at the front of ``queue`` in their original order."""
    for key, freq in reversed(passed_over):
        queue[key] = freq
        queue.move_to_end(key, last=False)
