"""Hybrid models through a kvferry server, worker and scheduler halves over a real server (no vLLM engine needed).

A sliding-window group is looked up from its window on (a chunk before it that the server evicted costs no hit)
and the chunks a store supersedes are demoted on the server. A state-space hybrid's KV as vLLM's own code lays it
out (`vllm_hybrid_views`): its states registered once the server told its chunk size, stored and loaded by the
worker half, found by a scheduler half in another process, demoted on the server once superseded, and a state
the server evicted a shorter hit or a miss. Under tensor parallelism each rank stores its own shard of a state."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch

from kvferry.bench.vllm_views import case_of, replay
from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.connector.engine_kv import UnsupportedKVLayout
from kvferry.connector.hybrid_worker import HybridWorker, lookups_from_handshake, start_hybrid_worker
from kvferry.connector.kv_groups import NULL_BLOCK, GroupedLookups, KVGroup
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.state_groups import StateBackend, state_key_tokens
from kvferry.connector.worker_backend import StateViews
from kvferry.integrations.vllm.kv_layout import recognise
from kvferry.memory import HostPool
from kvferry.server import KvferryServer
from tests.integrations.vllm_hybrid_views import MAMBA_FIXTURES
from tests.server.serverkit import ServerProcess, wait_for

FIXTURE = json.loads(MAMBA_FIXTURES.read_text())[0]
CHUNK = 64  # the fixtures' block size: one block per chunk
MAMBA, FULL = (
    KVGroup(0, "mamba", CHUNK, tuple(FIXTURE["groups"][0]["layers"]), page_bytes=FIXTURE["groups"][0]["page_bytes"]),
    KVGroup(1, "full", CHUNK, tuple(FIXTURE["groups"][1]["layers"])),
)


@pytest.fixture
def server() -> Iterator[tuple[CacheEngine, str]]:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}})
    engine = CacheEngine(config, pool=HostPool(32 << 20, pin=False))
    served = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    served.start()
    yield engine, f"tcp://127.0.0.1:{served.port}"
    served.stop()
    engine.close()


def _worker(url: str, views: dict[str, torch.Tensor], tp: tuple[int, int] = (0, 1)) -> HybridWorker:
    heads = case_of(FIXTURE).kv_heads
    kvs = [
        StateViews([views[n] for n in MAMBA.layer_names], MAMBA.layer_names, MAMBA.page_bytes),
        recognise({n: views[n] for n in FULL.layer_names}, isa=None, kv_cache_dtype="auto", block_size=CHUNK, tp=tp,
                  model_kv_heads=heads * tp[1]),
    ]  # fmt: skip
    settings = ConnectorSettings(mode="server", server_url=url, timeout_s=10)
    return start_hybrid_worker(settings, kvs, [MAMBA, FULL], model="mamba-server", name="test", tp=tp)


def _store(worker: HybridWorker, tokens: list[int], full_blocks: list[int], states: dict[int, int]) -> None:
    """Store the full group's chunks of ``tokens`` and the states at the boundaries of ``states`` (boundary -> the
    block vLLM handed over for it)."""
    stores = [StoreSpec("a", tokens, full_blocks, 0, group=1)]
    stores += [StoreSpec("a", tokens[:end], [block], 0, group=0) for end, block in states.items()]
    worker.worker.start_stores(StepPlan(stores=stores))
    worker.worker.settle_windowed_stores()
    worker.worker.preempted(["a"])
    assert worker.worker.counters.store_failures == 0


def _hit(lookups: GroupedLookups, prompt: list[int]) -> int:
    found = lookups.lookup(prompt)
    assert found is not None
    lookups.free_lock(found.lock)
    return found.tokens


def _state_key(engine: CacheEngine, worker: HybridWorker, prefix: list[int]) -> bytes:
    states = worker.lookups.backends[0]
    assert isinstance(states, StateBackend) and isinstance(states.backend, ServerBackend)
    namespace = states.backend.key_space.namespace(CHUNK)
    return engine.chunk_keys(state_key_tokens(prefix, CHUNK), namespace=namespace)[0]


def _evict(engine: CacheEngine, key: bytes) -> None:
    with engine._res.lock:
        entry = engine._res.index.get(key)
        assert entry is not None
        engine._res.detach_locked(entry)


def _state_bytes(views: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    state = int(views[MAMBA.layer_names[0]].shape[3])
    return [views[name][block, 0, 0, :state].view(torch.uint8).clone() for name in MAMBA.layer_names]


BS, WINDOW = 16, 32
SLIDING = KVGroup(0, "sliding_window", BS, ("model.layers.0.attn",), WINDOW)
FULL_16 = KVGroup(1, "full", BS, ("model.layers.1.attn",))


def test_a_windowed_group_is_looked_up_from_its_window_and_demoted_on_the_server(
    server: tuple[CacheEngine, str],
) -> None:
    engine, url = server
    kvs = []
    for _ in (SLIDING, FULL_16):
        buf = torch.randn(2, 64, 2, BS, 128).to(torch.bfloat16)  # 2 layers of vLLM's CPU layout per group
        kvs.append(recognise({f"model.layers.{i}.attn": buf[i] for i in range(2)}, isa="vec", kv_cache_dtype="auto"))
    settings = ConnectorSettings(mode="server", server_url=url, timeout_s=10)
    hybrid = start_hybrid_worker(settings, kvs, [SLIDING, FULL_16], model="sliding-server", name="test")
    apart = lookups_from_handshake(ServerLink(url, timeout_s=10), hybrid.key_spaces, [SLIDING, FULL_16])
    try:
        apart.backends[0].link.connect()  # type: ignore[attr-defined]
        tokens = [random.Random(3).randrange(32_000) for _ in range(4 * CHUNK)]
        for end, skip in ((2 * CHUNK, 0), (4 * CHUNK, 2 * CHUNK)):  # a request's two steps
            stores = [StoreSpec("a", tokens[:end], list(range(1, end // BS + 1)), skip, group=0)]
            stores.append(StoreSpec("a", tokens[:end], list(range(1, end // BS + 1)), 0, group=1))
            hybrid.worker.start_stores(StepPlan(stores=stores))
            hybrid.worker.settle_windowed_stores()
        hybrid.worker.preempted(["a"])
        sliding = hybrid.lookups.backends[0].backend  # type: ignore[attr-defined]
        keys = engine.chunk_keys(tokens, namespace=sliding.key_space.namespace(CHUNK))

        def first_to_evict(n: int) -> set[bytes]:
            with engine._res.lock:
                return set(list(engine._res.policy._order)[:n])  # type: ignore[attr-defined]

        # The window at 4 chunks lies in chunk 3: chunks 0, 1, 2 go first (DEMOTE, after each store)
        wait_for(lambda: first_to_evict(3) == set(keys[:3]), "the DEMOTEs sent after the stores")
        for chunk in (0, 2):
            _evict(engine, keys[chunk])
        assert _hit(hybrid.lookups, tokens) == _hit(apart, tokens) == 4 * CHUNK  # the window only: chunk 3
        assert _hit(hybrid.lookups, tokens[: 3 * CHUNK]) == 2 * CHUNK  # the window at 3 chunks needs chunk 2
        assert engine.stats()["locks"] == 0
    finally:
        apart.close()
        hybrid.worker.close()
        hybrid.lookups.close()


def _state_round_trip(hybrid: HybridWorker, apart: GroupedLookups, views: dict[str, torch.Tensor]) -> list[int]:
    """Store states at 1 and 3 chunks, find the 3-chunk hit from both halves, load it; the prompt's tokens."""
    tokens = [random.Random(4).randrange(32_000) for _ in range(4 * CHUNK + 1)]
    _store(hybrid, tokens[: 4 * CHUNK], [1, 2, 3, 4], {CHUNK: 5, 3 * CHUNK: 7})  # no state at 2 or 4 chunks
    assert _hit(hybrid.lookups, tokens) == _hit(apart, tokens) == 3 * CHUNK
    stored = _state_bytes(views, 7)
    loads = [
        LoadSpec("b", tokens[: 3 * CHUNK], [10, 11, 12], 0, group=1),
        LoadSpec("b", tokens[: 3 * CHUNK], [NULL_BLOCK, NULL_BLOCK, 13], 2 * CHUNK, group=0),
    ]
    assert not torch.equal(_state_bytes(views, 13)[0], stored[0])  # random bytes until the load
    hybrid.worker.start_loads(StepPlan(loads=loads))
    wait_for(lambda: hybrid.worker.counters.tokens_loaded >= 3 * CHUNK, "the loads")
    assert hybrid.worker.take_load_errors() == set()
    if views[MAMBA.layer_names[0]].is_cuda:
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_state_bytes(views, 13), stored, strict=True))
    return tokens


def test_a_state_goes_through_the_server_and_a_scheduler_apart_finds_it(server: tuple[CacheEngine, str]) -> None:
    engine, url = server
    _, views = replay(FIXTURE, "cpu")
    hybrid = _worker(url, views)
    apart = lookups_from_handshake(ServerLink(url, timeout_s=10), hybrid.key_spaces, [MAMBA, FULL])
    try:
        assert apart.backends[0].chunk_size is None  # not connected yet: the chunk size comes from the server
        apart.backends[0].backend.link.connect()  # type: ignore[attr-defined]
        tokens = _state_round_trip(hybrid, apart, views)
        # A state the server evicted: the hit ends at the boundary before it, or misses
        _evict(engine, _state_key(engine, hybrid, tokens[: 3 * CHUNK]))
        assert _hit(hybrid.lookups, tokens) == _hit(apart, tokens) == CHUNK
        _evict(engine, _state_key(engine, hybrid, tokens[:CHUNK]))
        assert _hit(hybrid.lookups, tokens) == _hit(apart, tokens) == 0
        assert engine.stats()["locks"] == 0  # every lock a lookup took is freed with its hit
    finally:
        apart.close()
        hybrid.worker.close()
        hybrid.lookups.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_on_a_gpu_goes_through_a_server_by_cuda_ipc() -> None:
    process = ServerProcess("--chunk-size", str(CHUNK), "--l1-size-gb", "0.25")
    _, views = replay(FIXTURE, "cuda")
    hybrid = _worker(process.endpoint, views)
    apart = lookups_from_handshake(ServerLink(process.endpoint, timeout_s=10), hybrid.key_spaces, [MAMBA, FULL])
    try:
        apart.backends[0].backend.link.connect()  # type: ignore[attr-defined]
        _state_round_trip(hybrid, apart, views)
    finally:
        apart.close()
        hybrid.worker.close()
        hybrid.lookups.close()
        assert process.stop() == 0


def test_the_server_demotes_a_state_once_the_next_boundary_s_is_stored(server: tuple[CacheEngine, str]) -> None:
    engine, url = server
    _, views = replay(FIXTURE, "cpu")
    hybrid = _worker(url, views)
    try:
        tokens = [random.Random(6).randrange(32_000) for _ in range(3 * CHUNK + 1)]
        _store(hybrid, tokens[: 3 * CHUNK], [1, 2, 3], {CHUNK: 5})  # the attention chunks are the oldest
        later = StoreSpec("a", tokens[: 2 * CHUNK], [6], 0, group=0)  # a later step of the request
        hybrid.worker.start_stores(StepPlan(stores=[later]))
        hybrid.worker.settle_windowed_stores()
        hybrid.worker.preempted(["a"])
        superseded = _state_key(engine, hybrid, tokens[:CHUNK])

        def first_to_evict() -> bytes:
            with engine._res.lock:
                return next(iter(engine._res.policy._order))  # type: ignore[attr-defined]

        wait_for(lambda: first_to_evict() == superseded, "the DEMOTE sent after the store")
        assert _hit(hybrid.lookups, tokens[: CHUNK + 1]) == CHUNK  # demoted, not dropped
    finally:
        hybrid.worker.close()
        hybrid.lookups.close()


def test_each_tensor_parallel_rank_keeps_its_own_shard_of_a_state(server: tuple[CacheEngine, str]) -> None:
    engine, url = server
    shards = [replay(FIXTURE, "cpu")[1] for _ in range(2)]  # each rank's own (random) bytes
    ranks = [_worker(url, views, tp=(rank, 2)) for rank, views in enumerate(shards)]
    scheduler = lookups_from_handshake(ServerLink(url, timeout_s=10), ranks[0].key_spaces, [MAMBA, FULL])
    try:
        scheduler.backends[0].backend.backends[0].link.connect()  # type: ignore[attr-defined]
        assert isinstance(ranks[0].key_spaces[0], list) and len(ranks[0].key_spaces[0]) == 2  # every rank's state
        tokens = [random.Random(8).randrange(32_000) for _ in range(2 * CHUNK + 1)]
        _store(ranks[0], tokens[: 2 * CHUNK], [1, 2], {CHUNK: 5, 2 * CHUNK: 6})
        assert _hit(scheduler, tokens) == 0  # rank 1 stored neither its heads nor its states yet
        _store(ranks[1], tokens[: 2 * CHUNK], [1, 2], {CHUNK: 5, 2 * CHUNK: 6})
        assert _hit(scheduler, tokens) == 2 * CHUNK
        for rank, views in enumerate(shards):  # each rank loads its own shard of the state at 2 chunks
            stored = _state_bytes(views, 6)
            load = LoadSpec("b", tokens[: 2 * CHUNK], [NULL_BLOCK, 13], CHUNK, group=0)
            ranks[rank].worker.start_loads(
                StepPlan(loads=[load, LoadSpec("b", tokens[: 2 * CHUNK], [10, 11], 0, group=1)])
            )
            wait_for(lambda w=ranks[rank].worker: w.counters.tokens_loaded >= 2 * CHUNK, "the loads")
            assert ranks[rank].worker.take_load_errors() == set()
            assert all(torch.equal(a, b) for a, b in zip(_state_bytes(views, 13), stored, strict=True))
        assert not torch.equal(_state_bytes(shards[0], 6)[0], _state_bytes(shards[1], 6)[0])
        _evict(engine, _state_key(engine, ranks[1], tokens[: 2 * CHUNK]))  # rank 1's shard only
        assert _hit(scheduler, tokens) == CHUNK
    finally:
        scheduler.close()
        for hybrid in ranks:
            hybrid.worker.close()
            hybrid.lookups.close()


def test_a_server_chunk_size_whose_rows_do_not_fit_a_state_s_page_refuses_to_start() -> None:
    chunk = 512 * CHUNK  # 32768 rows of a 32768-byte page: no even row width fits
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": chunk}})
    engine = CacheEngine(config, pool=HostPool(1 << 20, pin=False))
    served = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    served.start()
    try:
        _, views = replay(FIXTURE, "cpu")
        with pytest.raises(UnsupportedKVLayout, match=f"does not fit {chunk} whole rows"):
            _worker(f"tcp://127.0.0.1:{served.port}", views)
    finally:
        served.stop()
        engine.close()
