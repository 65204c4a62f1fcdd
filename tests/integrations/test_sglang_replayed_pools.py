"""kvferry's SGLang linker store over SGLang's device pools as its allocation code builds them, replayed from their
recording (`kvferry.bench.sglang_pools`; no SGLang needed): pages stored from one set of slots and loaded into
another, every copied byte equal to a torch gather of the source and every other byte unchanged, in process and
through a server. On the CPU with the small recorded pools; with the gpu marker, the model-sized ones (Llama-3-8B's
MHA, DeepSeek-V3's MLA latent, 64-token pages) on the GPU, where an SGLang worker keeps them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.bench.sglang_pools import BENCH_TAG, load_fixtures, replay
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.device_pages import device_kv
from kvferry.integrations.sglang.device_pools import KV, kv_pool
from kvferry.integrations.sglang.linker_pools import PoolPages, PoolPlan
from kvferry.integrations.sglang.linker_store import open_linker_store
from kvferry.integrations.sglang.load_counter import LoadCounter
from kvferry.integrations.sglang.page_store import PageKeySpace
from kvferry.memory import HostPool
from kvferry.server import KvferryServer
from tests.server.serverkit import ServerProcess

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@contextlib.contextmanager
def settings_for(mode: str, device: str, page_size: int, pool_bytes: int) -> Iterator[ConnectorSettings]:
    cache = {"l1_size_gb": pool_bytes / 1e9, "chunk_size": page_size}
    if mode == "embedded":
        yield ConnectorSettings.from_extra_config({"mode": "embedded", "config": {"cache": cache}})
        return
    if device == "cuda":  # CUDA IPC opens another process's memory only: the server runs in a process of its own
        process = ServerProcess("--chunk-size", str(page_size), "--l1-size-gb", str(pool_bytes / 1e9))
        try:
            yield ConnectorSettings.from_extra_config({"mode": "server", "server_url": process.endpoint})
        finally:
            process.stop()
        return
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": page_size}})
    engine = CacheEngine(config, pool=HostPool(pool_bytes, pin=False))
    server = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    server.start()
    try:
        yield ConnectorSettings.from_extra_config({"mode": "server", "server_url": f"tcp://127.0.0.1:{server.port}"})
    finally:
        server.stop()
        engine.close()


def _buffers(pool: Any) -> list[torch.Tensor]:
    return [*pool.k_buffer, *pool.v_buffer] if hasattr(pool, "k_buffer") else list(pool.kv_buffer)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["embedded", "server"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_go_out_and_come_back_bit_exact(device: str, mode: str, kind: str) -> None:
    tag = BENCH_TAG if device == "cuda" else ""
    fixture = next(f for f in load_fixtures() if f["case"]["kind"] == kind and f["case"]["tag"] == tag)
    pool = replay(fixture, device)
    buffers = _buffers(pool)
    generator = torch.Generator(device=device).manual_seed(7)
    for buffer in buffers:
        buffer.view(torch.uint8).copy_(torch.randint(0, 256, _bits(buffer).shape, generator=generator, device=device))
    kv = device_kv(pool)
    page, slots = kv.block_size, buffers[0].shape[0]
    count = min(16, (slots // page - 1) // 2)  # page 0 is SGLang's padding page
    source, dest = list(range(1, count + 1)), list(range(count + 1, 2 * count + 1))
    keys = [f"{i:064x}" for i in range(1000, 1000 + count)]
    page_bytes = sum(b[:page].numel() * b.element_size() for b in buffers)
    counter = LoadCounter(len(kv.layers))
    with settings_for(mode, device, page, 2 * count * page_bytes + (8 << 20)) as settings:
        plans = [PoolPlan(kv_pool(kv), PageKeySpace("org/replayed", 1, 0))]
        store = open_linker_store(settings, plans, page, len(kv.layers), counter, name="replayed")
        try:
            writers = [torch.cuda.current_stream().cuda_stream] if device == "cuda" else []
            store.offload([PoolPages(KV, keys, source)], writers)
            deadline = time.monotonic() + 60
            while store.completed_offloads() == 0:
                assert time.monotonic() < deadline, "the offload did not end"
                time.sleep(0.01)
            assert store.pop_offload()
            rows = lambda pages: torch.tensor([p * page + t for p in pages for t in range(page)], device=device)  # noqa: E731
            expected = [_bits(b[rows(source)]) for b in buffers]
            for buffer in buffers:  # the destination pages poisoned; the rest of each buffer is kept to compare
                buffer[rows(dest)] = buffer[rows(dest)].view(torch.uint8).fill_(0xA5).view(buffer.dtype)
            before = [_bits(b).clone() for b in buffers]
            assert store.lookup("r", keys) == list(range(1, count + 1))
            assert store.queue_load("r", [PoolPages(KV, keys, dest)])
            index = store.start_loads()
            landed = rows(dest)
            # SGLang's forward, on a stream of its own: it waits for the last layer through the counter, then reads
            # the pages there (in process on a GPU the stream waits for the copy; no thread waits for it)
            forward = torch.cuda.Stream() if device == "cuda" else None
            with torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
                counter.set_consumer(index)
                counter.wait_until(len(kv.layers) - 1)
                read = [_bits(b[landed]) for b in buffers]
            if forward is not None:
                forward.synchronize()
            assert counter.finish(index)
            for buffer, got, want, old in zip(buffers, read, expected, before, strict=True):
                assert torch.equal(got, want)
                untouched = torch.ones(buffer.shape[0], dtype=torch.bool, device=device)
                untouched[landed] = False
                assert torch.equal(_bits(buffer)[untouched], old[untouched])
        finally:
            store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_an_offload_stores_what_the_forward_stream_was_still_writing(mode: str) -> None:
    """SGLang's overlap scheduler offloads pages its forward stream may still be writing: the copies wait for that
    stream and the scheduler's (the linker's `_writers`), and neither stream is made to wait."""
    fixture = next(f for f in load_fixtures() if f["case"]["kind"] == "mha" and f["case"]["page_size"] == 16)
    pool = replay(fixture, "cuda")
    buffers, kv = _buffers(pool), device_kv(pool)
    page = kv.block_size
    source, dest, keys = [1, 2, 3], [4, 5, 6], [f"{i:064x}" for i in range(3)]
    rows = torch.tensor([p * page + t for p in source for t in range(page)], device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(3)
    written = [
        torch.randint(0, 256, _bits(b[rows]).shape, generator=generator, dtype=torch.uint8, device="cuda")
        for b in buffers
    ]
    page_bytes = sum(b[:page].numel() * b.element_size() for b in buffers)
    counter = LoadCounter(len(kv.layers))
    with settings_for(mode, "cuda", page, 8 * page_bytes + (8 << 20)) as settings:
        plans = [PoolPlan(kv_pool(kv), PageKeySpace("org/ordered", 1, 0))]
        store = open_linker_store(settings, plans, page, len(kv.layers), counter, name="ordered")
        forward = torch.cuda.Stream()
        try:
            warm = [f"{i:064x}" for i in range(10, 13)]  # a first offload loads the copy's kernels (untimed)
            store.offload([PoolPages(KV, warm, dest)], [torch.cuda.current_stream().cuda_stream])
            _ended(store)
            for buffer in buffers:  # and the writes' kernels
                buffer[rows] = buffer[rows]
            torch.cuda.synchronize()
            with torch.cuda.stream(forward):
                torch.cuda._sleep(800_000_000)  # ~0.4 s: the copies would run before the writes if not ordered
                for buffer, new in zip(buffers, written, strict=True):
                    buffer[rows] = new.view(buffer.dtype).view(buffer[rows].shape)
            store.offload([PoolPages(KV, keys, source)], [torch.cuda.current_stream().cuda_stream, forward.cuda_stream])
            torch.cuda.current_stream().synchronize()
            assert not forward.query()  # the scheduler's stream went on while the forward's still ran
            _ended(store)
            assert store.lookup("r", keys) == [1, 2, 3]
            assert store.queue_load("r", [PoolPages(KV, keys, dest)])
            index = store.start_loads()
            counter.set_consumer(index)
            counter.wait_until(len(kv.layers) - 1)
            torch.cuda.synchronize()
            assert counter.finish(index)
            landed = torch.tensor([p * page + t for p in dest for t in range(page)], device="cuda")
            for buffer, new in zip(buffers, written, strict=True):
                assert torch.equal(_bits(buffer[landed]), new)
        finally:
            store.close()


def _ended(store: Any) -> None:
    """Wait for the store's next offload to end; it stored its pages."""
    deadline = time.monotonic() + 60
    while store.completed_offloads() == 0:
        assert time.monotonic() < deadline, "the offload did not end"
        time.sleep(0.01)
    assert store.pop_offload()
