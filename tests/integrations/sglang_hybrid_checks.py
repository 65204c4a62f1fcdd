"""kvferry's unified-cache linker under SGLang's hybrid models: its sliding-window (``SWAKVPool``: full and SWA
layers in pools of their own) and Mamba (``HybridLinearKVPool`` beside a ``HybridReqToTokenPool``'s recurrent
states) device caches, built by SGLang's own classes on CPU tensors, driven by SGLang's own tree
(`UnifiedRadixCache` with its tree components and the linker wrapper) and by its transfers' hit policies.

Run by `test_sglang_release` in a child pytest with a released SGLang's Python first on the path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.integrations import sglang_standin

sglang_standin.install()

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape  # noqa: E402
from sglang.srt.managers.schedule_batch import ReqKvInfo  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context, get_server_args  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvferry.connector.engine_kv import UnsupportedKVLayout  # noqa: E402
from kvferry.server import KvferryServer  # noqa: E402
from tests.integrations.sglang_linker_checks import EMBEDDED, MODEL, PAGE, page_keys  # noqa: E402
from tests.integrations.sglangkit import page_server, url_of  # noqa: E402

TOKENS, FULL_LAYERS, SIDE_LAYERS = 256, [1, 3], [0, 2]  # layers 0 and 2 sliding-window (or Mamba), 1 and 3 full
WINDOW = 2 * PAGE
POISON = 7.0


class HybridDevice:
    """A hybrid model's device caches on CPU (random contents), the allocators and the cache-init params SGLang's
    tree and linker are built from. ``kind``: ``swa`` or ``mamba``."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        if kind == "swa":
            self.kvcache: Any = SWAKVPool(
                size=TOKENS, size_swa=TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
                swa_attention_layer_ids=SIDE_LAYERS, full_attention_layer_ids=FULL_LAYERS, device="cpu",
            )  # fmt: skip
            full, swa = self.kvcache.full_kv_pool, self.kvcache.swa_kv_pool
            self.full = [*full.k_buffer, *full.v_buffer]
            self.side = [*swa.k_buffer, *swa.v_buffer]  # token rows of the SWA pool's own slots
            self.allocator: Any = SWATokenToKVPoolAllocator(
                TOKENS, TOKENS, PAGE, torch.bfloat16, "cpu", self.kvcache, False
            )
            requests: Any = ReqToTokenPool(8, 512, "cpu", False)
            extra: dict[str, Any] = {"sliding_window_size": WINDOW}
        else:
            shape = Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=8, state_size=16,
                conv_kernel=4,
            )  # fmt: skip
            states = Mamba2CacheParams(
                shape=shape, layers=SIDE_LAYERS, dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
            )
            requests = HybridReqToTokenPool(
                size=8, mamba_size=6, mamba_spec_state_size=0, max_context_len=512, device="cpu",
                enable_memory_saver=False, cache_params=states, mamba_layer_ids=SIDE_LAYERS,
                enable_mamba_extra_buffer=True,
            )  # fmt: skip
            self.kvcache = HybridLinearKVPool(
                size=TOKENS, dtype=torch.bfloat16, page_size=PAGE, head_num=2, head_dim=8,
                full_attention_layer_ids=FULL_LAYERS, device="cpu", mamba_pool=requests.mamba_pool,
            )  # fmt: skip
            full = self.kvcache.full_kv_pool
            self.full = [*full.k_buffer, *full.v_buffer]
            cache = requests.mamba_pool.mamba_cache
            self.side = [cache.temporal, *cache.conv]  # [layers, slots, ...]: a slot a request's state
            self.allocator = PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", self.kvcache, False)
            extra = {"enable_mamba_extra_buffer": True}
        self.requests = requests
        generator = torch.Generator().manual_seed(seed)
        for buffer in [*self.full, *self.side]:
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        side = ComponentType.SWA if kind == "swa" else ComponentType.MAMBA
        self.components = (ComponentType.FULL, side)
        self.params = CacheInitParams(
            disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=self.allocator, page_size=PAGE,
            tree_components=self.components, **extra,
        )  # fmt: skip

    def alloc(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-pool token slots of whole pages, and their side: the SWA pool's slots (mapped as SGLang's SWA
        allocator maps them), or one Mamba state slot."""
        if self.kind == "swa":
            full = self.allocator.full_attn_allocator.alloc(pages * PAGE)
            swa = self.allocator.swa_attn_allocator.alloc(pages * PAGE)
            self.allocator.set_full_to_swa_mapping(full, swa)
            return full.to(torch.int64), swa.to(torch.int64)
        full = self.allocator.alloc(pages * PAGE)
        return full.to(torch.int64), self.requests.mamba_allocator.alloc(1)

    def read_full(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.stack([buffer[slots] for buffer in self.full])

    def read_side(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """The SWA pool's rows at ``slots``, or the Mamba states of slot ``slots`` (each state tensor's layers)."""
        if self.kind == "swa":
            return [torch.stack([buffer[slots] for buffer in self.side])]
        return [buffer[:, slots.reshape(-1)] for buffer in self.side]

    def poison(self) -> None:
        for buffer in [*self.full, *self.side]:
            buffer.fill_(POISON)

    def forward(self) -> None:
        """Read every layer as SGLang's forward does, each through its pool's wait on the linker's counter."""
        for layer in range(len(FULL_LAYERS) + len(SIDE_LAYERS)):
            if layer in FULL_LAYERS or self.kind == "swa":
                self.kvcache.get_key_buffer(layer)
            else:
                self.requests.mamba2_layer_cache(layer)


def make_linker(device: HybridDevice, extra: dict[str, Any]) -> Any:
    config = {"linker": "KvferryLinker", "linker_module_path": "kvferry.integrations.sglang.linker",
              "linker_extra_config": extra}  # fmt: skip
    linker = create_unified_cache_linker(
        ServerArgs(model_path=MODEL), device.params, backend="dynamic", config=config,
        components=set(device.components),
    )  # fmt: skip
    device.kvcache.register_layer_transfer_counter(linker.layer_done_counter)
    return linker


@pytest.fixture
def published() -> Iterator[None]:
    """SGLang's published server args, as its scheduler publishes them (the tree reads them); a Mamba state is
    cached at page boundaries (SGLang's test fixtures pre-seed the Mamba chunk size: no model config is read)."""
    published = get_context().override_server_args(model_path=MODEL)
    published.install()
    get_server_args()._mamba_cache_chunk_size = PAGE
    try:
        yield
    finally:
        published.restore()


@pytest.fixture
def server() -> Iterator[KvferryServer]:
    with page_server(PAGE, 8 << 20) as server:
        yield server


def _tree(device: HybridDevice, settings: dict[str, Any], caches: list[Any]) -> Any:
    cache = UnifiedRadixCache(device.params)
    cache.init_cache_linker(make_linker(device, settings))
    caches.append(cache)
    return cache


def _offloaded(cache: Any) -> None:
    deadline = time.monotonic() + 10
    while cache.linker.pending_offloads:
        assert time.monotonic() < deadline, "the write-through offload never completed"
        cache.check_hicache_events()
        time.sleep(0.005)


def _queue_load(cache: Any, device: HybridDevice, tokens: list[int], rid: str) -> tuple[Any, torch.Tensor, Any]:
    """Match (the tree asks the linker) and queue the external hit's load; the request, its full-pool slots and
    its side slots (the SWA slots of its window's tokens, or its Mamba state slot)."""
    req = SimpleNamespace(rid=rid, last_node=None, kv=ReqKvInfo(), swa_branching_seqlen=None, session=None)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), req=req))
    hit = len(tokens) // PAGE * PAGE
    assert (match.device_prefix_len, match.host_hit_length) == (0, hit)
    req.last_node = match.last_device_node
    loaded, _ = cache.init_load_back(
        InitLoadBackParams(best_match_node=match.last_host_node, host_hit_length=match.host_hit_length, req=req)
    )
    assert loaded == hit
    slots = cache.linker.private_load_indices[rid]
    if device.kind == "swa":
        return req, slots, device.allocator.full_to_swa_index_mapping[slots[hit - WINDOW :]]
    return req, slots, req.kv.mamba_pool_idx


def _forward(cache: Any, device: HybridDevice, req: Any) -> list[Any]:
    """Start the batch's loads over poisoned pools, run the forward, and collect the failed requests."""
    device.poison()
    cache.linker.layer_done_counter.set_consumer(cache.ready_to_load_host_cache())
    device.forward()
    return list(cache.finish_external_linker_loads([req]))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_sglangs_hybrid_tree_offloads_and_another_engine_loads_the_window_or_the_state(
    kind: str, groups: int, published: None, server: KvferryServer
) -> None:
    """An engine inserts a computed prompt; SGLang's write-through offloads its full pages with its sliding
    window's pages (or its Mamba state); a second engine on the same server matches the prompt, loads the full
    pages, the window's last pages into its SWA pool (or the state into the request's state slot), bit-exact, and
    nothing else. After the server lost them, the same flow fails the request (SGLang aborts it). Also with the
    loads in 3 groups of layers (each pool's layers in the groups of the forward's they belong to)."""
    settings = {"mode": "server", "server_url": url_of(server), "layer_groups": groups}
    caches: list[Any] = []
    try:
        writer, reader, late = (HybridDevice(kind, seed) for seed in (80, 81, 82))
        source = _tree(writer, settings, caches)
        tokens = list(range(2000, 2000 + 4 * PAGE + 3))  # 4 whole pages and 3 tokens
        full, side = writer.alloc(5)
        expected_full = writer.read_full(full[: 4 * PAGE])
        expected_side = writer.read_side(side[2 * PAGE : 4 * PAGE] if kind == "swa" else side)
        mamba = {"mamba_value": side} if kind == "mamba" else {}
        source.insert(InsertParams(key=RadixKey(tokens[: 4 * PAGE]), value=full[: 4 * PAGE], **mamba))
        _offloaded(source)
        reader_tree = _tree(reader, settings, caches)
        req, slots, loaded_side = _queue_load(reader_tree, reader, tokens, "q")
        assert _forward(reader_tree, reader, req) == []
        assert torch.equal(reader.read_full(slots), expected_full)
        for got, want in zip(reader.read_side(loaded_side), expected_side, strict=True):
            assert torch.equal(got, want)
        rows = [(b != POISON).flatten(1).any(1) for b in reader.full]
        assert all(int(written.sum()) == 4 * PAGE for written in rows)  # no other full-pool row written
        late_tree = _tree(late, settings, caches)
        req, _, _ = _queue_load(late_tree, late, tokens, "lost")
        server.engine.clear()  # the server loses them (and the lookup's locks) after the match
        assert _forward(late_tree, late, req) == [req]
    finally:
        for cache in caches:
            cache.linker.close()


def _transfer(name: PoolName, keys: list[str], indices: torch.Tensor | None = None) -> PoolTransfer:
    policy = PoolHitPolicy.ALL_PAGES if name == PoolName.KV else PoolHitPolicy.TRAILING_PAGES
    return PoolTransfer(name=name, keys=keys, device_indices=indices, hit_policy=policy)


def _offload(linker: Any, transfers: list[PoolTransfer]) -> bool:
    assert linker.offload(transfers)
    deadline = time.monotonic() + 10
    while linker.num_completed_offloads() < 1:
        assert time.monotonic() < deadline, "an offload never completed"
        time.sleep(0.005)
    return bool(linker.pop_completed_offload())


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_restorable_lengths_follow_the_pools_hit_policies(kind: str, published: None) -> None:
    """Embedded: full pages 1-5 offloaded, the side pool only at node ends: the SWA pages of pages 2-3 (a window
    ending at 4), or states after pages 2 and 4. The restorable lengths are those whose window (state) is held,
    as SGLang's policies say; a length the side pool cannot restore is never offered, whatever the full pages."""
    device = HybridDevice(kind, 90)
    linker = make_linker(device, EMBEDDED)
    side_pool = PoolName.SWA if kind == "swa" else PoolName.MAMBA
    try:
        keys = page_keys(5, 91)
        full, side = device.alloc(5)
        assert _offload(linker, [_transfer(PoolName.KV, keys, full)])
        if kind == "swa":
            assert _offload(linker, [_transfer(PoolName.SWA, keys[2:4], side[2 * PAGE : 4 * PAGE])])
            want, trailing = [4], keys[-2:]  # a window of 2 pages ending at 4 (pages 2, 3) only
        else:
            state2 = device.requests.mamba_allocator.alloc(1)
            assert _offload(linker, [_transfer(PoolName.MAMBA, keys[1:2], state2)])
            assert _offload(linker, [_transfer(PoolName.MAMBA, keys[3:4], side)])
            want, trailing = [2, 4], keys[-1:]
        lookup = [_transfer(PoolName.KV, keys), _transfer(side_pool, trailing)]
        assert linker.lookup("r", lookup) == want
        # a shorter prompt, a shorter window (one page: SGLang's window on a prompt shorter than it)
        short = [_transfer(PoolName.KV, keys[:3]), _transfer(side_pool, keys[2:3])]
        assert linker.lookup("r", short) == ([3] if kind == "swa" else [2])
        # a load of the longest: the full pages and the side pool's last pages land in other slots
        n = want[-1]
        expected_full = device.read_full(full[: n * PAGE])
        expected_side = device.read_side(side[2 * PAGE : 4 * PAGE] if kind == "swa" else side)
        target_full, target_side = device.alloc(n)
        target_side = target_side[: 2 * PAGE] if kind == "swa" else target_side
        device.poison()
        window = keys[2:4] if kind == "swa" else keys[3:4]
        assert linker.load(
            "r", [_transfer(PoolName.KV, keys[:n], target_full), _transfer(side_pool, window, target_side)]
        )
        index = linker.start_layer_wise_loading()
        linker.layer_done_counter.set_consumer(index)
        device.forward()
        assert linker.finish_layer_wise_loading(index)
        assert torch.equal(device.read_full(target_full), expected_full)
        for got, want_side in zip(device.read_side(target_side), expected_side, strict=True):
            assert torch.equal(got, want_side)
        # transfers kvferry cannot take are refused, not raised: a side pool's slots that are not whole pages (a
        # state: not one slot a key)
        odd = target_side[:3] if kind == "swa" else torch.cat([target_side, target_side])
        assert not linker.load(
            "x", [_transfer(PoolName.KV, keys[:1], target_full[:PAGE]), _transfer(side_pool, window[-1:], odd)]
        )
        # a side page never stored fails the load (SGLang aborts it), and the linker goes on
        unknown = page_keys(1, 92)
        side_page = target_side[:PAGE] if kind == "swa" else target_side
        assert linker.load(
            "u", [_transfer(PoolName.KV, keys[:1], target_full[:PAGE]), _transfer(side_pool, unknown, side_page)]
        )
        index = linker.start_layer_wise_loading()
        assert not linker.finish_layer_wise_loading(index)
    finally:
        linker.close()


def test_other_hybrid_caches_refuse_to_start(published: None) -> None:
    """A component kvferry does not link, a tree whose pools are not its device cache's, and a Mamba pool with
    side states kvferry does not move are refused at start, naming what."""
    swa = HybridDevice("swa", 0)
    with pytest.raises(UnsupportedKVLayout, match="also has c128 components"):
        create_unified_cache_linker(
            ServerArgs(model_path=MODEL), swa.params, backend="dynamic",
            config={"linker": "KvferryLinker", "linker_module_path": "kvferry.integrations.sglang.linker",
                    "linker_extra_config": EMBEDDED},
            components={ComponentType.FULL, ComponentType.C128},
        )  # fmt: skip
    swa.components = (ComponentType.FULL, ComponentType.MAMBA)
    with pytest.raises(UnsupportedKVLayout, match=r"the pools \['kv', 'mamba'\] and its device cache \['kv', 'swa'\]"):
        make_linker(swa, EMBEDDED)
    mamba = HybridDevice("mamba", 0)
    mamba.requests.ngram_pool = SimpleNamespace(enabled=True)
    with pytest.raises(UnsupportedKVLayout, match="n-gram states"):
        make_linker(mamba, EMBEDDED)
