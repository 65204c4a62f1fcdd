"""The tier interface: where chunk objects go when they leave the host pool.

A tier stores one object (a contiguous CPU tensor) per key and gives it back bit-exact or not at all. Its
promise to the cache: nothing it returns is unverified (header + checksum are checked first), and nothing it
does raises into the caller because the backend is down, slow, full or holds garbage -- those are misses,
counted in Prometheus metrics labelled by tier name and logged. Programming errors (a key that is not bytes,
a tensor that is not a contiguous CPU tensor) still raise, immediately, naming the argument.

Which calls touch the backend: put/get (on the tier's workers), contains/contains_many/delete (on the caller's
thread, bounded by the backend's timeout) and `check`. `stats()`, `healthy`, `used_bytes` and `capacity_bytes`
never do: a server answers them from any thread, whatever state the backend is in.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TypeVar

import torch

from kvferry.tiers.header import check_key, tensor_bytes
from kvferry.tiers.health import HealthGate
from kvferry.tiers.held import HeldListener, HeldObjects
from kvferry.tiers.metrics import TierMetrics, tier_registry

log = logging.getLogger(__name__)

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None]
"""Returns an uninitialised contiguous tensor of that shape and dtype to read into, or None (pool full)."""
Free = Callable[[torch.Tensor], None]
"""Gives back a tensor obtained from `Alloc` that the tier did not return (the object failed verification)."""

T = TypeVar("T")

# How often the "tier is full" warning may repeat: a full tier refuses every put, and one line says it.
_FULL_LOG_INTERVAL_S = 60.0


class TierUnavailable(Exception):
    """The backend could not be reached or answered too slowly; the tier is marked unhealthy."""


class TierFull(Exception):
    """The backend has no room for this object; the put is refused but the tier stays healthy."""


def resolved(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


def _note_put(held: HeldObjects, name: str, key: bytes, written: Future[bool]) -> None:
    if written.exception() is None and written.result():
        held.add(name, key)


class Tier(ABC):
    """One storage tier. Thread-safe; put/get run on the tier's own workers and return futures."""

    # Where the tier is relative to this process: "LOCAL" (this machine) or "REMOTE" (a service other nodes share).
    locality = "LOCAL"

    def __init__(self, name: str, *, backoff_s: float = 1.0, backoff_max_s: float = 60.0) -> None:
        self.name = name
        self._metrics = TierMetrics(name)
        self._health = HealthGate(name, backoff_s, backoff_max_s, on_change=self._metrics.set_healthy)
        self._closed = False
        self._last_full_log = -_FULL_LOG_INTERVAL_S
        # This tier's `kvferry_tier_*` metrics; a cache engine exports all of its tiers' in its own registry.
        self.metrics_registry = tier_registry(lambda: [self._metrics])
        self._held: HeldObjects | None = None  # set by watch()

    @property
    def metrics(self) -> TierMetrics:
        return self._metrics

    # --- public interface -------------------------------------------------------------------------------

    def put(self, key: bytes, obj: torch.Tensor) -> Future[bool]:
        """Store `obj` under `key` in the background. The caller keeps `obj` alive and unmodified until the
        future is done. Resolves to False (never raises) when the tier is down or full."""
        check_key(key)
        payload = tensor_bytes(obj)
        if not self._admit("put"):
            return resolved(False)
        written = self._submit_put(key, obj, payload)
        held = self._held
        if held is not None:
            name = self._object_name(key)
            written.add_done_callback(partial(_note_put, held, name, key))
        return written

    def get(self, key: bytes, alloc: Alloc, free: Free | None = None) -> Future[torch.Tensor | None]:
        """Read the object stored under `key` into a tensor from `alloc`. Resolves to None on a miss: absent,
        failed verification (then it is deleted), `alloc` returned None, or the tier is down. A tensor from
        `alloc` that the tier does not return (the disk tier reads before it can verify) goes to `free`:
        pass the pool's free, or such a miss leaks pool memory."""
        check_key(key)
        if not self._admit("get"):
            return resolved(None)
        return self._submit_get(key, alloc, free)

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the tier holds (one round trip where the backend allows). All False when down."""
        for key in keys:
            check_key(key)
        if not keys:
            return []
        if not self._admit("contains"):
            return [False] * len(keys)
        try:
            found = self._contains(list(keys))
        except Exception as exc:
            self._record_failure("contains", exc)
            return [False] * len(keys)
        self._record_success("contains", "ok")
        return found

    def delete(self, key: bytes) -> None:
        check_key(key)
        if not self._admit("delete"):
            return
        try:
            self._delete(key)
        except Exception as exc:
            self._record_failure("delete", exc)
            return
        self._record_success("delete", "ok")

    def check(self) -> bool:
        """Probe the backend now with one cheap round trip (through the health gate: an unhealthy tier is only
        probed when its backoff allows) and refresh the usage `stats()` reports; returns whether it is healthy.
        Nobody else may be touching an idle tier, so a server calls this periodically to know a tier is down."""
        if self._closed or not self._health.allow():
            return self.healthy
        try:
            probed = self._check()
        except Exception as exc:
            self._record_failure("check", exc if isinstance(exc, TierUnavailable) else TierUnavailable(str(exc)))
            return False
        if probed:
            self._health.success()
        return self.healthy

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """The tier's size limit; None when the backend manages its own (Redis maxmemory)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int | None:
        """Bytes held, as this process last saw (no I/O); None when it cannot tell (backend down, not checked)."""

    @abstractmethod
    def evict(self, nbytes: int) -> int:
        """Free at least `nbytes` by the tier's own policy if it has one; returns the bytes freed."""

    def use_memory(self, memory: torch.Tensor) -> None:  # noqa: B027 -- a hook most tiers leave empty
        """``memory`` (the host pool's slab) is where the tier's objects come from and go to: a tier whose
        transport moves bytes directly from registered memory registers it. Most tiers need nothing."""

    def watch(self, listener: HeldListener) -> HeldObjects:
        """Tell ``listener`` of every object this tier gains or loses from now on (see `kvferry.tiers.held`);
        returns what it holds now (``keys()``: the objects found at the start whose key the tier keeps, and what
        it gained since). Once per tier."""
        if self._held is not None:
            raise RuntimeError(f"tier {self.name} is watched already")
        self._held = HeldObjects(listener, self._objects_held())
        return self._held

    def stats(self) -> dict[str, object]:
        return {
            "name": self.name,
            "healthy": self.healthy,
            "retry_in_s": round(self._health.retry_in_s, 3),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            **self._metrics.snapshot(),
        }

    def close(self) -> None:
        """Finish queued writes and release the backend. Later operations are misses."""
        self._closed = True

    # --- for implementations ----------------------------------------------------------------------------

    @abstractmethod
    def _submit_put(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> Future[bool]: ...

    @abstractmethod
    def _submit_get(self, key: bytes, alloc: Alloc, free: Free | None) -> Future[torch.Tensor | None]: ...

    @abstractmethod
    def _contains(self, keys: list[bytes]) -> list[bool]: ...

    @abstractmethod
    def _delete(self, key: bytes) -> None: ...

    def _object_name(self, key: bytes) -> str:
        """The tier's name for the object of ``key`` (what its evictions report)."""
        return key.hex()

    def _objects_held(self) -> dict[str, bytes]:
        """Name -> key of the objects the tier holds now, where it can tell (read once, by ``watch``)."""
        return {}

    def _forget(self, names: list[str]) -> None:
        """Objects the tier no longer holds (deleted, evicted, found missing): a watcher is told."""
        if self._held is not None:
            self._held.remove(names)

    def _check(self) -> bool:
        """One cheap round trip to the backend (refreshing what it reports of its usage); raises if it fails.
        False: this tier has no such probe, and its health is what its operations last showed."""
        return False

    def _admit(self, op: str) -> bool:
        if not self._closed and self._health.allow():
            return True
        self._metrics.op(op, "unavailable")
        return False

    def _record_success(self, op: str, result: str, nbytes: int = 0, started: float | None = None) -> None:
        self._health.success()
        self._metrics.op(op, result, nbytes, None if started is None else time.perf_counter() - started)

    def _record_failure(self, op: str, exc: BaseException) -> None:
        """Turn a failed operation into a counted miss; only TierUnavailable marks the tier unhealthy."""
        if isinstance(exc, TierFull):
            self._health.success()
            self._metrics.op(op, "full")
            now = time.monotonic()
            if now - self._last_full_log >= _FULL_LOG_INTERVAL_S:
                self._last_full_log = now
                log.warning("tier %s is full, refusing writes: %s", self.name, exc)
        elif isinstance(exc, TierUnavailable):
            self._health.failure(exc)
            self._metrics.op(op, "unavailable")
        else:
            self._metrics.op(op, "error")
            log.error("tier %s: unexpected error in %s", self.name, op, exc_info=exc)

    def _record_corrupt(self, key: bytes, reason: BaseException) -> None:
        """A bad object is a miss: count it, say so, and delete it so nobody reads it again."""
        self._health.success()
        self._metrics.op("get", "corrupt")
        log.warning("tier %s: dropping corrupt object %s: %s", self.name, key.hex()[:32], reason)
        try:
            self._delete(key)
        except Exception as exc:
            self._record_failure("delete", exc)
