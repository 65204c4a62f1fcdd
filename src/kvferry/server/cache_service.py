"""What the server needs of the cache it serves: exactly the members of `kvferry.cache.CacheEngine` that the server's
handlers, transfers and socket loop call, in one place.

`CacheEngine` satisfies it (mypy checks that where ``kvferry server`` builds one: `kvferry.server.app`), and so must
every stand-in a test serves instead: a member added here, or an argument added to one (LOOKUP's ``first_chunk``,
say), is a type error in a stand-in that lacks it, not a failure at run time in whichever test reaches it first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from kvferry.cache import CacheNamespace, Located, LookupResult
from kvferry.cache.event_hooks import EventSource
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.keys import TokenIds
from kvferry.cache.steps import Steps
from kvferry.formats import EngineKVFormat, KVGeometry
from kvferry.tiers import Tier
from kvferry.transfer.block_ids import BlockIds


class WrittenObjects(Protocol):
    """What RESERVE and COMMIT need of the cache (`kvferry.cache.written.WrittenStores`)."""

    def reserve(self, geom: KVGeometry, count: int) -> list[int]: ...

    def give_back(self, offsets: Sequence[int]) -> None: ...

    def adopt(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        geom: KVGeometry,
        first: int,
        offsets: Sequence[int],
        tail: tuple[int, int] | None,
    ) -> int: ...


class CacheTransfers(Protocol):
    """What a STORE and a RETRIEVE need of the cache engine (`kvferry.server.transfers`): its copies as steps, and
    its chunk size (a page's, where a request's chunks are pages)."""

    @property
    def chunk_size(self) -> int: ...

    def store_steps(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        namespace: CacheNamespace | None = None,
        block_size: int | None = None,
        skip_prefix_tokens: int = 0,
        geometry: KVGeometry | None = None,
        valid_until: float | None = None,
        tail: bool = False,
        pages: bool = False,
    ) -> Steps[int]: ...

    def retrieve_steps(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        namespace: CacheNamespace | None = None,
        block_size: int | None = None,
        skip_prefix_tokens: int = 0,
        lock_id: int | None = None,
        geometry: KVGeometry | None = None,
        pages: bool = False,
    ) -> Steps[int]: ...


class CacheService(CacheTransfers, Protocol):
    """The cache engine as the server uses it; each member means what `CacheEngine`'s of the same name does."""

    @property
    def codec(self) -> str:
        """The objects' codec in key spaces that name none."""
        ...

    @property
    def tiers(self) -> Sequence[Tier]: ...

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The cache's metric families, exported by the server's /metrics."""
        ...

    def namespace_for(
        self,
        model: str,
        fmt: EngineKVFormat | int,
        paged: Any,
        *,
        world_size: int = 1,
        rank: int = 0,
        salt: str = "",
        block_size: int | None = None,
        geometry: KVGeometry | None = None,
        codec: str | None = None,
        kv_cache_dtype: str | None = None,
        group: str | None = None,
        split: str | None = None,
    ) -> CacheNamespace: ...

    def lookup_pool(
        self,
        tokens: TokenIds,
        *,
        namespace: CacheNamespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
        first_chunk: int = 0,
        locate: bool = False,
    ) -> tuple[LookupResult, Callable[[], LookupResult] | None]: ...

    def locate(
        self, tokens: TokenIds, *, namespace: CacheNamespace | None = None, block_size: int | None = None
    ) -> Located: ...

    @property
    def shared_pool(self) -> tuple[int, int] | None: ...

    @property
    def not_locatable(self) -> str | None: ...

    @property
    def written(self) -> WrittenObjects:
        """Stores an engine copies into the shared pool itself (RESERVE, COMMIT)."""

    def prefetch(self, tokens: TokenIds, *, namespace: CacheNamespace | None = None) -> Future[int]: ...

    def demote(self, tokens: TokenIds, chunks: range, *, namespace: CacheNamespace | None = None) -> None: ...

    def free_lookup_locks(self, lock_id: int) -> bool: ...

    def free_lookup_locks_many(self, lock_ids: Iterable[int]) -> int: ...

    def publish_events(self, queue: EventQueue) -> EventSource:
        """The cache's KV events into ``queue`` from now on (`kvferry.server.event_stream`)."""
        ...

    def clear(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...
