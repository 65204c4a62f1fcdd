"""What a client hands back (a lookup's result, a prefetch's status) and what it keeps per registration of GPU KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.client.done_flags import DoneFlags
from kvferry.client.ready_events import ReadyEvents


@dataclass(frozen=True, slots=True)
class LocateResult:
    """LOCATE's answer: a prefix's objects in the server's shared pool, held for this client until ``deadline``."""

    tokens: int  # prefix tokens the objects hold
    lease: int | None  # free it with free_lookup_locks once copied (None: nothing located)
    deadline: float  # time.monotonic() on this host: a copy that ended later may have read other bytes
    objects: list[tuple[int, int]]  # each object's (byte offset in the pool, tokens), in prefix order
    pool: tuple[int, int, int]  # the server's (pid, descriptor of the pool's memfd, bytes): `PoolMapping`'s


@dataclass(frozen=True, slots=True)
class LookupResult:
    tokens: int  # prefix tokens ready in the server's host pool (chunk-aligned)
    pending: int  # further prefix tokens on their way up from a lower tier (ask again shortly)
    lock: int | None  # lock id when the lookup locked: pass it to retrieve(lock=) or free_lookup_locks
    located: LocateResult | None = None  # lookup(locate=True) where the server locates: ``lock`` is its lease


@dataclass(frozen=True, slots=True)
class Reserved:
    """RESERVE's or COMMIT's answer: objects reserved for this client in the server's shared pool."""

    objects: list[int]  # byte offsets in the pool of objects of a whole chunk, this client's to copy into
    stored: int  # COMMIT: the tokens the committed objects added (0 for RESERVE)
    pool: tuple[int, int, int] | None  # RESERVE: the pool's (pid, memfd descriptor, bytes), as `LocateResult.pool`


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    done: bool
    tokens: int  # prefix tokens now in the server's host pool (when done)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class GpuRegistration:
    """What a client keeps of one registration of GPU KV, as one record so that it goes whole: the device, the
    ring of ready events the server opened, and the done flags its GPU signals transfers on."""

    device: torch.device
    ready: ReadyEvents
    flags: DoneFlags
