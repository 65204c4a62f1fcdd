"""`KvferryConnector`: kvferry as a vLLM V1 KV connector (vLLM calls it; it forwards to the two halves).

vLLM makes two instances per engine: one with the scheduler role (`SchedulerSide`: lookups and plans) and one
with the worker role (`WorkerSide`: loads and stores). Each step's plan travels from the first to the second as
the connector metadata; once, at start-up, the worker tells the scheduler the cache key space of its KV (the
handshake metadata), which a scheduler in another process needs for its lookups. This module only translates
between vLLM's objects and those halves.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient, ServerError
from kvferry.integrations.vllm import backends
from kvferry.integrations.vllm.kv_layout import EngineKV, UnsupportedKVLayout, recognise
from kvferry.integrations.vllm.plan import StepPlan
from kvferry.integrations.vllm.scheduler_side import SchedulerSide
from kvferry.integrations.vllm.settings import ConnectorSettings
from kvferry.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KvferryConnectorMetadata(KVConnectorMetadata):
    """One step's `StepPlan`, in the type vLLM passes from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvferryHandshake(KVConnectorHandshakeMetadata):
    """What the worker half tells the scheduler half once KV is registered: the cache key space (plain fields)."""

    def __init__(self, namespace: dict[str, str | int]) -> None:
        self.namespace = namespace


class KvferryConnector(KVConnectorBase_V1):
    """Loads prompt prefixes kvferry holds into vLLM's blocks and stores newly computed ones.

    Requires tensor and pipeline parallel size 1. Embedded mode also needs the scheduler and the worker in one
    process (vLLM's CPU backend: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); server mode works either way. Modes and
    settings: see `ConnectorSettings`.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        world_size = vllm_config.parallel_config.world_size
        if world_size != 1:
            raise ValueError(
                f"KvferryConnector needs tensor_parallel_size * pipeline_parallel_size == 1, got {world_size}"
            )
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._scheduler_warned = False
        self._handshake: KvferryHandshake | None = None  # worker: sent; scheduler: received
        self._lookup_client: backends.ServerLookup | None = None
        self._worker: WorkerSide | None = None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is only a later miss

    # --- worker side --------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            kv = self._recognise(kv_caches)
            backend = self._make_backend(kv)
        except (UnsupportedKVLayout, ConnectionError, TimeoutError, ServerError) as exc:
            log.error("kvferry connector disabled (every lookup is a miss): %s", exc)
            return
        backends.publish(self._engine_id, backend)
        self._handshake = KvferryHandshake(backend.namespace_fields())
        hook = self._settings.load_after_load_hook()
        self._worker = WorkerSide(
            backend,
            block_size=kv.block_size,
            after_load=None if hook is None else lambda block_ids: hook(kv.layers, block_ids),
        )
        log.info(
            "kvferry connector (%s mode): %d layers of %s, format %s, chunk %d tokens",
            self._settings.mode,
            len(kv.layers),
            tuple(kv.layers[0].shape),
            kv.fmt.name,
            backend.chunk_size,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # vLLM calls this before the forward pass in steps with loads, so loading here synchronously keeps
        # every layer's KV in place before any attention layer reads it.
        if self._worker is not None:
            self._worker.load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv already loaded every layer (objects hold all layers of a chunk)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores copy all layers at once in wait_for_save, after the last layer wrote its KV

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.start_stores(self._plan())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvferryConnectorMetadata):
            self._worker.wait_for_requests(kv_connector_metadata.plan.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.finished_sending(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._handshake

    def shutdown(self) -> None:
        if self._lookup_client is not None:
            self._lookup_client.close()
            self._lookup_client = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
            backend = backends.withdraw(self._engine_id)
            if backend is not None:
                backend.close()

    # --- scheduler side -----------------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        received = metadata.get(0)
        if isinstance(received, KvferryHandshake):
            self._handshake = received

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._scheduler_side()
        if side is None:
            return 0, False
        matched = side.num_new_matched_tokens(
            request.request_id,
            request.prompt_token_ids or [],
            request.num_tokens,
            num_computed_tokens,
            cacheable=not (request.mm_features or request.lora_request or request.cache_salt),
        )
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        side = self._scheduler_side()
        if side is not None:
            side.after_alloc(request.request_id, request.prompt_token_ids or [], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self._scheduler_side()
        return KvferryConnectorMetadata(side.build_plan(scheduler_output) if side is not None else StepPlan())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        side = self._scheduler_side()
        return (side is not None and side.request_finished(request.request_id)), None

    # --- helpers ------------------------------------------------------------------------------------------

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvferryConnectorMetadata), type(metadata)
        return metadata.plan

    def _recognise(self, kv_caches: dict[str, torch.Tensor]) -> EngineKV:
        layers = self._vllm_config.compilation_config.static_forward_context
        isas = {getattr(layers.get(name), "isa", None) for name in kv_caches}
        if len(isas) != 1:
            raise UnsupportedKVLayout(f"attention layers use different CPU ISAs {sorted(map(str, isas))}")
        kv = recognise(kv_caches, isa=isas.pop(), kv_cache_dtype=str(self._vllm_config.cache_config.cache_dtype))
        if kv.block_size != self._block_size:
            raise UnsupportedKVLayout(
                f"the KV tensors hold {kv.block_size}-token blocks but the scheduler uses {self._block_size}"
            )
        return kv

    def _make_backend(self, kv: EngineKV) -> backends.Backend:
        model = self._settings.model_id or _served_model_name(self._vllm_config)
        if self._settings.mode == "server":
            client = KvferryClient(self._settings.server_url, timeout_s=self._settings.timeout_s)
            try:
                return backends.ServerBackend(client, kv, model=model, salt=self._settings.salt)
            except BaseException:
                client.close()
                raise
        engine = CacheEngine(self._settings.kvferry_config(), name=f"vllm-{self._engine_id[:8]}")
        namespace = engine.namespace_for(
            model, kv.fmt, kv.layers, world_size=1, rank=0, salt=self._settings.salt, block_size=kv.block_size
        )
        return backends.EmbeddedBackend(engine, kv, namespace)

    def _scheduler_side(self) -> SchedulerSide | None:
        """The scheduler half, made on first use: over the worker's backend when it lives in this process,
        else over a lookup-only session with the server in the key space the worker reported."""
        if self._scheduler is not None:
            return self._scheduler
        lookups: backends.Backend | backends.ServerLookup | None = backends.find(self._engine_id)
        if lookups is None and self._handshake is not None and self._settings.mode == "server":
            try:
                client = KvferryClient(self._settings.server_url, timeout_s=self._settings.timeout_s)
            except (ConnectionError, TimeoutError) as exc:
                self._warn_once(f"cannot reach {self._settings.server_url} ({exc}); lookups miss")
                return None
            lookups = self._lookup_client = backends.ServerLookup(client, self._handshake.namespace)
        if lookups is None:
            self._warn_once(
                "no KV cache registered with kvferry for this engine"
                + (
                    " (embedded mode needs vLLM's worker in the scheduler's process: on the CPU backend set "
                    "VLLM_ENABLE_V1_MULTIPROCESSING=0, or use server mode)"
                    if self._handshake is not None
                    else ""
                )
                + "; lookups miss"
            )
            return None
        self._scheduler = SchedulerSide(lookups.lookup, block_size=self._block_size, chunk_size=lookups.chunk_size)
        return self._scheduler

    def _warn_once(self, message: str) -> None:
        if not self._scheduler_warned:
            log.error("kvferry: %s", message)
            self._scheduler_warned = True


def _served_model_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)
