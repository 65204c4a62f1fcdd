"""kvferry as SGLang's HiCache storage backend (the tier below SGLang's host KV pool), loaded by module path:

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvferry", "module_path": "kvferry.integrations.sglang.hicache_storage",
        "class_name": "KvferryHiCacheStorage", "interface_v1": 1, "mode": "server",
        "server_url": "tcp://127.0.0.1:5555"}'

Besides SGLang's own keys the extra config takes the vLLM connector's (`ConnectorSettings`: ``mode``,
``server_url``, ``config``, ``salt``, ``model_id``, ...: `storage_settings`). SGLang builds the backend as
``cls(storage_config, kwargs)`` and then hands it the host pool (`register_mem_pool_host`); with
``"interface_v1": 1`` its controller moves pages with `batch_set_v1` / `batch_get_v1`, straight between the pool's
pages and the cache in embedded mode. How pages are keyed: `page_store`. This module needs SGLang; the rest of the
package does not.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvferry.connector.engine_kv import UnsupportedKVLayout
from kvferry.integrations.sglang.host_pages import host_pages
from kvferry.integrations.sglang.page_store import PageStore, open_page_store
from kvferry.integrations.sglang.storage_settings import page_key_space, storage_settings


class KvferryHiCacheStorage(HiCacheStorage):
    """SGLang's pages in kvferry's cache, embedded in this process or in a ``kvferry server``. A page that cannot
    be stored or loaded is reported as such (SGLang recomputes it); nothing raises into SGLang after start."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = storage_settings(storage_config.extra_config)
        self.keys = page_key_space(storage_config, self.settings)
        self._store: PageStore | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._store is not None:
            self._store.close()
        name = f"sglang-{self.keys.rank}"
        self._store = open_page_store(self.settings, host_pages(mem_pool_host), self.keys, name=name)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's other pools (Mamba states, sliding-window KV, indexers), moved by SGLang's v2 calls:
        refused when SGLang attaches the storage, rather than failing each call later."""
        raise UnsupportedKVLayout(
            f"kvferry's HiCache storage moves one KV pool per model, not SGLang's {host_pool_name} pool "
            f"({type(host_pool).__name__}): hybrid models' pools are not supported yet"
        )

    @property
    def store(self) -> PageStore:
        if self._store is None:
            raise RuntimeError("kvferry's HiCache storage was given no host pool (register_mem_pool_host)")
        return self._store

    # --- the zero-copy calls (``"interface_v1": 1``) ---------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self.store.store(keys, self._pages(keys, host_indices))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self.store.load(keys, self._pages(keys, host_indices))

    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> torch.Tensor:
        """The host pages of ``host_indices`` (token slots, whole pages in key order): each page's first slot."""
        page_size = self.store.page_size
        if host_indices.numel() != len(keys) * page_size:
            raise ValueError(f"{host_indices.numel()} host slots for {len(keys)} pages of {page_size} tokens")
        first = host_indices.reshape(len(keys), page_size)[:, 0].to("cpu", torch.int64)
        if bool((first % page_size != 0).any()):
            raise ValueError(f"host slots that do not start pages of {page_size} tokens: {first.tolist()}")
        return first // page_size

    # --- the generic calls: pages as flat tensors in the host layout's page order ----------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None or not self.store.load_page(key, target_location):
            return None
        return target_location

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        return [self.get(key, target) for key, target in zip(keys, target_locations or [None] * len(keys), strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return value is not None and self.store.store_page(key, value)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return values is not None and all(self.set(key, value) for key, value in zip(keys, values, strict=True))

    def exists(self, key: str) -> bool:
        return self.store.exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.store.exists(keys)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
