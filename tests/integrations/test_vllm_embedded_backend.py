"""The worker half over a real cache engine and KV tensors shaped like vLLM's CPU backend (no vLLM needed)."""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.connector.backends import EmbeddedBackend, Hit
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm.kv_layout import recognise

BS, CHUNK, NB = 32, 128, 24


@pytest.fixture
def setup() -> tuple[EmbeddedBackend, WorkerSide, list[torch.Tensor], list[list[int]]]:
    buf = torch.randn(3, NB, 2, BS, 128).to(torch.bfloat16)  # 3 layers of [NB, NH=2, BS, 2*HS=128], one buffer
    kv = recognise({f"model.layers.{i}.attn": buf[i] for i in range(3)}, isa="vec", kv_cache_dtype="auto")
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.01}})
    engine = CacheEngine(config)
    namespace = engine.namespace_for("tiny", kv.fmt, kv.layers, block_size=kv.block_size)
    backend = EmbeddedBackend(engine, kv, namespace)
    loaded: list[list[int]] = []
    worker = WorkerSide(backend, block_size=BS, after_load=loaded.append)
    yield backend, worker, kv.layers, loaded
    worker.close()
    backend.close()


def test_store_then_load_into_other_blocks_skipping_vllms_prefix(setup) -> None:
    backend, worker, layers, loaded = setup
    rng = random.Random(1)
    tokens = [rng.randrange(32_000) for _ in range(300)]
    src, dst = [3, 9, 1, 14, 7, 20, 11, 5], [2, 17, 8, 23, 12, 4, 19, 6]
    assert backend.lookup(tokens) == Hit(0)
    worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens[:256], src, skip_tokens=0)]))
    worker.preempted(["a"])
    assert worker.counters.tokens_stored == 256
    hit = backend.lookup(tokens)
    assert hit is not None and hit.tokens == 256 and backend.engine.stats()["locks"] == 1
    backend.free_lock(hit.lock)
    assert backend.engine.stats()["locks"] == 0
    assert backend.lookup(tokens[:100] + tokens[101:]) == Hit(0)  # a different prefix shares nothing

    before = [layer.clone() for layer in layers]
    worker.start_loads(StepPlan(loads=[LoadSpec("b", tokens[:256], dst, skip_tokens=64)]))
    assert worker.take_load_errors() == set()
    assert loaded == [dst[2:]]
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[dst[2:]], old[src[2:]])  # the same bytes, block for block
        untouched = [b for b in range(NB) if b not in dst[2:]]
        assert torch.equal(layer[untouched], old[untouched])  # vLLM's two prefix blocks and everything else


def test_evicted_objects_turn_into_load_errors(setup) -> None:
    backend, worker, _, _ = setup
    rng = random.Random(2)
    tokens = [rng.randrange(32_000) for _ in range(256)]
    ids = [3, 9, 1, 14, 7, 20, 11, 5]
    worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens, ids, skip_tokens=0)]))
    worker.preempted(["a"])
    backend.engine.clear()  # evicted between the scheduler's lookup and the worker's load
    worker.start_loads(StepPlan(loads=[LoadSpec("b", tokens, ids, skip_tokens=32)]))
    assert worker.take_load_errors() == set(ids[1:])
