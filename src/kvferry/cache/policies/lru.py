"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvferry.cache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched key first.

    Recency is logical: a key passed over because it is pinned keeps its place, so once unpinned it is evicted
    exactly when its last real access makes it the oldest.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def insert(self, key: bytes) -> None:
        if key in self._order:
            raise KeyError(f"LRUPolicy.insert: key {key.hex()[:16]}... is already tracked")
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def demote(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key, last=False)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        if n <= 0:
            return victims
        for key in self._order:
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
