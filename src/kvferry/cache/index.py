"""The cache index: key -> entry (where the object is, its size and checksum, who is using it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum

import torch
import xxhash

from kvferry.cache.keys import PageKeys, PrefixKeys


class State(Enum):
    WRITING = "writing"  # allocated in the pool, a store's copy in progress: not readable yet
    LOADING = "loading"  # being promoted from a tier into the pool: not readable yet
    RESIDENT = "resident"  # in the pool, readable, tracked by the eviction policy
    SPILLING = "spilling"  # chosen for eviction, being written to the next tier; still readable meanwhile


READABLE = frozenset({State.RESIDENT, State.SPILLING})  # states whose object a retrieve may read
# Hot loops test `state is RESIDENT or state is SPILLING`: `in READABLE` calls Enum.__hash__, a Python function.
RESIDENT, SPILLING, WRITING = State.RESIDENT, State.SPILLING, State.WRITING


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
    parent: bytes | None = None  # key of the previous chunk of the same prefix; None for chunk 0 (or unknown)
    tail: int = 0  # a tail object's tokens (fewer than a chunk, after chunk ``parent``); 0 for a full chunk
    # While WRITING: the stores copying into the object now, and (an object assembled from head slices, one per
    # tensor-parallel rank) the heads no store has taken yet, as a bit mask. Readable once both are zero.
    writers: int = 0
    unclaimed_heads: int = 0
    expires: float = 0.0  # an assembled object: dropped at this time.monotonic() if heads are still unclaimed

    @property
    def readable(self) -> bool:
        return self.state in READABLE

    @property
    def evictable(self) -> bool:
        """Resident, and nobody reads, writes or pins it."""
        return self.state is State.RESIDENT and self.readers == 0 and self.pins == 0


class CacheIndex:
    """Entries by key. Not thread-safe: the cache engine calls it under its lock.

    Invariant: a readable entry stops being readable only by leaving the index (states go WRITING/LOADING ->
    RESIDENT <-> SPILLING, never back), and every removal bumps ``removals``. So entries found readable without
    the lock are all still readable if ``removals`` has not moved since before they were looked up.
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self.removals = 0
        # `get` is the dict's own (a bound builtin): lookups walk hundreds of keys per call.
        self.get: Callable[[bytes], Entry | None] = self._entries.get
        # Tail objects by parent: parent key -> {tail length: how many tails of that length}. A lookup hashes
        # only the lengths stored after its last full chunk (a tail's key commits to its exact tokens).
        self._tails: dict[bytes | None, dict[int, int]] = {}
        # Told of every entry that leaves the index, before its state changes (KV events: `event_hooks`).
        self.on_removed: Callable[[Entry], None] | None = None

    def add(self, entry: Entry) -> None:
        if entry.key in self._entries:
            raise KeyError(f"CacheIndex.add: key {entry.key.hex()[:16]}... is already indexed")
        self._entries[entry.key] = entry
        if entry.tail:
            lengths = self._tails.setdefault(entry.parent, {})
            lengths[entry.tail] = lengths.get(entry.tail, 0) + 1

    def pop(self, key: bytes) -> Entry:
        entry = self._entries.pop(key)
        self.removals += 1  # after the pop: a reader that sees the old count cannot miss the removal
        if self.on_removed is not None:
            self.on_removed(entry)
        if entry.tail:
            lengths = self._tails[entry.parent]
            lengths[entry.tail] -= 1
            if not lengths[entry.tail]:
                del lengths[entry.tail]
                if not lengths:
                    del self._tails[entry.parent]
        return entry

    def tail_lengths(self, parent: bytes | None) -> list[int]:
        """The lengths of the tails stored after chunk ``parent``, longest first (read without the lock: a
        snapshot, which the caller checks against the entries it then finds)."""
        lengths = self._tails.get(parent)
        return sorted(lengths, reverse=True) if lengths else []

    @property
    def has_tails(self) -> bool:
        return bool(self._tails)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def count(self, state: State) -> int:
        return sum(1 for e in self._entries.values() if e.state is state)


def readable_run(get: Callable[[bytes], Entry | None], keys: PrefixKeys, start: int = 0) -> list[Entry]:
    """Entries of chunks ``start, start + 1, ...`` of ``keys``'s tokens, up to the first chunk not readable.

    Hashing chunk by chunk costs ~1.5 us of interpreter time per chunk; a parent link costs a dict lookup. So
    this computes a few keys and walks links: probe chunk ``start`` (a miss there is the cold case), then the last
    chunk (the warm case: all hit), then bisect; probing chunk ``m`` computes its key and walks parent links down
    to the run already known readable. A key commits to its whole prefix, so the entry under our key of chunk
    ``m`` has our key of chunk ``m - 1`` as its parent (barring a hash collision). Reads the index without the
    lock (dict reads are atomic): the caller re-checks the result under it (``Residency.still_readable_locked``).
    """
    found: list[Entry] = []
    good, hi = start, keys.n  # chunks [start, good) are in `found`; the first unreadable chunk is in [good, hi]
    m, first_probe = start, True
    while good < hi:
        run = _walk(get, keys.key(m), m + 1 - good)
        if len(run) == m + 1 - good:
            run.reverse()
            found += run
            good = m + 1
        else:  # chunk m - len(run) is missing or unreadable
            hi = m - len(run)
        m = hi - 1 if first_probe else (good + hi - 1) // 2
        first_probe = False
    return found


def readable_pages(get: Callable[[bytes], Entry | None], keys: PageKeys) -> list[Entry]:
    """Entries of pages ``0, 1, ...`` of ``keys``, up to the first page not readable (pages have no parent links
    to walk: each is looked up). Reads the index without the lock, as `readable_run`."""
    found: list[Entry] = []
    for m in range(keys.n):
        entry = get(keys.key(m))
        if entry is None or (entry.state is not RESIDENT and entry.state is not SPILLING):
            break
        found.append(entry)
    return found


def _walk(get: Callable[[bytes], Entry | None], key: bytes | None, steps: int) -> list[Entry]:
    """Up to ``steps`` readable entries from ``key`` back along parent links (newest first)."""
    run: list[Entry] = []
    append = run.append
    for _ in range(steps):
        entry = get(key)  # type: ignore[arg-type]  # a None parent (chunk 0 / unknown) is simply absent
        if entry is None:
            break
        state = entry.state
        if state is not RESIDENT and state is not SPILLING:
            break
        append(entry)
        key = entry.parent
    return run


def object_checksum(obj: torch.Tensor) -> bytes:
    """xxh3-128 of an object's bytes (objects are contiguous CPU tensors in the pool): guards against corruption,
    at >10 GB/s per core."""
    return xxhash.xxh3_128(obj.reshape(-1).view(torch.uint8).numpy().data).digest()
