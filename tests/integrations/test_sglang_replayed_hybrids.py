"""kvferry's SGLang linker store over hybrid models' device pools without SGLang: SGLang's MHA pools replayed from
their recording (`kvferry.bench.sglang_pools`) as an ``SWAKVPool``'s full and window pools, or as a
``HybridLinearKVPool``'s full pool beside a request pool's Mamba states allocated as SGLang's ``MambaPool`` allocates
them (``[layers, slots + 1, ...]`` per state tensor). A prefix's full pages and its window's pages (or its state)
stored from some slots and loaded into others: every copied byte equal to its source, every other byte unchanged,
in process and through a server. On the CPU with the small recorded pool; with the gpu marker, Llama-3-8B's on the
GPU. (`sglang_hybrid_checks` drives the same code under SGLang's own classes, on the CPU.)"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvferry.bench.sglang_pools import BENCH_TAG, load_fixtures, replay
from kvferry.integrations.sglang.device_pools import KV, MAMBA, SWA, device_pools
from kvferry.integrations.sglang.linker_pools import PoolPages, PoolPlan
from kvferry.integrations.sglang.linker_store import open_linker_store
from kvferry.integrations.sglang.load_counter import LoadCounter
from kvferry.integrations.sglang.page_store import PageKeySpace
from tests.integrations.test_sglang_replayed_pools import DEVICES, settings_for

STATE_SLOTS = 8


def _pool(device: str) -> Any:
    tag = BENCH_TAG if device == "cuda" else ""
    fixture = next(f for f in load_fixtures() if f["case"]["kind"] == "mha" and f["case"]["tag"] == tag)
    return replay(fixture, device)


def _named(kind: str, **attributes: Any) -> Any:
    return type(kind, (), attributes)()


def _swa(device: str) -> tuple[Any, Any]:
    full, window = _pool(device), _pool(device)
    layers = len(full.k_buffer)
    full_ids, window_ids = range(1, 2 * layers, 2), range(0, 2 * layers, 2)
    # SGLang's map of a model layer to its index in its pool and whether that pool is the window's
    mapping = {i: (n, False) for n, i in enumerate(full_ids)} | {i: (n, True) for n, i in enumerate(window_ids)}
    return _named(
        "SWAKVPool", full_kv_pool=full, swa_kv_pool=window, layer_num=2 * layers, start_layer=0, layers_mapping=mapping
    ), None


def _mamba(device: str) -> tuple[Any, Any]:
    full = _pool(device)
    layers = len(full.k_buffer)
    temporal = torch.zeros((layers, STATE_SLOTS + 1, 4, 8, 16), dtype=torch.float32, device=device)
    conv = torch.zeros((layers, STATE_SLOTS + 1, 128, 3), dtype=torch.bfloat16, device=device)
    states = _named("MambaPool", mamba_cache=SimpleNamespace(temporal=temporal, conv=[conv]))
    requests = _named(
        "HybridReqToTokenPool", mamba_pool=states, mamba_map={2 * i: i for i in range(layers)}, mamba_ckpt_pool=None,
        short_conv_pool=SimpleNamespace(enabled=False), ngram_pool=SimpleNamespace(enabled=False),
    )  # fmt: skip
    kvcache = _named(
        "HybridLinearKVPool", full_kv_pool=full, start_layer=0,
        full_attention_layer_id_mapping={2 * i + 1: i for i in range(layers)},
    )  # fmt: skip
    return kvcache, requests


def _buffers(kvcache: Any, requests: Any) -> list[torch.Tensor]:
    pools = [kvcache.full_kv_pool] + ([kvcache.swa_kv_pool] if requests is None else [])
    buffers = [b for pool in pools for b in [*pool.k_buffer, *pool.v_buffer]]
    if requests is not None:
        cache = requests.mamba_pool.mamba_cache
        buffers += [cache.temporal, *cache.conv]
    return buffers


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["embedded", "server"])
@pytest.mark.parametrize("kind", ["swa", "mamba"])
@pytest.mark.parametrize("groups", [1, 4])  # loads in groups of layers (the linker's layer_groups)
def test_a_hybrid_prefix_goes_out_and_comes_back_bit_exact(device: str, mode: str, kind: str, groups: int) -> None:
    kvcache, requests = (_swa if kind == "swa" else _mamba)(device)
    buffers = _buffers(kvcache, requests)
    generator = torch.Generator(device=device).manual_seed(11)
    for buffer in buffers:
        bits = buffer.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, generator=generator, dtype=torch.uint8, device=device))
    page = int(kvcache.full_kv_pool.page_size)
    linked = device_pools(kvcache, requests, page)
    side = SWA if kind == "swa" else MAMBA
    assert set(linked.pools) == {KV, side} and linked.num_layers == 2 * len(kvcache.full_kv_pool.k_buffer)
    slots = kvcache.full_kv_pool.k_buffer[0].shape[0]
    count = min(16, (slots // page - 1) // 2)  # page 0 is SGLang's padding page
    source, dest = list(range(1, count + 1)), list(range(count + 1, 2 * count + 1))
    window = [count - 2, count - 1]  # the window's last two pages (SWA); the state after the last page (Mamba)
    side_src, side_dst = ([source[i] for i in window], [dest[i] for i in window]) if kind == "swa" else ([3], [6])
    side_keys = [f"{1000 + i:064x}" for i in (window if kind == "swa" else [count - 1])]
    keys = [f"{1000 + i:064x}" for i in range(count)]
    page_bytes = sum(b[0].numel() * b.element_size() for b in buffers) * page
    counter = LoadCounter(linked.num_layers)
    with settings_for(mode, device, page, 4 * count * page_bytes + (16 << 20)) as settings:
        plans = [PoolPlan(pool, PageKeySpace("org/replayed-hybrid", 1, 0)) for pool in linked.pools.values()]
        store = open_linker_store(settings, plans, page, linked.num_layers, counter, name="replayed", groups=groups)
        try:
            store.offload([PoolPages(KV, keys, source), PoolPages(side, side_keys, side_src)], [])
            deadline = time.monotonic() + 60
            while store.completed_offloads() == 0:
                assert time.monotonic() < deadline, "the offload did not end"
                time.sleep(0.01)
            assert store.pop_offload()
            moves = _moves(kind, kvcache, requests, page, source, dest, side_src, side_dst)
            for buffer, _, rows_to in moves:  # the destinations poisoned; the rest kept to compare
                buffer.view(torch.uint8)[rows_to] = 0xA5
            before = [buffer.view(torch.uint8).clone() for buffer, _, _ in moves]
            trailing = {side: len(side_keys)}
            assert store.lookup("r", keys, trailing) == [count]  # the window (state) exists at the end only
            assert store.queue_load("r", [PoolPages(KV, keys, dest), PoolPages(side, side_keys, side_dst)])
            index = store.start_loads()
            counter.set_consumer(index)  # as SGLang's forward waits for the last layer
            counter.wait_until(linked.num_layers - 1)
            if device == "cuda":
                torch.cuda.synchronize()
            assert counter.finish(index)
            for (buffer, rows_from, rows_to), old in zip(moves, before, strict=True):
                bits = buffer.view(torch.uint8)
                assert torch.equal(bits[rows_to], bits[rows_from])
                bits[rows_to] = old[rows_to]
                assert torch.equal(bits, old)  # nothing else written
        finally:
            store.close()


def _moves(
    kind: str, kvcache: Any, requests: Any, page: int, source: list[int], dest: list[int], side_src: list[int],
    side_dst: list[int],
) -> list[tuple[torch.Tensor, Any, Any]]:  # fmt: skip
    """(buffer, source rows, destination rows) of every buffer a load writes."""

    def rows(pages: list[int]) -> torch.Tensor:
        return torch.tensor([p * page + t for p in pages for t in range(page)])

    full = kvcache.full_kv_pool
    moves = [(b, rows(source), rows(dest)) for b in [*full.k_buffer, *full.v_buffer]]
    if kind == "swa":
        window = kvcache.swa_kv_pool
        moves += [(b, rows(side_src), rows(side_dst)) for b in [*window.k_buffer, *window.v_buffer]]
    else:
        cache = requests.mamba_pool.mamba_cache
        for tensor in [cache.temporal, *cache.conv]:
            moves += [(layer, torch.tensor(side_src), torch.tensor(side_dst)) for layer in tensor.unbind(0)]
    return moves
