"""`KvferryConnector`: kvferry as a vLLM V1 KV connector (vLLM calls it; it forwards to the two halves).

vLLM makes two instances per engine: one with the scheduler role (`scheduler_side`: lookups and plans) and one
with the worker role (`WorkerSide`: loads and stores). Each step's plan travels from the first to the second as
the connector metadata, and the loads that ran travel back as worker metadata (so the scheduler frees the locks
that pinned their hits); once, at start-up, the worker tells the scheduler the cache key space of its KV (the
handshake metadata), which a scheduler in another process needs for its lookups. This module only translates
between vLLM's objects and those halves.

Hybrid models (vLLM's hybrid KV cache manager: sliding-window, chunked-local and full attention groups, and Mamba
groups under vLLM's prefix caching): the connector supports it (`SupportsHMA`); each group's layers are KV of
their own (`kv_groups`; a Mamba group's states: `state_groups`) and the scheduler half plans each group's share of
a load or store (`kvferry.connector.hybrid_scheduler`).

Tensor parallelism (server mode): every rank's worker registers its slice of the KV heads with the server, whose
objects hold every head; the scheduler's one lookup answers for all ranks (an object is a hit once every head is
written), each rank loads and stores its columns, and a lookup's lock goes once every rank reported its load.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvferry.connector import backends, hybrid_worker, layer_parts
from kvferry.connector.chunk_choice import follow_block_size
from kvferry.connector.counters import SchedulerCounters, WorkerCounters
from kvferry.connector.kv_groups import KVGroup, UnsupportedGroups
from kvferry.connector.plan import StepPlan
from kvferry.connector.scheduler_lookups import ServerLookups, loads_in_background, server_lookups
from kvferry.connector.serving_guard import guard_for, serving_hook
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import StateViews
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm import kv_access, logs, vllm_versions
from kvferry.integrations.vllm import off_answers as off
from kvferry.integrations.vllm.connector_metadata import KvferryConnectorMetadata, KvferryHandshake, KvferryWorkerMeta
from kvferry.integrations.vllm.kv_events import VllmKVEvents, kv_events_for
from kvferry.integrations.vllm.kv_layout import (
    UnsupportedKVLayout,
    in_layer_order,
    refused_cache_dtype,
    tensor_parallel_rank,
)
from kvferry.integrations.vllm.scheduler_side import GroupedSchedulerSide, SchedulerSide, scheduler_side_for
from kvferry.integrations.vllm.sleep_mode import SleepModeHooks
from kvferry.integrations.vllm.state_settings import restore_scheduler_block_size, warn_of_sparse_state_retention
from kvferry.integrations.vllm.vllm_groups import hybrid_groups
from kvferry.integrations.vllm.vllm_kv import attention_isa, describe, recognise_vllm_kv, served_model_name
from kvferry.integrations.vllm.vllm_stats import KvferryPromMetrics, KvferryStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KvferryConnector(SleepModeHooks, KVConnectorBase_V1, SupportsHMA):
    """Loads prompt prefixes kvferry holds into vLLM's blocks and stores newly computed ones.

    Server mode works with tensor parallelism and in any process layout. Embedded mode needs the scheduler and
    the worker in one process (tensor parallel size 1; vLLM's CPU backend: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    Pipeline parallelism is refused (an object holds every layer of its chunk). Modes and
    settings: see `ConnectorSettings`. A load that fails is recomputed by vLLM: the connector sets vLLM's
    ``kv_load_failure_policy`` to "recompute" (a cache miss must never fail a request).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        logs.show_in_vllm_log()  # by the module's name: tests keep records where pytest captures them
        vllm_versions.warn_if_untested()
        self._settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"KvferryConnector needs pipeline_parallel_size 1, got {parallel.pipeline_parallel_size} (a chunk "
                "object holds every layer)"
            )
        self._tp_size = parallel.tensor_parallel_size
        if self._tp_size != 1 and self._settings.mode != "server":
            raise ValueError(
                f"KvferryConnector's embedded mode needs tensor_parallel_size 1, got {self._tp_size}: each rank is "
                "a process of its own, so its ranks share one cache through a kvferry server (mode 'server')"
            )
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._block_size = vllm_config.cache_config.block_size
        self._groups: list[KVGroup] = []  # a hybrid model's KV cache groups (empty: one full-attention group)
        # A KV cache kvferry cannot move is refused here, once, with the reason; vLLM serves on without it.
        self._groups_refused: str | None = refused_cache_dtype(str(vllm_config.cache_config.cache_dtype))
        try:
            self._groups = hybrid_groups(kv_cache_config) if self._groups_refused is None else []
        except UnsupportedGroups as exc:
            self._groups_refused = str(exc)
        if self._groups_refused is not None and role == KVConnectorRole.WORKER:
            log.error("kvferry connector disabled (every lookup is a miss): %s", self._groups_refused)
        if role == KVConnectorRole.SCHEDULER:
            warn_of_sparse_state_retention(vllm_config.cache_config.prefix_cache_retention_interval, self._groups)
        block_sizes = {group.block_size for group in self._groups} or {self._block_size}
        self._settings = follow_block_size(self._settings, block_sizes, announce=role == KVConnectorRole.WORKER)
        if self._settings.mode == "embedded" and self._groups_refused is None:
            self._check_chunk_size(self._settings.kvferry_config().cache.chunk_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM reads it right after making its scheduler's connector. Its default, "fail", would end a request
            # whose load came back short with an error; a cache's miss must cost only the recomputation.
            log.info("kvferry: setting vLLM's kv_load_failure_policy to 'recompute' (a failed load is recomputed)")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._scheduler: SchedulerSide | GroupedSchedulerSide | None = None
        self._scheduler_warned = False
        self._events: VllmKVEvents | None = None  # kvferry's blocks in vLLM's KV events (`kv_events`)
        self._handshake: KvferryHandshake | None = None  # worker: sent; scheduler: received
        self._lookup_backend: ServerLookups | None = None
        self._worker: WorkerSide | None = None
        self._stats_since: dict[str, float] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}  # as registered: registered again after vLLM's sleep
        self._kept_engine = None  # embedded mode's cache engine while vLLM sleeps (`SleepModeHooks`)
        self._guard = guard_for(self._engine_id)  # an error while serving turns the connector off (`serving_guard`)
        self._guard.on_turn_off(self._turn_off)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is only a later miss

    @property
    def worker_counters(self) -> WorkerCounters | None:
        """The worker half's counters (its loads and stores so far); None in a scheduler's instance, or while no
        KV is registered with kvferry."""
        return self._worker.counters if self._worker is not None else None

    # --- worker side --------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._groups_refused is not None:
            return
        self._kv_caches = kv_caches
        try:
            states = {name for group in self._groups if group.holds_state for name in group.layer_names}
            isa = attention_isa(self._vllm_config, {n: kv for n, kv in kv_caches.items() if n not in states})
            if self._groups:  # a hybrid model: each group's layers apart (their shapes and places may differ)
                self._register_groups(kv_caches, isa)
                return
            kv = recognise_vllm_kv(self._vllm_config, kv_caches, isa, self._block_size)
        except UnsupportedKVLayout as exc:
            log.error("kvferry connector disabled (every lookup is a miss): %s", exc)
            return
        model = self._settings.model_id or served_model_name(self._vllm_config)
        started = layer_parts.start_worker(
            self._settings, kv, model=model, block_size=self._block_size, name=f"vllm-{self._engine_id[:8]}",
            engine=self._kept_engine,
        )  # fmt: skip
        backends.publish(self._engine_id, started.backend)
        self._handshake, self._worker = KvferryHandshake(started.key_space), started.worker
        settings, exact = self._settings, started.exact_layers
        log.info(
            "%s", describe(settings, self._vllm_config, kv_caches, kv, isa, started.backend, exact, self._block_size)
        )

    @serving_hook(off.nothing)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # vLLM calls this before the forward pass in steps with foreground loads (which complete here, so every
        # layer's KV is in place before any attention layer reads it) and after it otherwise (background loads
        # start here and are reported by get_finished).
        if self._worker is not None:
            self._worker.start_loads(self._plan())

    @serving_hook(off.nothing)
    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv already loaded every layer (objects hold all layers of a chunk)

    @serving_hook(off.nothing)
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores copy all layers at once in wait_for_save, after the last layer wrote its KV

    @serving_hook(off.nothing)
    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.start_stores(self._plan())

    @serving_hook(off.nothing)
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this every step, before the forward pass: a windowed group's blocks freed since the last step
        # may be written by this one, so their stores end now.
        if self._worker is not None and isinstance(kv_connector_metadata, KvferryConnectorMetadata):
            self._worker.settle_windowed_stores()
            self._worker.preempted(kv_connector_metadata.plan.preempted)

    @serving_hook(off.no_reports)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.finished_sending(finished_req_ids) or None, self._worker.finished_loading() or None

    @serving_hook(off.no_transfer_results)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A model of several KV cache groups reports a short load by request (vLLM cannot map a failed block id
        # back to its request there, and raises): the request counts as received, and vLLM recomputes it.
        sending, loading = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sending or ()), set(loading or ()) | failed, failed)

    @serving_hook(off.no_block_ids)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    @serving_hook(off.nothing)
    def build_connector_worker_meta(self) -> KvferryWorkerMeta | None:
        if self._worker is None:
            return None
        loaded, failed = self._worker.take_load_report()
        return KvferryWorkerMeta(Counter(loaded), failed) if loaded else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._handshake

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._events is not None:
            self._events.close()
        if self._lookup_backend is not None:
            self._lookup_backend.close()
            self._lookup_backend = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
            backend = backends.withdraw(self._engine_id)
            if backend is not None:
                backend.close()

    # --- scheduler side -----------------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        received = metadata.get(0)
        if not isinstance(received, KvferryHandshake):
            return
        self._handshake = received
        if self._settings.mode == "server" and backends.find(self._engine_id) is None and self._lookup_backend is None:
            # The worker is in another process: this half looks up through a session of its own, made now (at
            # start-up) so the first request never waits for it.
            self._lookup_backend = server_lookups(
                self._settings, received.key_space, received.group_key_spaces, self._groups,
                block_size=self._block_size, check_chunk_size=self._check_chunk_size,
            )  # fmt: skip

    @serving_hook(off.no_tokens, when_off=off.matched_off, seen=off.saw_matched, while_asleep=off.matched_off)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._scheduler_side()
        return side.get_num_new_matched_tokens(request, num_computed_tokens) if side is not None else (0, False)

    @serving_hook(off.nothing, when_off=off.allocated, seen=off.saw_allocated)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        side = self._scheduler_side()
        if side is not None:
            side.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    @serving_hook(off.empty_plan, when_off=off.plan_off, seen=off.saw_plan)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self._scheduler_side()
        return KvferryConnectorMetadata(side.build_plan(scheduler_output) if side is not None else StepPlan())

    @serving_hook(off.nothing, when_off=off.nothing_off)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and connector_output.finished_sending:
            self._scheduler.stores_done(connector_output.finished_sending)
            if self._events is not None:
                self._events.stores_done(connector_output.finished_sending)
        if self._scheduler is not None and isinstance(report, KvferryWorkerMeta):
            self._scheduler.loads_done(report.loaded.elements(), report.failed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    @serving_hook(off.blocks_freed, when_off=off.finished_off, seen=off.saw_finished)
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # `block_ids`: the blocks holding what the request computed (a windowed group's freed ones: null)
        saving = self._scheduler is not None and self._scheduler.request_finished_all_groups(request, block_ids)
        if self._events is not None:
            self._events.finished(request, saving)
        return saving, None

    @serving_hook(off.no_events)
    def take_events(self) -> list[KVCacheEvent]:
        # vLLM's scheduler publishes these with its own each step (--kv-events-config); only this half emits
        return self._events.take() if self._events is not None else []

    # --- metrics ------------------------------------------------------------------------------------------

    @serving_hook(off.nothing, when_off=off.nothing_off)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        scheduler_counters = self._scheduler.counters if self._scheduler is not None else None
        counters: WorkerCounters | SchedulerCounters | None = self.worker_counters or scheduler_counters
        moved = counters.take(self._stats_since) if counters is not None else {}
        if self._events is not None:  # its counters' names are their own: one `since` serves both
            moved |= self._events.counters().take(self._stats_since)
        return KvferryStats(data=moved) if moved else None

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: how the workers reach the KV cache (server mode: file descriptors, or legacy CUDA IPC where
        they cannot pass; see `kv_access`)."""
        return kv_access.kv_cache_access(kv_transfer_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvferryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- helpers ------------------------------------------------------------------------------------------

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvferryConnectorMetadata), type(metadata)
        return metadata.plan

    def _register_groups(self, kv_caches: dict[str, torch.Tensor], isa: str | None) -> None:
        """A hybrid model's KV: each group's layers registered as KV of their own (`hybrid_worker`)."""
        kvs = [  # a state's rows are cut by the chunk size, which a server tells once connected
            StateViews([kv_caches[n] for n in g.layer_names], g.layer_names, g.page_bytes)
            if g.holds_state
            else recognise_vllm_kv(self._vllm_config, {n: kv_caches[n] for n in g.layer_names}, isa, g.block_size)
            for g in self._groups
        ]
        model = self._settings.model_id or served_model_name(self._vllm_config)
        name, hook = f"vllm-{self._engine_id[:8]}", self._settings.load_after_load_hook()
        hybrid = hybrid_worker.start_hybrid_worker(
            self._settings, kvs, self._groups, model=model, name=name, after_load_hook=hook,
            model_layers=in_layer_order(list(kv_caches)), tp=tensor_parallel_rank(self._vllm_config)[0],
            engine=self._kept_engine,
        )  # fmt: skip
        backends.publish(self._engine_id, hybrid.lookups)
        self._handshake = KvferryHandshake(hybrid.key_spaces[0], hybrid.key_spaces)
        self._worker = hybrid.worker
        log.info("%s", hybrid_worker.describe(self._settings, kvs, self._groups, hybrid.lookups.chunk_size))
        if not self._settings.async_load and loads_in_background(self._settings, self._groups):
            log.warning(
                "kvferry: async_load is false, but a model of several KV cache groups loads in the background: "
                "vLLM takes such a model's failed load only from a load it waits for"
            )

    def _turn_off(self) -> None:
        """After an error while serving (`serving_guard`): free the lookups' locks; the worker refuses transfers."""
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.refuse_transfers()

    def _check_chunk_size(self, chunk_size: int) -> None:
        for block_size in sorted({group.block_size for group in self._groups} or {self._block_size}):
            self._settings.check_chunk_size(chunk_size, block_size)

    def _scheduler_side(self) -> SchedulerSide | GroupedSchedulerSide | None:
        """The scheduler half, made on first use: over the worker's backend when it lives in this process,
        else over a lookup-only session with the server in the key space the worker reported."""
        if self._scheduler is not None or self._groups_refused is not None:  # the worker logged why it is off
            return self._scheduler
        restore_scheduler_block_size(self._vllm_config.cache_config, self._groups)  # before vLLM schedules one
        lookups: backends.Lookups | None = backends.find(self._engine_id) or self._lookup_backend
        if lookups is None:
            why = " (embedded mode needs vLLM's worker in the scheduler's process: on the CPU backend set " \
                "VLLM_ENABLE_V1_MULTIPROCESSING=0, or use server mode)" if self._handshake else ""  # fmt: skip
            if not self._scheduler_warned:
                log.error("kvferry: no KV cache registered with kvferry for this engine%s; lookups miss", why)
                self._scheduler_warned = True
            return None
        self._scheduler = scheduler_side_for(lookups, self._settings, self._groups, self._block_size, self._tp_size)
        if self._scheduler is not None:
            single = self._scheduler.side if isinstance(self._scheduler, GroupedSchedulerSide) else self._scheduler
            self._events = kv_events_for(
                self._vllm_config, self._settings, lookups, self._groups,
                block_size=self._block_size, chunk_size=single.chunk_size,
            )  # fmt: skip
        return self._scheduler
