"""The ordered tiers below the host pool (`--l2 disk:... --l2 redis://...` in that order), used as one."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from kvferry.tiers.base import Alloc, Free, Tier, resolved


class TierChain:
    """Reads try the tiers in order and return the first verified hit; writes go to every tier.

    A hit in a lower tier is not copied into the tiers above it: the cache decides what to promote (it can
    `put` the object it got back into `tiers[i]`).
    """

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = tuple(tiers)
        names = [tier.name for tier in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers must have distinct names (their metrics labels), got {names}")

    def put(self, key: bytes, obj: torch.Tensor) -> Future[bool]:
        """Store in every tier. Done when every tier is (then `obj` may be reused); True if any stored it."""
        if not self.tiers:
            return resolved(False)
        futures = [tier.put(key, obj) for tier in self.tiers]
        result: Future[bool] = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future[bool]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                result.set_result(any(f.result() for f in futures))

        for future in futures:
            future.add_done_callback(one_done)
        return result

    def get(self, key: bytes, alloc: Alloc, free: Free | None = None) -> Future[torch.Tensor | None]:
        result: Future[torch.Tensor | None] = Future()

        def attempt(index: int) -> None:
            if index == len(self.tiers):
                result.set_result(None)
                return

            def done(future: Future[torch.Tensor | None]) -> None:
                if future.exception() is not None:
                    result.set_exception(future.exception())  # a programming error, e.g. a bad alloc
                elif future.result() is not None:
                    result.set_result(future.result())
                else:
                    attempt(index + 1)

            self.tiers[index].get(key, alloc, free).add_done_callback(done)

        attempt(0)
        return result

    def contains(self, key: bytes) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether any tier holds it; each tier is asked only about keys the tiers above lack."""
        found = [False] * len(keys)
        for tier in self.tiers:
            missing = [i for i, hit in enumerate(found) if not hit]
            if not missing:
                break
            for i, hit in zip(missing, tier.contains_many([keys[i] for i in missing]), strict=True):
                found[i] = hit
        return found

    def delete(self, key: bytes) -> None:
        for tier in self.tiers:
            tier.delete(key)

    def stats(self) -> list[dict[str, object]]:
        return [tier.stats() for tier in self.tiers]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
