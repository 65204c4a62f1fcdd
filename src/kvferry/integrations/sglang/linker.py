"""kvferry as SGLang's unified-cache linker: pages move straight between SGLang's device KV pool and kvferry's
cache (in this process, or in a ``kvferry server``), with no host tier between. SGLang loads it by module path:

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "KvferryLinker",
      "linker_module_path": "kvferry.integrations.sglang.linker",
      "linker_extra_config": {"mode": "server", "server_url": "tcp://127.0.0.1:5555"}}'

``linker_extra_config`` takes the HiCache backend's kvferry keys (`ConnectorSettings`: ``mode``, ``server_url``,
``config``, ``salt``, ``model_id``, ...). SGLang hands a linker no token ids, only each page's chained hash (64 hex
digits, covering every page before it), so pages are keyed as the HiCache backend keys them (`page_store`: each
page a one-chunk prefix whose tokens spell its hash, the chunk size SGLang's page size), in the same key space
(model, this rank's shard, dtype, object shape, salt): a page one of them stored is a hit for the other. These
objects are not shared with vLLM engines: vLLM's keys hash the token ids of the whole prefix, which SGLang does not
give, so the same prefix has different keys there even where the model and the object shape match.

Only a model whose tree has the full-attention KV pool alone is linked (SGLang's MHA and MLA device pools, token
major): a model with Mamba, sliding-window or other pools is refused at start, naming them. The device pool's
layout: `device_pages`; the lookups, loads, offloads and their threads: `linker_store`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker
from sglang.srt.utils import get_device_module

from kvferry.connector.engine_kv import UnsupportedKVLayout
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.device_pages import device_kv, slot_pages
from kvferry.integrations.sglang.linker_store import LinkerStore, ReadyEvent, open_linker_store
from kvferry.integrations.sglang.storage_settings import page_key_space

log = logging.getLogger(__name__)


class KvferryLinker(UnifiedCacheLinker):
    """SGLang's device KV pool linked to kvferry's cache; built by SGLang's linker factory once per worker.

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
        unsupported = set(components) - {ComponentType.FULL}
        if unsupported:
            names = ", ".join(str(c) for c in sorted(unsupported, key=int))
            raise UnsupportedKVLayout(
                f"kvferry's SGLang linker moves the full-attention KV pool only; this model's cache also has {names} "
                "components (hybrid models' pools are not supported yet)"
            )
        try:
            self.settings = ConnectorSettings.from_extra_config(dict(extra_config or {}))
        except ValueError as exc:
            raise ValueError(f"--unified-cache-external-linker-config's linker_extra_config: {exc}") from None
        self.forward_stream = forward_stream
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        kv = device_kv(kvcache)
        if kv.block_size != params.page_size:
            raise UnsupportedKVLayout(f"device pages of {kv.block_size} tokens, not --page-size {params.page_size}")
        self.page_size = kv.block_size
        self.pools = {PoolName.KV: kvcache}
        self.layer_done_counter = LayerWiseLoadCounter(len(kv.layers))
        mla = kv.fmt.name == "NL_X_NBBS_ONE_HS"
        storage_config = _storage_config(server_args, params, mla)
        self.keys = page_key_space(storage_config, self.settings)
        self._on_device = kv.layers[0].device.type != "cpu"
        # An MLA model's TP ranks hold the same pages in one key space: through a server, one of them stores.
        owner = not mla or self.settings.mode != "server" or storage_config.tp_rank == 0
        self.store: LinkerStore = open_linker_store(
            self.settings, kv, self.keys, self.layer_done_counter, offload_owner=owner, name=f"sglang-{self.keys.rank}"
        )
        log.info(
            "kvferry linker active: %s, %s pages of %d tokens as %s, rank %d of %d",
            self.settings.mode, "MLA" if mla else "MHA", self.page_size, kv.fmt.name, self.keys.rank,
            self.keys.world_size,
        )  # fmt: skip

    # --- loads ------------------------------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = _kv_transfer(transfers)
        if kv is None or not kv.keys:
            return []
        return self.store.lookup(rid, list(kv.keys))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        pages = self._pages(_kv_transfer(transfers), "load")
        return pages is not None and self.store.queue_load(rid, pages[0], pages[1])

    def start_layer_wise_loading(self) -> int:
        return self.store.start_loads(self._ready([]))

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.store.cancel(rid)

    # --- offloads ---------------------------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        pages = self._pages(_kv_transfer(transfers), "offload")
        if pages is None:
            return False
        self.store.offload(pages[0], pages[1], self.record_offload_ready() if self._on_device else [])
        return True

    def num_completed_offloads(self) -> int:
        return self.store.completed_offloads()

    def pop_completed_offload(self) -> bool:
        return self.store.pop_offload()

    # --- lifecycle --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.store.reset()

    def close(self) -> None:
        self.store.close()

    def _ready(self, events: list[ReadyEvent]) -> list[ReadyEvent]:
        """An event at the end of the current stream's work (on the device only): the slots' last readers."""
        if self._on_device:
            event = get_device_module().Event()
            event.record()
            events.append(event)
        return events

    def _pages(self, kv: PoolTransfer | None, what: str) -> tuple[list[str], list[int]] | None:
        """A KV transfer's keys and device pages; None (refused, logged) for one kvferry cannot take."""
        if kv is None or not kv.keys or kv.device_indices is None:
            log.warning("kvferry: a linker %s without KV pages (refused)", what)
            return None
        try:
            return list(kv.keys), slot_pages(kv.device_indices, len(kv.keys), self.page_size)
        except ValueError as exc:
            log.warning("kvferry: a linker %s refused: %s", what, exc)
            return None


def _kv_transfer(transfers: list[PoolTransfer]) -> PoolTransfer | None:
    return next((transfer for transfer in transfers if transfer.name == PoolName.KV), None)


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
