"""vLLM's sleep mode (0.33): the KV memory is released before a sleep and mapped again after the wake-up, maybe at
other addresses. vLLM calls ``unregister_kv_caches`` before it releases the memory and ``restore_kv_caches`` once
the KV is mapped again (``wake_up`` with the ``kv_cache`` tag); ``discard`` unregisters only.

Falling asleep (`fall_asleep`): the worker's loads and stores in flight end (their results reported as usual), the
worker refuses new ones (a load is reported failed: vLLM recomputes it), lookups in this process miss, and the
registrations of the old memory go: in server mode the sessions with the server end (the server unmaps the KV and
frees the locks); in embedded mode the cache engine and what it holds stay, only the views of vLLM's tensors
(copy geometry) are replaced on waking. Waking (`wake`): the KV vLLM registered at start (the same tensors, whose
memory may have moved) is registered again as at start, into the objects vLLM's scheduler and the worker already
use (`adopt`), so a request's state and the scheduler's lookups carry on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvferry.cache import CacheEngine
from kvferry.connector import backends
from kvferry.connector.backends import EmbeddedBackend
from kvferry.connector.serving_guard import ServingGuard, serving_hook
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm import off_answers as off

log = logging.getLogger(__name__)


class SleepModeHooks:
    """The connector's sleep-mode hooks (vLLM 0.33 calls them on the worker's connector; a mixin of
    `KvferryConnector`, whose state they use). While the connector is off they do nothing."""

    _engine_id: str
    _settings: ConnectorSettings
    _guard: ServingGuard
    _worker: WorkerSide | None
    _kv_caches: dict[str, torch.Tensor]
    _kept_engine: CacheEngine | None

    register_kv_caches: Callable[[dict[str, torch.Tensor]], None]

    @serving_hook(off.nothing, when_off=off.nothing_off)
    def unregister_kv_caches(self) -> None:
        """Before vLLM's sleep releases the KV memory: transfers end, the registrations go, lookups miss."""
        backend = backends.find(self._engine_id)
        if self._worker is None or self._guard.asleep or backend is None:
            return
        self._kept_engine = fall_asleep(self._worker, backend, server_mode=self._settings.mode == "server")
        self._guard.asleep = True
        log.info("kvferry: vLLM sleeps: transfers drained, the KV cache unregistered (lookups miss until it wakes)")

    @serving_hook(off.nothing, when_off=off.nothing_off)
    def restore_kv_caches(self) -> None:
        """Once vLLM mapped the KV memory again after a sleep: the KV registered again as at start."""
        worker = self._worker
        if worker is None or not self._guard.asleep:
            return
        backend = backends.withdraw(self._engine_id)
        assert backend is not None  # published at registration, withdrawn only at shutdown
        try:
            self.register_kv_caches(self._kv_caches)
            new_worker, new_backend = self._worker, backends.withdraw(self._engine_id)
            assert new_worker is not None and new_worker is not worker and new_backend is not None
            wake(worker, backend, new_worker, new_backend)
        finally:  # vLLM's scheduler half keeps the objects it holds: awake, or (after an error) off
            self._worker, self._kept_engine = worker, None
            backends.publish(self._engine_id, backend)
        self._guard.asleep = False


def fall_asleep(worker: WorkerSide, backend: Any, *, server_mode: bool) -> CacheEngine | None:
    """Drain ``worker``, refuse its transfers, drop ``backend``'s registrations (the one published for the
    scheduler); the cache engine to register into again on waking (embedded mode), else None."""
    worker.drain()
    worker.refuse_transfers()
    if server_mode:
        backend.close()  # each session ends: the server unmaps the engine's KV and frees its locks
        return None
    return engine_in(backend)


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


def engine_in(backend: Any) -> CacheEngine | None:
    """The cache engine under an embedded backend (a layer split's, a hybrid model's groups': they share one)."""
    if isinstance(backend, EmbeddedBackend):
        return backend.engine
    for inner in [*getattr(backend, "backends", ()), getattr(backend, "backend", None)]:
        if inner is not None:
            return engine_in(inner)
    return None
