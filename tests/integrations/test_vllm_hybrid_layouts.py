"""A hybrid model's KV as vLLM's own code lays it out for its GPU backends (its hybrid KV cache manager: a
sliding-window and a full-attention group whose layers share vLLM's tensors, in every physical order), stored
and loaded through the connector's hybrid worker side, from recorded fixtures (`vllm_hybrid_views`) that the first
test checks against vLLM: on CPU tensors here, and on a CUDA device where there is one (no vLLM needed there)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvferry.bench.vllm_views import case_of, replay
from kvferry.connector.hybrid_worker import start_hybrid_worker
from kvferry.connector.kv_groups import KVGroup
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.vllm.kv_layout import recognise
from tests.integrations.vllm_hybrid_views import (
    CASES,
    HYBRID_FIXTURES,
    REPLAY_DEVICES,
    assert_recorded_as_vllm_builds,
    build,
    recorded,
)

FIXTURES = recorded(HYBRID_FIXTURES)
CHUNK = 64


def test_fixtures_are_what_vllm_builds() -> None:
    assert_recorded_as_vllm_builds(FIXTURES, build, CASES)


@pytest.mark.parametrize("device", REPLAY_DEVICES)
@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: case_of(f).layout)
def test_each_group_moves_its_own_blocks_and_nothing_else(fixture: dict[str, Any], device: str) -> None:
    case = case_of(fixture)
    _, views = replay(fixture, device)  # random bytes everywhere (the groups' layers share vLLM's tensors)
    groups = [
        KVGroup(i, g["kind"], case.block_size, tuple(g["layers"]), g["window"]) for i, g in enumerate(fixture["groups"])
    ]
    kvs = [
        recognise({n: views[n] for n in g.layer_names}, isa=None, kv_cache_dtype="auto", block_size=case.block_size)
        for g in groups
    ]
    settings = ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.01}})
    hybrid = start_hybrid_worker(settings, kvs, groups, model=f"hybrid-{case.name}", name="test")
    try:
        tokens = [random.Random(3).randrange(32_000) for _ in range(2 * CHUNK)]
        # vLLM's block pool is shared by the groups: a request's blocks in each group are distinct ids
        sources, targets = (list(range(1, 9)), list(range(9, 17))), (list(range(20, 28)), list(range(30, 38)))
        stores = [StoreSpec("a", tokens, sources[g.index], 0, group=g.index) for g in groups]
        hybrid.worker.start_stores(StepPlan(stores=stores))
        hybrid.worker.settle_windowed_stores()
        hybrid.worker.preempted(["a"])
        hit = hybrid.lookups.lookup(tokens)
        assert hit is not None and hit.tokens == 2 * CHUNK
        hybrid.lookups.free_lock(hit.lock)
        as_bytes = {name: view.view(torch.uint8) for name, view in views.items()}  # random bytes hold NaNs
        before = {name: view.clone() for name, view in as_bytes.items()}
        window_start = (2 * CHUNK - groups[0].window) // case.block_size  # the sliding group's allocated blocks
        loads = [
            LoadSpec("b", tokens, targets[0], window_start * case.block_size, group=0),
            LoadSpec("b", tokens, targets[1], 0, group=1),
        ]
        hybrid.worker.start_loads(StepPlan(loads=loads))
        assert hybrid.worker.take_load_errors() == set()
        if device == "cuda":
            torch.cuda.synchronize()
        written = targets[0][window_start:] + targets[1]
        for group, first in ((groups[0], window_start), (groups[1], 0)):
            dst, src = targets[group.index][first:], sources[group.index][first:]
            for name in group.layer_names:
                assert torch.equal(as_bytes[name][dst], before[name][src])
        for name, view in as_bytes.items():  # every other block of every layer, both groups', as it was
            untouched = [b for b in range(view.shape[0]) if b not in written]
            assert torch.equal(view[untouched], before[name][untouched])
    finally:
        hybrid.worker.close()
        hybrid.lookups.close()
