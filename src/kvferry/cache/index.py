"""The cache index: key -> entry (where the object is, its size and checksum, who is using it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum

import torch
import xxhash


class State(Enum):
    WRITING = "writing"  # allocated in the pool, a store's copy in progress: not readable yet
    LOADING = "loading"  # being promoted from a tier into the pool: not readable yet
    RESIDENT = "resident"  # in the pool, readable, tracked by the eviction policy
    SPILLING = "spilling"  # chosen for eviction, being written to the next tier; still readable meanwhile


READABLE = frozenset({State.RESIDENT, State.SPILLING})  # states whose object a retrieve may read


@dataclass(slots=True, eq=False)
class Entry:
    """One chunk object the cache knows about. Mutated only under the cache engine's lock."""

    key: bytes
    state: State
    obj: torch.Tensor | None = None  # its pool memory (None while LOADING before the tier allocated it)
    nbytes: int = 0
    checksum: bytes | None = None  # set when the engine verifies checksums
    readers: int = 0  # copies reading the object right now (retrieves, tier writes)
    pins: int = 0  # lookup locks holding it
    persisted: bool = False  # a copy is known to be in a tier, so eviction needs no write
    detached: bool = False  # dropped from the index while in use: its last reader frees it
    loaded: Future[None] | None = None  # while LOADING: done once the promotion has landed or missed

    @property
    def readable(self) -> bool:
        return self.state in READABLE

    @property
    def evictable(self) -> bool:
        """Resident, and nobody reads, writes or pins it."""
        return self.state is State.RESIDENT and self.readers == 0 and self.pins == 0


class CacheIndex:
    """Entries by key. Not thread-safe: the cache engine calls it under its lock."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        # `get` is the dict's own (a bound builtin): lookups walk hundreds of keys per call.
        self.get: Callable[[bytes], Entry | None] = self._entries.get

    def add(self, entry: Entry) -> None:
        if entry.key in self._entries:
            raise KeyError(f"CacheIndex.add: key {entry.key.hex()[:16]}... is already indexed")
        self._entries[entry.key] = entry

    def pop(self, key: bytes) -> Entry:
        return self._entries.pop(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def count(self, state: State) -> int:
        return sum(1 for e in self._entries.values() if e.state is state)


def object_checksum(obj: torch.Tensor) -> bytes:
    """xxh3-128 of an object's bytes (objects are contiguous CPU tensors in the pool): guards against corruption,
    at >10 GB/s per core."""
    return xxhash.xxh3_128(obj.reshape(-1).view(torch.uint8).numpy()).digest()
