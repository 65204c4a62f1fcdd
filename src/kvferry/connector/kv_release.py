"""An engine's KV memory released and mapped again (vLLM's sleep mode; SGLang's memory release is the same shape):
what the connector's worker side and backends do around it, engine-neutral.

Before the memory goes (`fall_asleep`) the worker's transfers in flight end, new ones are refused, and the
registrations of the old memory go: in server mode each session with the server ends (the server unmaps the KV and
frees its locks); in embedded mode the cache engine and what it holds stay, to register into again. Once the memory
is back, the engine adapter registers the KV as at start and `wake` moves what that made into the objects in use,
so the engine's scheduler half (which holds the old backend's bound methods) and the requests' state carry on.
"""

from __future__ import annotations

from typing import Any

from kvferry.cache import CacheEngine
from kvferry.connector.layer_parts import engine_of
from kvferry.connector.worker_side import WorkerSide


def fall_asleep(worker: WorkerSide, backend: Any, *, server_mode: bool) -> CacheEngine | None:
    """Drain ``worker``, refuse its transfers, drop ``backend``'s registrations (the one published for the
    scheduler); the cache engine to register into again on waking (embedded mode), else None."""
    worker.drain()
    worker.refuse_transfers()
    if server_mode:
        backend.close()  # each session ends: the server unmaps the engine's KV and frees its locks
        return None
    return engine_of(backend)


def wake(worker: WorkerSide, backend: Any, new_worker: WorkerSide, new_backend: Any) -> None:
    """Move what registering the KV again made (``new_worker``'s backends, ``new_backend``'s parts) into the
    objects in use: vLLM's scheduler half holds ``backend``'s methods, and ``worker`` the requests' state."""
    adopt(backend, new_backend)
    worker.adopt_backends(new_worker)


def adopt(old: Any, new: Any) -> None:
    """``old`` becomes ``new`` (same class: registered from the same KV with the same settings), keeping its
    identity (the scheduler half's bound methods, the registry of backends)."""
    if type(old) is not type(new):
        raise TypeError(f"registered again as {type(new).__name__}, not {type(old).__name__}")
    vars(old).update(vars(new))
