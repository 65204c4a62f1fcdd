"""A worker's backend for the KV it registered: a cache engine in this process (embedded mode), or a session with a
``kvferry server`` that registers the KV there (server mode). What the connector makes in ``register_kv_caches``.

A Mamba group's states (`state_groups`) are cut into token rows by the chunk size, which a server tells only once
connected: in server mode its link registers the states' KV on connecting, cut by the server's chunk size
(`make_state_backend`), and its key space names the state's bytes rather than the rows' width (`KeySpace`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient
from kvferry.client.pool_map import MappedPool
from kvferry.config import TransferConfig
from kvferry.connector.backends import EmbeddedBackend, KeySpace
from kvferry.connector.direct_loads import DirectLoads
from kvferry.connector.direct_stores import DirectStores
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.server_backend import ServerBackend, is_refusal
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.state_groups import state_kv
from kvferry.formats import EngineKVFormat, describe, with_codec
from kvferry.transfer import configure_gpu

log = logging.getLogger(__name__)


def make_worker_backend(
    settings: ConnectorSettings,
    kv: EngineKV,
    *,
    model: str,
    block_size: int,
    name: str,
    on_chunk_size: Callable[[int], None] | None = None,
    group_tag: str = "",
    engine: CacheEngine | None = None,
    codec: str | None = None,
    split_tag: str = "",
) -> EmbeddedBackend | ServerBackend:
    """The backend of a worker that registered ``kv``: a cache engine in this process (embedded mode), or a session
    with the server that registers ``kv`` there (server mode; a chunk size that is not whole ``block_size``-token
    blocks of the scheduler refuses to start). What the connector makes in ``register_kv_caches``, without vLLM.

    A hybrid model's KV cache groups each make one, ``group_tag`` (`KVGroup.tag`) in their key space; in embedded
    mode they share one cache ``engine`` (the first group's backend's). ``codec``: the objects' (None: embedded
    mode's config, server mode the server's); one the KV cannot take refuses to start, saying why. A part of a
    layer split (`layer_parts`) gives its codec and the split's tag."""
    if codec is not None:  # refused here, before any server is asked, with the reason
        with_codec(describe(kv.fmt, kv.paged, kv.block_size, heads=kv.heads), codec)
    key_space = KeySpace.of(
        kv, model=model, salt=settings.salt, codec=codec, group=group_tag or None, split=split_tag or None
    )

    def check_chunk_size(chunk_size: int) -> None:
        settings.check_chunk_size(chunk_size, block_size)
        if on_chunk_size is not None:
            on_chunk_size(chunk_size)

    if settings.mode == "server":
        deployment = key_space.deployment()
        link = ServerLink(
            settings.server_url,
            timeout_s=settings.timeout_s,
            curve=settings.client_curve(),
            register=lambda client: client.register_kv_cache(
                kv.paged, kv.fmt, block_size=kv.block_size, namespace=deployment, heads=kv.heads
            ),
        )
        try:
            link.connect(check_chunk_size=check_chunk_size)  # a bad chunk size refuses to start
        except BaseException:
            link.close()
            raise
        pool = MappedPool(pin=kv.layers[0].is_cuda) if settings.direct_loads or settings.direct_stores else None
        direct = _direct_loads(settings, kv, pool)
        stores = _direct_stores(settings, kv, pool, link)
        # Its lookups locate their hits where the scheduler looks up through it (one process) and its loads copy
        # them (a hybrid group's or a layer split part's lookups are joined with the others': they only lock)
        locate_hits = direct is not None and not group_tag and not split_tag
        backend = ServerBackend(link, key_space, kv, direct=direct, direct_stores=stores, locate_hits=locate_hits)
        if direct is not None:
            direct.map_ahead(
                lambda: link.wait(lambda client, reg: client.locate_async([], registration=reg), link.timeout_s)
            )
        return backend
    if engine is None:
        config = settings.kvferry_config()
        check_chunk_size(config.cache.chunk_size)
        if config.transfer != TransferConfig():  # the GPU data path is process-wide: changed only when asked to
            configure_gpu(**config.transfer.engine_settings())
        engine = CacheEngine(config, name=name)
    else:
        check_chunk_size(engine.chunk_size)
    namespace = engine.namespace_for(
        key_space.model,
        kv.fmt,
        kv.paged,
        world_size=1,
        rank=0,
        salt=key_space.salt,
        block_size=kv.block_size,
        codec=codec,
        kv_cache_dtype=key_space.kv_cache_dtype,
        group=key_space.group,
        split=key_space.split,
    )
    return EmbeddedBackend(engine, kv, namespace, key_space)


@dataclass(frozen=True)
class StateViews:
    """A Mamba group's state views as vLLM hands them over (``[blocks, 1, 1, state bytes]`` per layer, in layer
    order), before a chunk size cuts them into token rows (`state_kv`)."""

    layers: Sequence[torch.Tensor]
    names: Sequence[str]
    page_bytes: int

    @property
    def state_bytes(self) -> int:
        return int(self.layers[0].shape[3])

    def kv(self, chunk_size: int) -> EngineKV:
        return state_kv(self.layers, self.names, self.page_bytes, chunk_size)


def make_state_backend(
    settings: ConnectorSettings,
    views: StateViews,
    *,
    model: str,
    block_size: int,
    name: str,
    group_tag: str,
    engine: CacheEngine | None = None,
    tp: tuple[int, int] = (0, 1),
) -> EmbeddedBackend | ServerBackend:
    """A Mamba group's backend (wrapped by `state_groups.StateBackend`); its objects are exact whatever the codec
    (a state is opaque bytes, not KV per token). Embedded mode cuts the rows by ``engine``'s chunk size (or the
    settings' cache's), server mode by the server's, registering the states on every (re)connection. ``tp``: this
    worker's (rank, size) in its tensor-parallel group: each rank holds a shard of every state, an object of its
    own in a key space that names the rank."""
    if settings.mode != "server":
        chunk = engine.chunk_size if engine is not None else settings.kvferry_config().cache.chunk_size
        kv = views.kv(chunk)
        return make_worker_backend(
            settings, kv, model=model, block_size=block_size, name=name, group_tag=group_tag, engine=engine,
            codec="none",
        )  # fmt: skip
    rank, world_size = tp
    fmt = EngineKVFormat.NL_X_NB_NH_BS_CS  # `state_kv`'s: one [blocks, 1, chunk, row bytes] uint8 tensor a layer
    key_space = KeySpace(
        model=model,
        salt=settings.salt,
        fmt=fmt.name,
        kv_dtype="uint8",
        kv_size=1,
        num_layers=len(views.layers),
        width=0,  # the rows' width follows the chunk size: from the state's bytes and page
        codec="none",
        state_bytes=views.state_bytes,
        page_bytes=views.page_bytes,
        world_size=world_size,
        rank=rank,
        group=group_tag,
    )
    deployment: dict[str, str | int] = {"model": model, "salt": settings.salt, "codec": "none", "group": group_tag}
    deployment.update(world_size=world_size, rank=rank)

    def register(client: KvferryClient) -> int:
        chunk = link.chunk_size
        assert chunk is not None  # the link asks the server's chunk size before it registers
        kv = views.kv(chunk)  # views of vLLM's tensors, made again on each (re)connection
        return client.register_kv_cache(kv.paged, kv.fmt, block_size=kv.block_size, namespace=deployment)

    def check_chunk_size(chunk_size: int) -> None:
        settings.check_chunk_size(chunk_size, block_size)
        views.kv(chunk_size)  # rows that do not fit the state's page: a setting to fix (UnsupportedKVLayout)

    link = ServerLink(
        settings.server_url, timeout_s=settings.timeout_s, register=register, curve=settings.client_curve()
    )
    try:
        link.connect(check_chunk_size=check_chunk_size)  # a bad chunk size refuses to start
    except BaseException:
        link.close()
        raise
    return ServerBackend(link, key_space)


def _direct_loads(settings: ConnectorSettings, kv: EngineKV, pool: MappedPool | None) -> DirectLoads | None:
    if not settings.direct_loads or pool is None:
        return None
    why = not_direct(kv)
    if why is not None:
        log.warning("kvferry: direct_loads is on, but loads go through RETRIEVE: %s", why)
        return None
    return DirectLoads(kv, pool)


def _direct_stores(
    settings: ConnectorSettings, kv: EngineKV, pool: MappedPool | None, link: ServerLink
) -> DirectStores | None:
    if not settings.direct_stores or pool is None:
        return None
    why = not_direct(kv)
    if why is not None:
        log.warning("kvferry: direct_stores is on, but stores go through STORE: %s", why)
        return None
    return DirectStores(kv, pool, link.timeout_s, is_refusal)


def not_direct(kv: EngineKV) -> str | None:
    """Why ``kv``'s transfers cannot be copied by the engine (they then go through STORE and RETRIEVE), or None."""
    if kv.heads is not None:
        return "a tensor-parallel rank's heads are a slice of each object"
    return None
