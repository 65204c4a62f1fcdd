"""kvferry's unified-cache linker driven by SGLang's own classes: its linker factory builds `KvferryLinker` by
module path (``backend="dynamic"``) over SGLang's MHA and MLA device KV pools and paged allocator on CPU tensors;
pages move as SGLang's tree moves them (`PoolTransfer`s of token slots and chained page hashes from SGLang's own
hash function), and a load lands as SGLang's forward sees it: through the pool's layer-wait hook.

Run by `test_sglang_release` in a child pytest with a released SGLang's Python first on the path (the stand-in
for torchvision is this process's only). Not collected by the suite itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import ExitStack, nullcontext
from typing import Any

import msgspec
import pytest
import torch

from tests.integrations import sglang_standin

sglang_standin.install()

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_flags, get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvferry.connector.engine_kv import UnsupportedKVLayout  # noqa: E402
from kvferry.integrations.sglang.linker import KvferryLinker  # noqa: E402
from kvferry.server import KvferryServer  # noqa: E402
from tests.integrations.sglangkit import page_server, url_of  # noqa: E402

PAGE, LAYERS, TOKENS, MODEL = 16, 3, 256, "org/tiny-model"
EMBEDDED = {"mode": "embedded", "config": {"cache": {"l1_size_gb": 0.01}}}


class Device:
    """SGLang's device pool of a small model (MHA: 2 KV heads of 8; MLA: rows of 24 + 8) on CPU, random contents,
    its paged allocator, and the cache-init params a linker is built from."""

    def __init__(self, kind: str, seed: int) -> None:
        if kind == "mha":
            self.pool: Any = MHATokenToKVPool(
                TOKENS, PAGE, torch.bfloat16, 2, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
            )
            self.buffers = [*self.pool.k_buffer, *self.pool.v_buffer]
        else:
            self.pool = MLATokenToKVPool(
                TOKENS, PAGE, torch.bfloat16, 24, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
            )
            self.buffers = list(self.pool.kv_buffer)
        generator = torch.Generator().manual_seed(seed)
        for buffer in self.buffers:
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        self.allocator = PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", self.pool, False)
        self.params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator, page_size=PAGE
        )

    def alloc(self, pages: int) -> torch.Tensor:
        """Token slots of whole pages, as SGLang's full component allocates a load's (or a node's)."""
        slots = self.allocator.alloc(pages * PAGE)
        assert slots is not None
        return slots.to(torch.int64)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The reference: a torch gather of every layer's K and V (or latent) rows at ``slots``."""
        return torch.stack([buffer[slots] for buffer in self.buffers])

    def poison(self) -> None:
        for buffer in self.buffers:
            buffer.fill_(7.0)


def make_linker(
    device: Device, extra: dict[str, Any], *, tp: tuple[int, int] | None = None, attn_tp: int = 0, **kwargs: Any
) -> Any:
    """As SGLang's cache registry builds the linker (and hooks its layer counter into the device pool). ``tp``: the
    worker's (rank, size) among the tensor-parallel ranks; ``attn_tp``: with data-parallel attention, the size of
    each attention group (the ranks that share a batch and split its heads)."""
    config = {"linker": "KvferryLinker", "linker_module_path": "kvferry.integrations.sglang.linker",
              "linker_extra_config": extra}  # fmt: skip
    ranks: Any = nullcontext()
    if tp and attn_tp:  # as SGLang publishes a worker's place under --enable-dp-attention
        dp = msgspec.structs.replace(get_flags().dp, enabled=True)
        ranks = ExitStack()
        ranks.enter_context(get_flags().override(dp=dp))
        ranks.enter_context(get_parallel().override(
            tp_rank=tp[0], tp_size=tp[1], attn_tp_rank=tp[0] % attn_tp, attn_tp_size=attn_tp,
            attn_dp_size=tp[1] // attn_tp,
        ))  # fmt: skip
    elif tp:
        ranks = get_parallel().override(tp_rank=tp[0], tp_size=tp[1])
    with ranks:
        linker = create_unified_cache_linker(
            ServerArgs(model_path=MODEL), device.params, backend="dynamic", config=config,
            components=kwargs.get("components", {ComponentType.FULL}),
        )  # fmt: skip
    assert isinstance(linker, KvferryLinker)
    device.pool.register_layer_transfer_counter(linker.layer_done_counter)
    return linker


def page_keys(pages: int, seed: int) -> list[str]:
    """SGLang's chained storage hashes of a random prompt's pages."""
    rng = random.Random(seed)
    return list(get_storage_hash_str([rng.randrange(32000) for _ in range(pages * PAGE)], None, page_size=PAGE))


def offload(linker: Any, keys: list[str], slots: torch.Tensor) -> bool:
    assert linker.offload([PoolTransfer(name=PoolName.KV, device_indices=slots, keys=keys)], session_id="s")
    deadline = time.monotonic() + 10
    while linker.num_completed_offloads() < 1:
        assert time.monotonic() < deadline, "an offload never completed"
        time.sleep(0.005)
    return bool(linker.pop_completed_offload())


def lookup(linker: Any, keys: list[str], rid: str = "r") -> list[int]:
    return linker.lookup(rid, [PoolTransfer(name=PoolName.KV, keys=keys)])


def load(device: Device, linker: Any, keys: list[str], slots: torch.Tensor, rid: str = "r") -> bool:
    """Queue, start and finish a load as SGLang's wrapper and forward do: the forward reads each layer through the
    pool's getter, which waits for the layer in the linker's counter."""
    assert linker.load(rid, [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=keys)])
    index = linker.start_layer_wise_loading()
    assert index >= 0
    linker.layer_done_counter.set_consumer(index)
    for layer in range(LAYERS):
        device.pool.get_key_buffer(layer)
    return bool(linker.finish_layer_wise_loading(index))


def check_round_trip(writer_device: Device, writer: Any, reader_device: Device, reader: Any, seed: int) -> None:
    """``writer`` offloads 5 pages; ``reader`` finds them, and loads them bit-exact into other slots of its pool
    (poisoned first), writing nothing else; misses end the restorable prefix; a load of a miss fails."""
    keys = page_keys(5, seed)
    source = writer_device.alloc(5)
    expected = writer_device.read(source)
    assert offload(writer, keys, source)
    assert lookup(reader, keys) == [1, 2, 3, 4, 5]
    reader_device.poison()
    reader_device.alloc(1)  # the destination is not the source's slots
    target = reader_device.alloc(5)
    assert not torch.equal(target, source)
    assert load(reader_device, reader, keys, target)
    assert torch.equal(reader_device.read(target), expected)
    rest = torch.tensor([s for s in range(PAGE, TOKENS + PAGE) if s not in set(target.tolist())])
    assert bool((reader_device.read(rest) == 7.0).all())  # no other slot written
    unknown = page_keys(1, seed + 1000)
    assert lookup(reader, keys[:2] + unknown + keys[3:]) == [1, 2]
    assert lookup(reader, unknown + keys) == []
    assert lookup(reader, keys[:3]) == [1, 2, 3]
    assert not load(reader_device, reader, keys[:2] + unknown, target[: 3 * PAGE])  # SGLang aborts its requests
    assert load(reader_device, reader, keys[:2], target[: 2 * PAGE])  # and the linker goes on


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with page_server(PAGE) as server:
        yield url_of(server)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_offloaded_then_loaded_into_other_slots_embedded(kind: str) -> None:
    device = Device(kind, seed=1)
    linker = make_linker(device, EMBEDDED)
    try:
        check_round_trip(device, linker, device, linker, seed=1)
    finally:
        linker.close()


def test_an_offload_on_a_gpu_waits_for_the_streams_sglangs_offload_events_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's `record_offload_ready` marks the current stream and, where it has one, the forward stream: the
    linker hands its store those streams (the store marks them on the GPU: `test_sglang_replayed_pools`)."""
    device = Device("mha", seed=1)
    linker = make_linker(device, EMBEDDED)
    handed: list[list[int]] = []
    try:
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
        monkeypatch.setattr(linker, "_on_device", True)
        monkeypatch.setattr(linker.store, "offload", lambda pages, after: handed.append(after))
        slots = torch.arange(PAGE, 2 * PAGE)
        for forward in (type("Stream", (), {"cuda_stream": 7})(), None, type("Stream", (), {"cuda_stream": 1000})()):
            linker.forward_stream = forward
            assert linker.offload([PoolTransfer(name=PoolName.KV, device_indices=slots, keys=page_keys(1, 3))])
        assert handed == [[1000, 7], [1000], [1000]]  # the current stream once where the forward's is the same
    finally:
        monkeypatch.undo()
        linker.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_second_engine_on_the_server_loads_what_the_first_offloaded(kind: str, server_url: str) -> None:
    writer_device, reader_device = Device(kind, seed=2), Device(kind, seed=3)
    settings = {"mode": "server", "server_url": server_url}
    writer, reader = make_linker(writer_device, settings), make_linker(reader_device, settings)
    try:
        check_round_trip(writer_device, writer, reader_device, reader, seed=2 + (kind == "mla"))
    finally:
        writer.close()
        reader.close()


def test_tensor_parallel_ranks_keep_their_own_pages(server_url: str) -> None:
    settings = {"mode": "server", "server_url": server_url}
    devices = [Device("mha", seed=10 + rank) for rank in range(2)]
    ranks = [make_linker(devices[rank], settings, tp=(rank, 2)) for rank in range(2)]
    try:
        assert [linker.keys.rank for linker in ranks] == [0, 1]
        keys = page_keys(3, 20)
        sources = [device.alloc(3) for device in devices]
        expected = [device.read(source) for device, source in zip(devices, sources, strict=True)]
        assert offload(ranks[0], keys, sources[0])
        assert lookup(ranks[1], keys) == []  # rank 1 holds other heads: rank 0's pages are not its
        assert offload(ranks[1], keys, sources[1])
        for device, linker, pages in zip(devices, ranks, expected, strict=True):
            device.poison()
            target = device.alloc(3)
            assert load(device, linker, keys, target)
            assert torch.equal(device.read(target), pages)
    finally:
        for linker in ranks:
            linker.close()


def test_data_parallel_attention_groups_share_the_pages_of_their_head_shard(server_url: str) -> None:
    """--enable-dp-attention, 4 TP ranks in 2 attention groups of 2: a rank holds the heads of its place in its
    group (its attention-TP rank), so ranks 0 and 2 hold the same heads of different requests' pages. A page rank 0
    offloaded is rank 2's hit and loads bit-exact there; rank 1 (other heads) misses it."""
    settings = {"mode": "server", "server_url": server_url}
    devices = [Device("mha", seed=40 + rank) for rank in range(3)]
    ranks = [make_linker(devices[rank], settings, tp=(rank, 4), attn_tp=2) for rank in range(3)]
    try:
        assert [(linker.keys.rank, linker.keys.world_size) for linker in ranks] == [(0, 2), (1, 2), (0, 2)]
        keys = page_keys(3, 41)
        source = devices[0].alloc(3)
        expected = devices[0].read(source)
        assert offload(ranks[0], keys, source)
        assert lookup(ranks[1], keys) == []
        assert lookup(ranks[2], keys) == [1, 2, 3]
        devices[2].poison()
        target = devices[2].alloc(3)
        assert load(devices[2], ranks[2], keys, target)
        assert torch.equal(devices[2].read(target), expected)
    finally:
        for linker in ranks:
            linker.close()


def test_pages_the_hicache_backend_stored_are_the_linkers(server_url: str) -> None:
    """One key scheme and key space: a page SGLang's HiCache backend (kvferry's) stored from the host pool is a hit
    for the linker, which loads it bit-exact into the device pool."""
    device = Device("mha", seed=40)
    info = device.pool.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, "layer_first", pin_memory=False, device_capacity_tokens=device.pool.size,
        start_layer=0, end_layer=LAYERS, write_back_staging=device.pool.hicache_write_back_staging,
    )  # fmt: skip
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(41)))
    settings = {"mode": "server", "server_url": server_url}
    storage = StorageBackendFactory.create_backend(
        "dynamic",
        HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=False, model_name=MODEL,
            extra_config={"backend_name": "kvferry", "module_path": "kvferry.integrations.sglang.hicache_storage",
                          "class_name": "KvferryHiCacheStorage", "interface_v1": 1, **settings},
        ),
        host,
    )  # fmt: skip
    storage.register_mem_pool_host(host)
    linker = make_linker(device, settings)
    try:
        keys = page_keys(3, 42)
        host_pages = [4, 9, 2]
        assert storage.batch_set_v1(keys, (torch.tensor(host_pages)[:, None] * PAGE + torch.arange(PAGE)).flatten())
        assert lookup(linker, keys) == [1, 2, 3]
        device.poison()
        target = device.alloc(3)
        assert load(device, linker, keys, target)
        # the host pool's layer_first buffer is [K/V, layers, slots, heads, dim]
        expected = torch.cat([host.kv_buffer[:, :, p * PAGE : (p + 1) * PAGE] for p in host_pages], dim=2)
        assert torch.equal(device.read(target), expected.flatten(0, 1))
    finally:
        linker.close()
        storage.close()


def test_queued_loads_cancel_and_odd_transfers_are_refused_not_raised() -> None:
    device = Device("mla", seed=50)
    linker = make_linker(device, EMBEDDED)
    try:
        keys = page_keys(2, 51)
        assert offload(linker, keys, device.alloc(2))
        target = device.alloc(2)
        assert linker.load("a", [PoolTransfer(name=PoolName.KV, device_indices=target, keys=keys)])
        assert not linker.load("a", [PoolTransfer(name=PoolName.KV, device_indices=target, keys=keys)])
        assert linker.cancel_queued_load("a") and not linker.cancel_queued_load("a")
        assert linker.start_layer_wise_loading() == -1  # nothing queued
        unaligned = PoolTransfer(name=PoolName.KV, device_indices=target + 3, keys=keys)
        assert not linker.load("b", [unaligned]) and not linker.offload([unaligned])
        short = PoolTransfer(name=PoolName.KV, device_indices=target[:PAGE], keys=keys)
        assert not linker.load("b", [short]) and not linker.offload([short])
        assert linker.num_completed_offloads() == 0
        assert lookup(linker, keys, rid="c") == [1, 2]
        linker.reset()  # quiesces, drops the lookup's locks and the results
        assert load(device, linker, keys, target, rid="c")
    finally:
        linker.close()


def test_bad_settings_pools_and_chunk_sizes_refuse_to_start() -> None:
    device = Device("mha", seed=0)
    with pytest.raises(ValueError, match=r"linker_extra_config: .*mdoe"):
        make_linker(device, {"mdoe": "server"})
    with pytest.raises(UnsupportedKVLayout, match=r"the pools \['kv', 'mamba'\] and its device cache \['kv'\]"):
        make_linker(device, EMBEDDED, components={ComponentType.FULL, ComponentType.MAMBA})
    with pytest.raises(UnsupportedKVLayout, match="also has auxiliary_swa components"):
        make_linker(device, EMBEDDED, components={ComponentType.FULL, ComponentType.AUXILIARY_SWA})
    hnd = Device("mha", seed=0)
    hnd.pool.kv_cache_layout = "hnd"
    with pytest.raises(UnsupportedKVLayout, match="'hnd'"):
        make_linker(hnd, EMBEDDED)
    with page_server(2 * PAGE) as server, pytest.raises(ValueError, match=f"--chunk-size {PAGE}"):
        make_linker(device, {"mode": "server", "server_url": url_of(server)})


def test_a_server_that_goes_away_is_a_miss_and_a_failed_load() -> None:
    with page_server(PAGE, 1 << 20) as server:
        device = Device("mha", seed=60)
        linker = make_linker(device, {"mode": "server", "server_url": url_of(server), "timeout_s": 0.5})
        try:
            keys = page_keys(2, 61)
            assert offload(linker, keys, device.alloc(2))
            assert lookup(linker, keys) == [1, 2]
            server.stop()
            assert lookup(linker, keys) == []
            assert not load(device, linker, keys, device.alloc(2))
            assert not offload(linker, keys, device.alloc(2))
        finally:
            linker.close()


@pytest.fixture
def tree_server() -> Iterator[KvferryServer]:
    with page_server(PAGE, 4 << 20) as server:
        yield server


def test_sglangs_radix_tree_offloads_through_the_linker_and_another_engine_loads_back(
    tree_server: KvferryServer,
) -> None:
    """SGLang's own tree flow (`UnifiedRadixCache` with the linker wrapper): an engine inserts a computed prompt,
    its write-through offloads the pages and commits them; a second engine's prefix match finds them in kvferry,
    loads them back into request-private slots, its forward waits for the layers and the load is confirmed,
    bit-exact. The same flow after the server lost the pages reports the request as failed (SGLang aborts it).
    A request is a stand-in with the attributes the tree reads (SGLang's Req needs a tokenised request)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context

    server = tree_server
    settings = {"mode": "server", "server_url": url_of(server)}
    caches: list[Any] = []

    def tree(device: Device) -> Any:
        device.params.tree_components = (ComponentType.FULL,)
        device.params.req_to_token_pool = ReqToTokenPool(8, 512, "cpu", False)
        cache = UnifiedRadixCache(device.params)
        cache.init_cache_linker(make_linker(device, settings))
        caches.append(cache)
        return cache

    def load_back(cache: Any, tokens: list[int], rid: str) -> tuple[Any, torch.Tensor]:
        """Match (the tree asks the linker) and queue the external hit's load into request-private slots."""
        req = SimpleNamespace(rid=rid, last_node=None, kv=None, swa_branching_seqlen=None, session=None)
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
        assert (match.device_prefix_len, match.host_hit_length) == (0, 4 * PAGE)  # whole pages only
        req.last_node = match.last_device_node
        loaded, _ = cache.init_load_back(
            InitLoadBackParams(best_match_node=match.last_host_node, host_hit_length=match.host_hit_length, req=req)
        )
        assert loaded == 4 * PAGE
        return req, cache.linker.private_load_indices[rid]

    def forward(cache: Any, device: Device, req: Any) -> list[Any]:
        """Start the batch's loads, read every layer as the forward does, and collect the failed requests."""
        device.poison()
        cache.linker.layer_done_counter.set_consumer(cache.ready_to_load_host_cache())
        for layer in range(LAYERS):
            device.pool.get_key_buffer(layer)
        return list(cache.finish_external_linker_loads([req]))

    published = get_context().override_server_args(model_path=MODEL)
    published.install()  # the tree reads SGLang's published config (its disaggregation mode)
    try:
        writer, reader, late = Device("mha", seed=70), Device("mha", seed=71), Device("mha", seed=72)
        source_tree = tree(writer)
        tokens = list(range(1000, 1000 + 4 * PAGE + 5))  # 4 whole pages and 5 tokens
        slots = writer.alloc(5)[: len(tokens)]
        expected = writer.read(slots[: 4 * PAGE])
        source_tree.insert(InsertParams(key=RadixKey(tokens), value=slots))
        assert source_tree.linker.pending_offloads, "the insert wrote nothing through to the linker"
        deadline = time.monotonic() + 10
        while source_tree.linker.pending_offloads:
            assert time.monotonic() < deadline, "the write-through offload never completed"
            source_tree.check_hicache_events()
            time.sleep(0.005)
        reader_tree = tree(reader)
        req, target = load_back(reader_tree, tokens, "q")
        assert forward(reader_tree, reader, req) == [] and torch.equal(reader.read(target), expected)
        late_tree = tree(late)
        req, _ = load_back(late_tree, tokens, "lost")
        server.engine.clear()  # the server loses the pages (and the lookup's locks) after the match
        assert forward(late_tree, late, req) == [req]
        assert req.skip_radix_cache_insert  # SGLang drops the request's output and never inserts its slots
    finally:
        for cache in caches:
            cache.linker.close()
        published.restore()


def test_the_documented_linker_launch_goes_through_sglangs_parser_and_factory_config() -> None:
    """docs/sglang.md's linker commands as SGLang's own argument parser and linker config read them: the config
    names kvferry's linker class, its extra config is kvferry's settings, and the page size is the documented
    server's chunk size."""
    import argparse
    import json
    import shlex

    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig

    from kvferry.connector.settings import ConnectorSettings
    from tests.integrations.sglangkit import documented_launch

    lines = [shlex.split(command) for command in documented_launch("--enable-unified-cache-external-linker")]
    (server,) = [words for words in lines if words[:2] == ["kvferry", "server"]]
    (launch,) = [words[3:] for words in lines if words[:3] == ["python", "-m", "sglang.launch_server"]]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(launch)
    assert args.enable_unified_cache_external_linker and args.unified_cache_external_linker_backend == "dynamic"
    assert not args.enable_hierarchical_cache
    assert server[server.index("--chunk-size") + 1] == str(args.page_size)
    config = args.unified_cache_external_linker_config
    config = UnifiedCacheLinkerConfig.from_dict(json.loads(config) if isinstance(config, str) else config)
    module = __import__(config.linker_module_path, fromlist=[config.linker])
    assert getattr(module, config.linker) is KvferryLinker
    assert ConnectorSettings.from_extra_config(config.linker_extra_config).mode == "server"
