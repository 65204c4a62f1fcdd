"""vLLM's sleep mode (0.33): the KV memory is released before a sleep and mapped again after the wake-up, maybe at
other addresses. vLLM calls ``unregister_kv_caches`` before it releases the memory and ``restore_kv_caches`` once
the KV is mapped again (``wake_up`` with the ``kv_cache`` tag); ``discard`` unregisters only. In between, a load is
reported failed (vLLM recomputes it) and lookups in this process miss; what happens to the transfers and
registrations is `kvferry.connector.kv_release`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvferry.cache import CacheEngine
from kvferry.connector import backends
from kvferry.connector.kv_release import fall_asleep, wake
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
