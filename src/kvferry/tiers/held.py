"""Which objects a tier holds, as far as this process knows, for a listener told once of each that comes or goes.

Off unless someone watches the tier (`Tier.watch`): a cache that publishes KV events. Each object is known by the
tier's name for it (the disk tier's file name) and its key; a put that succeeds adds it, a delete, an eviction or
a read that finds it gone removes it. The listener is called under ``lock``, so a snapshot of ``keys()`` taken
under the same lock is in order with what the listener was told.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

HeldListener = Callable[[list[bytes], list[bytes]], None]
"""``listener(keys now held, keys no longer held)``: called with the lock held; it must not call back in."""


class HeldObjects:
    def __init__(self, listener: HeldListener, held: dict[str, bytes]) -> None:
        self.lock = threading.Lock()
        self._listener = listener
        self._keys = dict(held)  # name -> key

    def add(self, name: str, key: bytes) -> None:
        with self.lock:
            if name not in self._keys:
                self._keys[name] = key
                self._listener([key], [])

    def remove(self, names: Iterable[str]) -> None:
        with self.lock:
            gone = [key for name in names if (key := self._keys.pop(name, None)) is not None]
            if gone:
                self._listener([], gone)

    def keys(self) -> list[bytes]:
        """The keys held now (call with ``lock`` held to keep it in order with the listener)."""
        return list(self._keys.values())

    def __len__(self) -> int:
        return len(self._keys)
