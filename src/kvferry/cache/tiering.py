"""Moving objects between the host pool and the storage tiers below it: write-behind and promotion.

Nothing here raises into the engine: a tier that fails, refuses or returns garbage yields a miss (the tier
verifies what it reads; a write that fails drops the object), counted in the cache's and the tier's metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch

from kvferry.cache.index import Entry
from kvferry.cache.residency import Residency
from kvferry.tiers import Tier

log = logging.getLogger(__name__)


class TierLink:
    """The cache's side of its tiers (an ordered list: lookups fall through them in order).

    ``write_mode`` "on_evict": evicted objects are written to the first tier, then freed (write-behind).
    "on_store": every stored object is written to every tier at once (tiers shared between machines see it
    immediately), and eviction just drops it.
    """

    def __init__(
        self,
        tiers: list[Tier],
        residency: Residency,
        write_mode: str,
        checksum: Callable[[torch.Tensor], bytes] | None,
    ) -> None:
        if write_mode not in ("on_evict", "on_store"):
            raise ValueError(f"write_mode={write_mode!r} must be 'on_evict' or 'on_store'")
        self.tiers = list(tiers)
        self.write_on_store = write_mode == "on_store"
        self._residency = residency
        self._checksum = checksum
        if not self.write_on_store:
            residency.on_spill = self.spill

    def spill(self, entries: list[Entry]) -> None:
        """Write entries chosen for eviction to the first tier; each holds one reader for it."""
        for entry in entries:
            self._put(self.tiers[0], entry, spilled=True)

    def write_through(self, entries: list[Entry]) -> None:
        """Write freshly stored entries to every tier; each holds one reader per tier for it."""
        for entry in entries:
            for tier in self.tiers:
                self._put(tier, entry, spilled=False)

    def fall_through(self, keys: list[bytes], parent: bytes | None) -> tuple[int, list[Future[None]]]:
        """For keys after the pool's hits: how many leading ones are on their way into the pool. ``keys`` are
        consecutive chunks; ``parent`` is the key of the chunk before ``keys[0]`` (None for chunk 0).

        Keys already indexed (loading, or stored meanwhile) count; absent keys are looked up in the tiers in
        order and promoted from the first that holds them; the first key found nowhere ends the run. Returns
        the run's length and futures that finish when its promotions have landed (or missed).
        """
        with self._residency.lock:
            known = [self._residency.index.get(key) for key in keys]
        found_in: dict[int, Tier] = {}
        remaining = [i for i, entry in enumerate(known) if entry is None]
        for tier in self.tiers:
            if not remaining:
                break
            found = tier.contains_many([keys[i] for i in remaining])
            found_in.update((i, tier) for i, hit in zip(remaining, found, strict=True) if hit)
            remaining = [i for i, hit in zip(remaining, found, strict=True) if not hit]
        run = 0
        waits: list[Future[None]] = []
        for i, entry in enumerate(known):
            if entry is None:
                source = found_in.get(i)
                if source is None:
                    break
                landed = self._promote(keys[i], source, keys[i - 1] if i else parent)
                if landed is not None:
                    waits.append(landed)
            elif entry.loaded is not None:
                waits.append(entry.loaded)
            run += 1
        return run, waits

    def _put(self, tier: Tier, entry: Entry, spilled: bool) -> None:
        assert entry.obj is not None
        try:
            written = tier.put(entry.key, entry.obj)
        except Exception:
            log.exception("tier %s: put raised; dropping the object", tier.name)
            self._residency.tier_write_done(entry, False, spilled)
            return
        written.add_done_callback(partial(self._written, entry, spilled))

    def _written(self, entry: Entry, spilled: bool, written: Future[bool]) -> None:
        ok = written.exception() is None and bool(written.result())
        self._residency.tier_write_done(entry, ok, spilled)

    def _promote(self, key: bytes, tier: Tier, parent: bytes | None) -> Future[None] | None:
        entry = self._residency.begin_promotion(key, parent)
        if entry is None:
            return None  # indexed meanwhile by another caller
        assert entry.loaded is not None
        try:
            read = tier.get(
                key,
                partial(self._residency.alloc_for_promotion, entry),
                partial(self._residency.free_promotion_buffer, entry),
            )
        except Exception:
            log.exception("tier %s: get raised; treating it as a miss", tier.name)
            self._residency.end_promotion(entry, None, None)
            return entry.loaded
        read.add_done_callback(partial(self._promoted, entry))
        return entry.loaded

    def _promoted(self, entry: Entry, read: Future[torch.Tensor | None]) -> None:
        obj = read.result() if read.exception() is None else None
        checksum = self._checksum(obj) if self._checksum is not None and obj is not None else None
        self._residency.end_promotion(entry, obj, checksum)
