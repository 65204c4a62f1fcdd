"""SGLang's HiCache pages in kvferry's cache: each page one chunk object, keyed by SGLang's page hash.

SGLang hands its storage backend no token ids, only a key per page: a hash of the page's tokens chained with every
page before it (64 hex digits). kvferry's keys are a hash of a token prefix (`kvferry.cache.keys`), so each page is
stored as a one-chunk prefix of its own whose tokens spell the page's key (`page_tokens`); its key space
(`CacheNamespace`) names the model, the rank's shard (`PageKeySpace`), the dtype and the object shape. The chunk
size is therefore SGLang's page size, and a page is found again only by the same page hash: SGLang's objects are
not shared with a vLLM engine's, whose keys hash the tokens themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from kvferry.cache import CacheEngine, CacheNamespace
from kvferry.cache.keys import TokenIds
from kvferry.cache.page_keys import KEY_BYTES, KEY_TOKENS, KeyedPages, key_rows
from kvferry.client.shared_files import shared_file
from kvferry.config import TransferConfig
from kvferry.connector.backends import Backend, EmbeddedBackend, Hit, KeySpace
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.host_pages import HostPages
from kvferry.transfer import configure_gpu

log = logging.getLogger(__name__)

_HEX_DIGITS = 2 * KEY_BYTES  # SGLang's page hash: a sha256 in hex
STAGING_PAGES = 32  # pages of server mode's staging buffer: a call's pages go through it in rounds


def page_keys(keys: Sequence[str]) -> bytes:
    """The 32 bytes of each of ``keys``, back to back: its own digits where it is a page hash as SGLang writes them
    (64 hex digits), else a sha256 of it. A prefix of pages is one C-level decode of its keys (a sha256 per key cost
    a 64-page load ~75-180 us on the H100 host)."""
    raw = b""
    if set(map(len, keys)) == {_HEX_DIGITS}:
        with contextlib.suppress(ValueError):
            raw = bytes.fromhex("".join(keys))
    if len(raw) != KEY_BYTES * len(keys):  # not all page hashes (or one with a space, which fromhex skips)
        raw = b"".join(map(_key_bytes, keys))
    return raw


def page_tokens(keys: Sequence[str], page_size: int) -> np.ndarray:
    """The token ids each page of ``keys`` is stored under, a row a page (`kvferry.cache.page_keys.key_rows` of
    `page_keys`). Little-endian uint32, the bytes the cache hashes as they are (a row, or the rows flattened)."""
    return key_rows(page_keys(keys), page_size)


class PageTokens(KeyedPages):
    """`page_tokens` of ``keys``, flattened, made when first read. A store needs only their count before its copy
    is enqueued and reads them for its keys after: converting 64 keys first was 0.1 ms of a 64-page offload's path
    to its first DMA on the H100 host. Through a server only the keys go (`page_keys`), made when sent."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[str], page_size: int) -> None:
        super().__init__(None, len(keys), page_size)
        self._keys = keys

    def raw_keys(self) -> bytes:
        if self._raw is None:
            self._raw = page_keys(self._keys)
        return self._raw

    def rows(self) -> np.ndarray:
        return page_tokens(self._keys, self.page_size)


def _key_bytes(key: str) -> bytes:
    """One key's 32 bytes, as `page_keys` makes them."""
    if len(key) == _HEX_DIGITS:
        with contextlib.suppress(ValueError):
            digits = bytes.fromhex(key)
            if len(digits) == KEY_BYTES:
                return digits
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class PageKeySpace:
    """Whose pages: the model, and this rank's shard among ``world_size`` (every TP rank holds its heads of a page;
    an MLA model's ranks hold the same page, of each decode-context-parallel shard; pipeline stages their layers,
    attention context-parallel ranks their slice)."""

    model: str
    world_size: int
    rank: int


class PageBackend(Backend, Protocol):
    """A backend the page stores use: an in-process cache's or a server's, which both look pages up together."""

    def lookup_each(self, prompts: Sequence[TokenIds]) -> list[Hit | None]: ...

    def free_locks(self, locks: Sequence[Any]) -> None: ...

    def retrieve_pages_async(self, tokens: TokenIds, block_ids: list[int]) -> Future[int]: ...

    def store_pages_async(self, tokens: TokenIds, block_ids: list[int]) -> Future[int]: ...


def leading_pages(backend: PageBackend, keys: Sequence[str], page_size: int) -> tuple[int, list[Any]]:
    """How many leading ``keys`` the cache holds whole, looked up together, and their locks (those of the pages
    found after the first miss are freed: SGLang uses a leading run)."""
    hits = backend.lookup_each(list(page_tokens(keys, page_size)))
    found = next((i for i, hit in enumerate(hits) if hit is None or hit.tokens < page_size), len(hits))
    backend.free_locks([hit.lock for hit in hits[found:] if hit is not None and hit.lock is not None])
    return found, [hit.lock for hit in hits[:found] if hit is not None and hit.lock is not None]


class PageStore:
    """Pages of SGLang's host pool moved to and from kvferry's cache.

    ``direct``: a backend over the host pool itself (embedded mode: the zero-copy calls copy between the pool's
    pages and the cache); ``staged``: a backend over ``stage``, a buffer of kvferry's in the pool's layout, through
    which server mode (the server maps only memory kvferry shares with it) and the generic get / set go."""

    def __init__(
        self,
        host: HostPages,
        stage: HostPages,
        staged: PageBackend,
        direct: PageBackend | None,
        closing: Callable[[], None],
    ) -> None:
        self.host, self.stage, self.staged, self.direct = host, stage, staged, direct
        self._closing = closing
        self._stage_lock = threading.Lock()  # SGLang's prefetch and backup threads call concurrently

    @property
    def page_size(self) -> int:
        return self.host.page_size

    def exists(self, keys: list[str]) -> int:
        """How many leading ``keys`` the cache holds (a failed lookup is a miss)."""
        found, locks = leading_pages(self.staged, keys, self.page_size)
        self.staged.free_locks(locks)
        return found

    def store(self, keys: list[str], pages: torch.Tensor) -> list[bool]:
        """Host pages ``pages`` stored under ``keys``; per key whether it is (already) in the cache."""
        if self.direct is not None:
            return [self._store_run(self.direct, keys, [int(page) for page in pages])] * len(keys)
        done: list[bool] = []
        for start in range(0, len(keys), self.stage.num_pages):
            batch = pages[start : start + self.stage.num_pages]
            with self._stage_lock:
                self.host.copy_pages(batch, self.stage)
                stored = self._store_run(self.staged, keys[start : start + len(batch)], list(range(len(batch))))
            done += [stored] * len(batch)
        return done

    def load(self, keys: list[str], pages: torch.Tensor) -> list[bool]:
        """Host pages ``pages`` loaded from ``keys``; per key whether it was. SGLang uses the leading pages loaded
        only: a load stops at the first miss (the pages after it are left as they were), one copy for all."""
        if self.direct is not None:
            whole = self._load_run(self.direct, keys, [int(page) for page in pages])
            return [True] * whole + [False] * (len(keys) - whole)
        done = 0
        for start in range(0, len(keys), self.stage.num_pages):
            batch = pages[start : start + self.stage.num_pages]
            with self._stage_lock:
                whole = self._load_run(self.staged, keys[start : start + len(batch)], list(range(len(batch))))
                self.host.fill_pages(batch[:whole], self.stage)
            done += whole
            if whole < len(batch):
                break
        return [True] * done + [False] * (len(keys) - done)

    def store_page(self, key: str, page: torch.Tensor) -> bool:
        """One page given in SGLang's flat data page order (`HostPages.page`)."""
        with self._stage_lock:
            self.stage.page(0).copy_(page.view(self.stage.page(0).shape))
            return self._store_run(self.staged, [key], [0])

    def load_page(self, key: str, page: torch.Tensor) -> bool:
        with self._stage_lock:
            if not self._load_run(self.staged, [key], [0]):
                return False
            page.view(self.stage.page(0).shape).copy_(self.stage.page(0))
            return True

    def _store_run(self, backend: PageBackend, keys: list[str], pages: list[int]) -> bool:
        """Backend pages ``pages`` stored under ``keys`` in one copy (each is then in the cache, or already was);
        False where the store failed."""
        tokens = page_tokens(keys, self.page_size).reshape(-1)
        try:
            backend.store_pages_async(tokens, pages).result()
            return True
        except Exception as exc:
            log.warning("kvferry: storing HiCache pages failed: %s: %s", type(exc).__name__, exc)
            return False

    def _load_run(self, backend: PageBackend, keys: list[str], pages: list[int]) -> int:
        """How many leading ``keys`` landed in backend pages ``pages``, in one copy (a failed load is a miss:
        SGLang stops its prefetch there)."""
        tokens = page_tokens(keys, self.page_size).reshape(-1)
        try:
            return backend.retrieve_pages_async(tokens, pages).result() // self.page_size
        except Exception as exc:
            log.warning("kvferry: loading HiCache pages failed (a miss): %s: %s", type(exc).__name__, exc)
            return 0

    def close(self) -> None:
        self._closing()


def open_page_store(settings: ConnectorSettings, host: HostPages, keys: PageKeySpace, *, name: str) -> PageStore:
    """The page store of ``host`` in ``settings``' mode: a cache engine in this process whose chunk size is the page
    size, or the server at ``settings.server_url``, whose ``--chunk-size`` must be the page size. A server maps a
    host pool in shared memory (SGLang's ``"allocator": "shm"``) as it is and moves its pages directly; another
    pool's pages go through a staging buffer the server maps, in rounds."""
    user = "kvferry's HiCache storage"
    check_page_size(host.page_size, user)
    server = settings.mode == "server"
    direct_to_server = server and _in_shared_memory(host.pages)
    # The generic calls' single pages are staged in every mode; server mode's other pages too, unless direct.
    stage = host.staging(min(STAGING_PAGES, host.num_pages) if server and not direct_to_server else 1)
    stage_kv = stage.engine_kv()
    key_space = pages_key_space(stage_kv, keys, settings)
    if server:
        links: list[ServerLink] = []

        def close_links() -> None:
            for link in links:
                link.close()

        try:
            links.append(pages_server_link(settings, stage_kv, keys, key_space, user))
            staged: PageBackend = ServerBackend(links[0], key_space, stage_kv)
            direct: PageBackend | None = None
            if direct_to_server:
                host_kv = host.engine_kv()
                links.append(pages_server_link(settings, host_kv, keys, key_space, user))
                direct = ServerBackend(links[1], key_space, host_kv)
        except BaseException:
            close_links()
            raise
        log.info("kvferry: SGLang's host pool %s", "mapped by the server" if direct else "staged for the server")
        return PageStore(host, stage, staged, direct, close_links)
    engine = pages_engine(settings, host.page_size, name)
    try:
        staged_here, direct_here = (
            EmbeddedBackend(engine, kv, pages_namespace(engine, kv, key_space), key_space)
            for kv in (stage_kv, host.engine_kv())
        )
    except BaseException:
        engine.close()
        raise
    return PageStore(host, stage, staged_here, direct_here, engine.close)


def _in_shared_memory(buffer: torch.Tensor) -> bool:
    """Whether ``buffer``'s memory is shared through a file already (`kvferry.client.shared_files`)."""
    storage = buffer.untyped_storage()
    return storage.nbytes() > 0 and shared_file(storage.data_ptr(), storage.nbytes()) is not None


# What SGLang's two ways in (this page store, and the linker's: `linker_store`) set up alike: pages of SGLang's
# page size as one-chunk prefixes (`page_tokens`), in the key space of the model and this rank's shard.


def check_page_size(page_size: int, user: str) -> None:
    if page_size < KEY_TOKENS:
        raise ValueError(
            f"{user} needs SGLang's --page-size >= {KEY_TOKENS} (a page's key is stored as {KEY_TOKENS} token ids); "
            f"got {page_size}"
        )


def pages_key_space(
    kv: EngineKV,
    keys: PageKeySpace,
    settings: ConnectorSettings,
    group: str | None = None,
    *,
    state: bool = False,
    split: str | None = None,
) -> KeySpace:
    """The key space of pages of ``kv`` (``kv.block_size``: SGLang's page size) for this rank's shard; ``group``
    names a pool's objects apart from the KV pool's (`device_pools`), ``split`` a group of layers loaded apart
    (`linker_pools`); a ``state``'s bytes are kept exact."""
    codec = "none" if state else settings.codec
    key_space = KeySpace.of(kv, model=keys.model, salt=settings.salt, codec=codec, group=group, split=split)
    return replace(key_space, world_size=keys.world_size, rank=keys.rank)


def pages_server_link(
    settings: ConnectorSettings, kv: EngineKV, keys: PageKeySpace, key_space: KeySpace, user: str
) -> ServerLink:
    """A link to ``settings``' server, connected, with ``kv`` registered in ``key_space``; the server's chunk size
    must be the page size."""
    page_size = kv.block_size
    deployment: dict[str, str | int] = {**key_space.deployment(), "world_size": keys.world_size, "rank": keys.rank}
    link = ServerLink(
        settings.server_url,
        timeout_s=settings.timeout_s,
        curve=settings.client_curve(),
        register=lambda client: client.register_kv_cache(kv.paged, kv.fmt, block_size=page_size, namespace=deployment),
    )
    try:
        link.connect(check_chunk_size=lambda chunk: _check_chunk_size(chunk, page_size, user))
    except BaseException:
        link.close()
        raise
    return link


def pages_engine(settings: ConnectorSettings, page_size: int, name: str) -> CacheEngine:
    """A cache engine in this process for ``settings``, its chunk size the page size."""
    config = settings.kvferry_config()
    config = config.model_copy(update={"cache": config.cache.model_copy(update={"chunk_size": page_size})})
    if config.transfer != TransferConfig():  # the GPU data path is process-wide: changed only when asked to
        configure_gpu(**config.transfer.engine_settings())
    return CacheEngine(config, name=name)


def pages_namespace(engine: CacheEngine, kv: EngineKV, key_space: KeySpace) -> CacheNamespace:
    """``key_space`` (`pages_key_space` of ``kv``) in ``engine``."""
    return engine.namespace_for(
        key_space.model, kv.fmt, kv.paged, world_size=key_space.world_size, rank=key_space.rank,
        salt=key_space.salt, block_size=kv.block_size, codec=key_space.codec, group=key_space.group,
        split=key_space.split,
    )  # fmt: skip


def _check_chunk_size(chunk_size: int, page_size: int, user: str) -> None:
    if chunk_size != page_size:
        raise ValueError(
            f"{user} stores one SGLang page per chunk: the server's chunk size ({chunk_size}) must be SGLang's "
            f"--page-size ({page_size}); start the server with --chunk-size {page_size}"
        )
