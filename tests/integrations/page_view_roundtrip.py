"""A prefix stored through the connector's worker side from one engine's blocks and loaded into another engine's,
over KV in vLLM's recorded page views (`kvferry.bench.vllm_views`), on any device and in either mode."""

from __future__ import annotations

import random
from typing import Any

import torch

from kvferry.bench.vllm_views import Case, case_of, replay
from kvferry.connector.backends import EmbeddedBackend
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import make_worker_backend
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm.kv_layout import recognise


def recognised(case: Case, views: dict[str, torch.Tensor]) -> EngineKV:
    """What the connector's ``register_kv_caches`` recognises in ``views`` for an engine configured as ``case``."""
    return recognise(
        views,
        isa=None,
        kv_cache_dtype=case.cache_dtype,
        tp=case.tp,
        model_kv_heads=case.model_kv_heads,
        mla=case.mla,
        block_size=case.block_size,
    )


def embedded_settings(case: Case) -> ConnectorSettings:
    config = {"cache": {"chunk_size": 2 * case.block_size, "l1_size_gb": 0.02}, "tiers": []}
    return ConnectorSettings(mode="embedded", config=config)


def kernel_index(kv: EngineKV, block_ids: list[int]) -> torch.Tensor:
    return torch.as_tensor(list(kv.kernel_block_ids(block_ids)), device=kv.layers[0].device)


def gathered(kv: EngineKV, block_ids: list[int]) -> list[torch.Tensor]:
    """A plain torch gather of every layer's blocks (the kernel blocks of the scheduler's ``block_ids``), as bytes."""
    index = kernel_index(kv, block_ids)
    return [layer.index_select(0, index).view(torch.uint8) for layer in kv.layers]


def two_workers(
    case: Case, fixture: dict[str, Any], device: str, settings: ConnectorSettings, model: str | None = None
) -> tuple[tuple[EngineKV, WorkerSide], tuple[EngineKV, WorkerSide], list[Any]]:
    """Two engines' KV (each a fresh replay of ``fixture``, random bytes) and their worker sides, sharing one cache
    (key space: ``model``, else the case's name): in embedded mode the second backend uses the first's cache
    engine, in server mode both register with the server. The last item is what to close."""
    kv_a = recognised(case, replay(fixture, device)[1])
    kv_b = recognised(case, replay(fixture, device)[1])
    model = model or case.name
    make = lambda kv: make_worker_backend(settings, kv, model=model, block_size=case.block_size, name="test")  # noqa: E731
    backend_a = make(kv_a)
    if isinstance(backend_a, EmbeddedBackend):
        backend_b: Any = EmbeddedBackend(backend_a.engine, kv_b, backend_a.namespace)
        owned = [backend_a]
    else:
        backend_b = make(kv_b)
        owned = [backend_a, backend_b]
    worker_a = WorkerSide(backend_a, block_size=case.block_size)
    worker_b = WorkerSide(backend_b, block_size=case.block_size)
    return (kv_a, worker_a), (kv_b, worker_b), [worker_a, worker_b, *owned]


def check_roundtrip(fixture: dict[str, Any], device: str, settings: ConnectorSettings | None = None) -> None:
    """Store two chunks and a one-block tail object (kvferry.cache.tails) from random blocks of engine A, load them
    into random blocks of engine B but for vLLM's own first block: B's loaded blocks equal A's, byte for byte, and
    every other byte of B is as it was."""
    case = case_of(fixture)
    rng = random.Random(case.name)
    blocks, bs = case.num_blocks, case.block_size
    tokens = [rng.randrange(50_000) for _ in range(5 * bs + 5)]  # two chunks, a whole block and 5 tokens more
    src, dst = rng.sample(range(blocks), 6), rng.sample(range(blocks), 6)
    (kv_a, worker_a), (kv_b, worker_b), owned = two_workers(case, fixture, device, settings or embedded_settings(case))
    try:
        worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, skip_tokens=0)]))
        worker_a.preempted(["a"])  # waits for the stores
        assert worker_a.counters.tokens_stored == 5 * bs, worker_a.counters  # the chunks and a tail of one block
        expected = gathered(kv_a, src)
        before = [layer.view(torch.uint8).clone() for layer in kv_b.layers]
        worker_b.start_loads(StepPlan(loads=[LoadSpec("b", tokens[: 5 * bs], dst[:5], skip_tokens=bs)]))
        assert worker_b.take_load_errors() == set()
        assert worker_b.counters.tokens_loaded == 4 * bs
        for got, want in zip(gathered(kv_b, dst[1:5]), expected, strict=True):
            assert torch.equal(got, want[kv_a.split : 5 * kv_a.split])
        untouched = [b for b in range(blocks) if b not in dst[1:5]]
        for got, old in zip(gathered(kv_b, untouched), before, strict=True):
            assert torch.equal(got, old.index_select(0, kernel_index(kv_b, untouched)))
    finally:
        for thing in owned:
            thing.close()
