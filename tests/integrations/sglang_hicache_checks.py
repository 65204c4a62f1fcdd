"""kvferry's HiCache storage backend driven by SGLang's own classes: its `StorageBackendFactory` loads it by module
path from a `HiCacheStorageConfig`, over SGLang's MHA and MLA host KV pools on CPU tensors in its layouts.

Run by `test_sglang_release` in a child pytest with a released SGLang's Python first on the path (SGLang's import
takes ~10 s; the stand-in for torchvision is this process's only). Not collected by the suite itself.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations import sglang_standin

sglang_standin.install()

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvferry.connector.engine_kv import UnsupportedKVLayout  # noqa: E402
from kvferry.integrations.sglang import page_store  # noqa: E402
from kvferry.integrations.sglang.hicache_storage import KvferryHiCacheStorage  # noqa: E402
from tests.integrations.sglangkit import DOC, README, documented_launch, page_server, url_of  # noqa: E402

PAGE, LAYERS, TOKENS = 16, 3, 256
SRC, DST = [3, 7, 1, 5, 11], [10, 2, 12, 8, 0]
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_pool(kind: str, layout: str, seed: int, allocator: str = "default") -> Any:
    """SGLang's host pool of a small model (MHA: 2 KV heads of 8; MLA: rows of 24 + 8), random contents, its
    buffer from SGLang's ``allocator`` (``shm``: a memfd mapped shared)."""
    if kind == "mha":
        device = MHATokenToKVPool(
            TOKENS, PAGE, torch.bfloat16, 2, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS
        )
        info = device.get_device_pool_infos()[0].buffer_info
        pool = MHATokenToKVPoolHost(
            info, 2.0, 0, PAGE, layout, pin_memory=False, device_capacity_tokens=device.size,
            start_layer=0, end_layer=LAYERS, write_back_staging=device.hicache_write_back_staging,
            allocator_type=allocator,
        )  # fmt: skip
    else:
        device = MLATokenToKVPool(
            TOKENS, PAGE, torch.bfloat16, 24, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS
        )
        info = device.get_device_pool_infos()[0].buffer_info
        pool = MLATokenToKVPoolHost(
            info, 2.0, 0, PAGE, layout, pin_memory=False, device_capacity_tokens=device.size,
            start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS, allocator_type=allocator,
        )  # fmt: skip
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def storage_config(extra: dict[str, Any], *, mla: bool = False, tp: tuple[int, int] = (0, 1)) -> HiCacheStorageConfig:
    rank, size = tp
    return HiCacheStorageConfig(
        tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="org/tiny-model",
        extra_config={
            "backend_name": "kvferry", "module_path": "kvferry.integrations.sglang.hicache_storage",
            "class_name": "KvferryHiCacheStorage", "interface_v1": 1, **extra,
        },
    )  # fmt: skip


def load_backend(pool: Any, extra: dict[str, Any], **kwargs: Any) -> Any:
    """As SGLang's cache controller attaches a storage backend."""
    config = storage_config(extra, mla=isinstance(pool, MLATokenToKVPoolHost), **kwargs)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, KvferryHiCacheStorage)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def slots(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices of whole pages: token slots, page after page."""
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()


def pages_of(pool: Any, pages: list[int]) -> torch.Tensor:
    """The reference: SGLang's own reading of each page (its flat data page), stacked."""
    return torch.stack([pool.get_data_page(page * PAGE).clone() for page in pages])


def random_keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


EMBEDDED = {"mode": "embedded", "config": {"cache": {"l1_size_gb": 0.01}}}


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with page_server(PAGE) as server:
        yield url_of(server)


def store_then_load(pool: Any, writer: Any, reader: Any, seed: int) -> None:
    """``writer`` stores pages SRC; ``reader`` loads them into pages DST of its pool (poisoned first)."""
    keys = random_keys(len(SRC), seed)
    expected = pages_of(pool, SRC)
    assert writer.batch_set_v1(keys, slots(SRC), None) == [True] * len(SRC)
    pool.kv_buffer[...] = 7.0  # poisoned: every page must be written by the load
    kept = [page for page in range(pool.size // PAGE) if page not in DST]
    before = pages_of(pool, kept)
    assert reader.batch_get_v1(keys, slots(DST), None) == [True] * len(DST)
    assert torch.equal(pages_of(pool, DST), expected)
    assert torch.equal(pages_of(pool, kept), before)  # no other page written
    unknown = random_keys(1, seed + 1000)
    assert reader.batch_exists(keys) == len(keys)
    assert reader.batch_exists(keys[:2] + unknown + keys[2:]) == 2
    assert reader.batch_exists(unknown + keys) == 0
    assert reader.exists(keys[0]) and not reader.exists(unknown[0])
    # a miss loads nothing from there on: SGLang uses the leading pages loaded only
    got = reader.batch_get_v1(keys[:2] + unknown + keys[3:], slots(DST), None)
    assert got[:3] == [True, True, False]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_stored_then_loaded_into_other_pages_embedded(kind: str, layout: str) -> None:
    pool = host_pool(kind, layout, seed=LAYOUTS.index(layout))
    backend = load_backend(pool, EMBEDDED)
    try:
        store_then_load(pool, backend, backend, seed=1)
    finally:
        backend.close()


@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mla", "layer_first")])
def test_a_second_backend_on_the_server_loads_what_the_first_stored(
    kind: str, layout: str, server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(page_store, "STAGING_PAGES", 2)  # a call's 5 pages staged in 3 rounds
    pool = host_pool(kind, layout, seed=5)
    settings = {"mode": "server", "server_url": server_url}
    writer, reader = load_backend(pool, settings), load_backend(pool, settings)
    try:
        store_then_load(pool, writer, reader, seed=2 + LAYOUTS.index(layout))
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_host_pool_in_shared_memory_is_mapped_by_the_server_as_it_is(kind: str, server_url: str) -> None:
    """SGLang's ``"allocator": "shm"`` host pool (a memfd mapped shared): the server maps the pool itself and
    copies pages straight in and out of it; no page goes through the staging buffer, which holds one page only
    (the generic calls'), and the pool stays where SGLang put it."""
    pool = host_pool(kind, "page_first", seed=40, allocator="shm")
    address = pool.kv_buffer.data_ptr()
    settings = {"mode": "server", "server_url": server_url, "allocator": "shm"}
    writer, reader = load_backend(pool, settings), load_backend(pool, settings)
    try:
        for backend in (writer, reader):
            assert backend.store.direct is not None and backend.store.stage.num_pages == 1
            backend.store.stage.pages.fill_(3.0)
        store_then_load(pool, writer, reader, seed=41 + (kind == "mla"))
        assert pool.kv_buffer.data_ptr() == address
        assert all(bool((b.store.stage.pages == 3.0).all()) for b in (writer, reader))  # nothing staged
    finally:
        writer.close()
        reader.close()


def test_tensor_parallel_ranks_keep_their_own_pages(server_url: str) -> None:
    settings = {"mode": "server", "server_url": server_url}
    pools = [host_pool("mha", "page_first_direct", seed=10 + rank) for rank in range(2)]
    ranks = [load_backend(pools[rank], settings, tp=(rank, 2)) for rank in range(2)]
    try:
        keys = random_keys(len(SRC), 20)
        expected = [pages_of(pool, SRC) for pool in pools]
        assert ranks[0].batch_set_v1(keys, slots(SRC), None) == [True] * len(SRC)
        assert ranks[1].batch_exists(keys) == 0  # rank 1 holds other heads: rank 0's pages are not its
        assert ranks[1].batch_set_v1(keys, slots(SRC), None) == [True] * len(SRC)
        for rank, pool in enumerate(pools):
            pool.kv_buffer[...] = 7.0
            assert ranks[rank].batch_get_v1(keys, slots(DST), None) == [True] * len(DST)
            assert torch.equal(pages_of(pool, DST), expected[rank])
    finally:
        for backend in ranks:
            backend.close()


@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_the_generic_calls_move_sglangs_flat_pages(mode: str, server_url: str) -> None:
    """`batch_set` / `batch_get` as SGLang's controller calls them without ``interface_v1``: pages read with
    `get_data_page`, loaded into `get_dummy_flat_data_page` buffers and written back with `set_from_flat_data_page`."""
    pool = host_pool("mha", "layer_first", seed=30)
    backend = load_backend(pool, EMBEDDED if mode == "embedded" else {"mode": "server", "server_url": server_url})
    try:
        keys = random_keys(len(SRC), 31)
        expected = pages_of(pool, SRC)
        assert backend.batch_set(keys, [pool.get_data_page(page * PAGE) for page in SRC])
        pool.kv_buffer[...] = 7.0
        loaded = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for page, data in zip(DST, loaded, strict=True):
            pool.set_from_flat_data_page(page * PAGE, data)
        assert torch.equal(pages_of(pool, DST), expected)
        assert backend.get(random_keys(1, 32)[0], pool.get_dummy_flat_data_page()) is None
    finally:
        backend.close()


def test_bad_settings_pools_and_chunk_sizes_refuse_to_start() -> None:
    pool = host_pool("mha", "page_first", seed=0)
    with pytest.raises(ValueError, match=r"hicache-storage-backend-extra-config for kvferry: .*mdoe"):
        load_backend(pool, {"mdoe": "server"})
    with pytest.raises(UnsupportedKVLayout, match="'page_head'"):
        load_backend(host_pool("mha", "page_head", seed=0), EMBEDDED)
    backend = load_backend(pool, EMBEDDED)
    try:
        with pytest.raises(ValueError, match="do not start pages"):
            backend.batch_get_v1(random_keys(1, 50), slots([1]) + 3, None)
        with pytest.raises(UnsupportedKVLayout, match="not SGLang's mamba pool"):
            backend.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    finally:
        backend.close()
    with page_server(2 * PAGE) as server, pytest.raises(ValueError, match=f"--chunk-size {PAGE}"):
        load_backend(pool, {"mode": "server", "server_url": url_of(server)})


@pytest.mark.parametrize("page", [DOC, README], ids=["docs/sglang.md", "README.md"])
def test_the_documented_launch_goes_through_sglangs_parser_and_factory(page: Path) -> None:
    """docs/sglang.md's SGLang command as SGLang's own argument parser reads it: its extra config loads kvferry
    through the factory, and its page size is the documented server's chunk size."""
    import argparse
    import json
    import shlex

    from sglang.srt.server_args import ServerArgs

    commands = documented_launch("--enable-hierarchical-cache", page)
    (launch,) = [shlex.split(c)[3:] for c in commands if c.startswith("python -m sglang.launch_server")]
    (server,) = [shlex.split(c) for c in commands if c.startswith("kvferry server")]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(launch)
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert server[server.index("--chunk-size") + 1] == str(args.page_size)
    assert args.hicache_mem_layout in LAYOUTS
    config = storage_config({})
    config.extra_config = json.loads(args.hicache_storage_backend_extra_config)
    backend = StorageBackendFactory.create_backend("dynamic", config, None)  # the host pool comes later
    assert isinstance(backend, KvferryHiCacheStorage)
    assert backend.settings.mode == "server" and backend.keys.model == "org/tiny-model"
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type
    from sglang.srt.runtime_context import get_context

    published = get_context().override_server_args(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=args.hicache_storage_backend_extra_config,
    )
    published.install()
    try:
        assert get_allocator_type() == "shm"  # SGLang puts the host pool where the server can map it
    finally:
        published.restore()
