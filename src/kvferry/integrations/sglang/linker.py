"""kvferry as SGLang's unified-cache linker: pages move straight between SGLang's device KV pool and kvferry's
cache (in this process, or in a ``kvferry server``), with no host tier between. SGLang loads it by module path:

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "KvferryLinker",
      "linker_module_path": "kvferry.integrations.sglang.linker",
      "linker_extra_config": {"mode": "server", "server_url": "tcp://127.0.0.1:5555"}}'

``linker_extra_config`` takes the HiCache backend's kvferry keys (`ConnectorSettings`: ``mode``, ``server_url``,
``config``, ``salt``, ``model_id``, ...) and ``layer_groups`` (`LinkerSettings`: a load handed to SGLang's forward
in groups of layers, each as it lands). SGLang hands a linker no token ids, only each page's chained hash (64 hex
digits, covering every page before it), so pages are keyed as the HiCache backend keys them (`page_store`: each
page a one-chunk prefix whose tokens spell its hash, the chunk size SGLang's page size), in the same key space
(model, this rank's shard, dtype, object shape, salt): a page one of them stored is a hit for the other. These
objects are not shared with vLLM engines: vLLM's keys hash the token ids of the whole prefix, which SGLang does not
give, so the same prefix has different keys there even where the model and the object shape match.

Models whose tree has sliding-window or Mamba components link those pools too (`device_pools`): a hit then needs
the window's last pages, or the state at its end, as SGLang's hit policies say (`linker_pools`). Other components
(DeepSeek's compressed pools, auxiliary SWA) are refused at start, naming them. The lookups, loads, offloads and
their threads: `linker_store`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from kvferry.connector.engine_kv import UnsupportedKVLayout
from kvferry.integrations.sglang.device_pages import slot_pages
from kvferry.integrations.sglang.device_pools import KV, MAMBA, SWA, device_pools
from kvferry.integrations.sglang.linker_pools import PoolPages, PoolPlan
from kvferry.integrations.sglang.linker_store import LinkerStore, open_linker_store
from kvferry.integrations.sglang.load_counter import LoadCounter
from kvferry.integrations.sglang.storage_settings import LinkerSettings, page_key_space

log = logging.getLogger(__name__)

_POOLS = {ComponentType.FULL: KV, ComponentType.SWA: SWA, ComponentType.MAMBA: MAMBA}  # the tree's, linked


class KvferryLinker(UnifiedCacheLinker):
    """SGLang's device pools linked to kvferry's cache; built by SGLang's linker factory once per worker.

    Nothing raises into SGLang after start: a failed lookup is a miss, a transfer SGLang hands over in a shape
    kvferry does not take is a refused load or offload, a load that does not land fails its batch in the layer
    counter (SGLang aborts the batch's loading requests) and a failed offload is a False result."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: set[ComponentType],
        extra_config: dict[str, Any] | None = None,
        forward_stream: torch.cuda.Stream | None = None,
    ) -> None:
        unsupported = set(components) - set(_POOLS)
        if unsupported:
            names = ", ".join(str(c) for c in sorted(unsupported, key=int))
            raise UnsupportedKVLayout(
                f"kvferry's SGLang linker moves the full-attention, sliding-window and Mamba pools; this model's "
                f"cache also has {names} components"
            )
        try:
            self.settings = LinkerSettings.from_extra_config(dict(extra_config or {}))
        except ValueError as exc:
            raise ValueError(f"--unified-cache-external-linker-config's linker_extra_config: {exc}") from None
        self.forward_stream = forward_stream
        self.page_size = params.page_size
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        linked = device_pools(kvcache, params.req_to_token_pool, self.page_size)
        wanted = {_POOLS[component] for component in components} | {KV}
        if set(linked.pools) != wanted:
            raise UnsupportedKVLayout(
                f"SGLang's tree has the pools {sorted(wanted)} and its device cache {sorted(linked.pools)}"
            )
        self.pools = {PoolName(name): kvcache for name in linked.pools}
        self.layer_done_counter = LoadCounter(linked.num_layers)  # SGLang's calls; waits on the GPU in process
        if MAMBA in linked.pools:  # the forward reads each Mamba layer's loaded state through this counter
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        # An MLA model's TP ranks hold the same pages in one key space (through a server, one of them stores
        # them); states, and an MHA model's pages, are each rank's own.
        sharded_config = _storage_config(server_args, params, False)
        replicated = page_key_space(_storage_config(server_args, params, linked.mla), self.settings)
        sharded = page_key_space(sharded_config, self.settings)
        owner = self.settings.mode != "server" or sharded_config.tp_rank == 0
        plans = [
            PoolPlan(pool, replicated, owner) if linked.mla and not pool.objects[0].state else PoolPlan(pool, sharded)
            for pool in linked.pools.values()
        ]
        self.keys = replicated
        device = linked.pools[KV].objects[0].kv.layers[0].device
        self._on_device, self._device_index = device.type != "cpu", device.index or 0
        self.store: LinkerStore = open_linker_store(
            self.settings, plans, self.page_size, linked.num_layers, self.layer_done_counter,
            name=f"sglang-{sharded.rank}", groups=self.settings.layer_groups,
        )  # fmt: skip
        log.info(
            "kvferry linker active: %s, pools %s of %s pages of %d tokens, rank %d of %d",
            self.settings.mode, ", ".join(linked.pools), "MLA" if linked.mla else "MHA", self.page_size,
            sharded.rank, sharded.world_size,
        )  # fmt: skip

    # --- loads ------------------------------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = _transfer(transfers, KV)
        if kv is None or not kv.keys:
            return []
        trailing = {_name(t): len(t.keys or ()) for t in transfers if _name(t) != KV}
        if not set(trailing) <= set(self.store.pools):
            return []  # a pool not linked: nothing of it restorable
        return self.store.lookup(rid, list(kv.keys), trailing)

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        pages = self._pages(transfers, "load")
        return pages is not None and self.store.queue_load(rid, pages)

    def start_layer_wise_loading(self) -> int:
        return self.store.start_loads()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.store.cancel(rid)

    # --- offloads ---------------------------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        pages = self._pages(transfers, "offload")
        if pages is None:
            return False
        self.store.offload(pages, self._writers() if self._on_device else [])
        return True

    def _writers(self) -> list[int]:
        """The streams whose work so far an offload's copies wait for, as SGLang's `record_offload_ready` has it:
        the current one (it computed which pages go) and the forward's (it may still be writing them). Marked by
        the store with pooled events (SGLang's method makes two torch events per offload)."""
        current = torch._C._cuda_getCurrentRawStream(self._device_index)
        forward = self.forward_stream.cuda_stream if self.forward_stream is not None else current
        return [current] if forward == current else [current, forward]

    def num_completed_offloads(self) -> int:
        return self.store.completed_offloads()

    def pop_completed_offload(self) -> bool:
        return self.store.pop_offload()

    # --- lifecycle --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.store.reset()

    def close(self) -> None:
        self.store.close()

    def _pages(self, transfers: list[PoolTransfer], what: str) -> list[PoolPages] | None:
        """Each transfer's keys and blocks; None (refused, logged) where one is of a pool this linker does not
        move, or is not whole pages (or one state slot a key)."""
        pages = []
        for transfer in transfers:
            name = _name(transfer)
            pool = self.store.pools.get(name)
            if pool is None or not transfer.keys or transfer.device_indices is None:
                log.warning("kvferry: a linker %s of pool %s without keys or slots, or unlinked (refused)", what, name)
                return None
            try:
                blocks = slot_pages(transfer.device_indices, len(transfer.keys), pool.indices_per_block)
            except ValueError as exc:
                log.warning("kvferry: a linker %s of pool %s refused: %s", what, name, exc)
                return None
            pages.append(PoolPages(name, list(transfer.keys), blocks))
        return pages or None


def _name(transfer: PoolTransfer) -> str:
    return str(PoolName(transfer.name).value)


def _transfer(transfers: list[PoolTransfer], name: str) -> PoolTransfer | None:
    return next((transfer for transfer in transfers if _name(transfer) == name), None)


def _shard(names: tuple[str, ...], defaults: tuple[int, ...]) -> tuple[int, ...]:
    """SGLang's parallel ranks and sizes ``names`` (as its HiCache controller reads them), or ``defaults`` where
    SGLang published none (a process that is not one of its workers)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return tuple(int(getattr(get_parallel(), name)) for name in names)
    except (RuntimeError, ValueError, AttributeError):
        return defaults


def _storage_config(server_args: Any, params: Any, mla: bool) -> HiCacheStorageConfig:
    """The storage config SGLang's HiCache controller would give a storage backend on this rank, so that
    `page_key_space` names the same shard for the linker's pages as for the HiCache backend's."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    try:
        dp_attention = is_dp_attention_enabled()
    except (RuntimeError, ValueError, AttributeError):
        dp_attention = False
    tp_names = ("attn_tp_rank", "attn_tp_size") if dp_attention else ("tp_rank", "tp_size")
    tp_rank, tp_size = _shard(tp_names, (0, 1))
    dcp_rank, dcp_size = _shard(("attn_dcp_rank", "attn_dcp_size"), (0, 1)) if mla else (0, 1)
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=params.pp_rank, pp_size=params.pp_size,
        attn_cp_rank=params.attn_cp_rank, attn_cp_size=params.attn_cp_size, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=server_args.model_path,
        dcp_size=dcp_size, dcp_rank=dcp_rank,
    )  # fmt: skip
