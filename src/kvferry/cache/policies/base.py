"""The interface every eviction policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar


class EvictionPolicy(ABC):
    """Decides which resident objects leave the host pool, by key only.

    A policy never sees memory, pins or transfers. At eviction time the cache passes ``can_evict``, and a key
    it rejects (locked by a lookup, being read or written) is passed over *in place*: its recency/frequency
    stays what the accesses made it, because being pinned for a copy says nothing about future reuse. Not
    thread-safe: the cache calls it under its own lock.
    """

    name: ClassVar[str]

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """Start tracking a newly resident object; ``key`` must not be tracked already."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """Record an access (a retrieve, or a store of a chunk already present); unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Stop tracking ``key`` (deleted, cleared or corrupt); unknown keys are ignored."""

    @abstractmethod
    def demote(self, key: bytes) -> None:
        """``key`` is worth less than its accesses say (a tail that a longer object superseded): it goes where
        the next eviction looks first; unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``n`` victims, in eviction order, each accepted by ``can_evict``; they are no longer tracked.

        Returns fewer than ``n`` only when no other tracked key is accepted.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked (resident) keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""
