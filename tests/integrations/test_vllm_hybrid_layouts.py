"""A hybrid model's KV as vLLM's own code lays it out for its GPU backends (its hybrid KV cache manager: a
sliding-window and a full-attention group whose layers share vLLM's tensors), stored and loaded through the
connector's hybrid worker side on CPU tensors, in every physical order vLLM builds."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvferry.integrations.vllm.hybrid_worker import start_hybrid_worker
from kvferry.integrations.vllm.kv_groups import KVGroup
from kvferry.integrations.vllm.kv_layout import recognise
from kvferry.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.integrations.vllm.settings import ConnectorSettings

pytest.importorskip("vllm")

BS, WINDOW, CHUNK = 16, 32, 64
LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def hybrid_views(layout: str) -> tuple[list[KVGroup], dict[str, torch.Tensor]]:
    """vLLM's per-layer views of a 4-layer model (layers 0, 2 sliding over WINDOW tokens; 1, 3 full), FlashAttention's
    spec, as its GPU model runner allocates them."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec

    from tests.integrations.vllm_page_views import backend_class

    backend = backend_class("FLASH_ATTN")
    common = {"block_size": BS, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    sliding = customize_attention_spec(backend, SlidingWindowSpec(**common, sliding_window=WINDOW))
    full = customize_attention_spec(backend, FullAttentionSpec(**common))
    specs = [KVCacheGroupSpec(names[0::2], sliding), KVCacheGroupSpec(names[1::2], full)]
    cache_config = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout],
        num_gpu_blocks_override=48,
        prefix_cache_retention_interval=None,
    )
    vllm_config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    config = get_kv_cache_config_from_groups(vllm_config, specs, available_memory=1 << 40)  # type: ignore[arg-type]
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], [BS, BS])
    groups = [
        KVGroup(0, "sliding_window", BS, tuple(names[0::2]), WINDOW),
        KVGroup(1, "full", BS, tuple(names[1::2])),
    ]
    return groups, views


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_group_moves_its_own_blocks_and_nothing_else(layout: str) -> None:
    groups, views = hybrid_views(layout)
    for view in views.values():  # random bytes everywhere (the groups' layers share vLLM's tensors)
        view.view(torch.uint8).copy_(torch.randint(0, 256, view.view(torch.uint8).shape, dtype=torch.uint8))
    kvs = [
        recognise({n: views[n] for n in g.layer_names}, isa=None, kv_cache_dtype="auto", block_size=BS) for g in groups
    ]
    settings = ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.01}})
    hybrid = start_hybrid_worker(settings, kvs, groups, model="tiny-hybrid", name="test")
    try:
        tokens = [random.Random(3).randrange(32_000) for _ in range(2 * CHUNK)]
        # vLLM's block pool is shared by the groups: each request's blocks in each group are distinct ids
        sources, targets = (list(range(1, 9)), list(range(9, 17))), (list(range(20, 28)), list(range(30, 38)))
        stores = [StoreSpec("a", tokens, sources[g.index], 0, group=g.index) for g in groups]
        hybrid.worker.start_stores(StepPlan(stores=stores))
        hybrid.worker.settle_windowed_stores()
        hybrid.worker.preempted(["a"])
        hit = hybrid.lookups.lookup(tokens)
        assert hit is not None and hit.tokens == 2 * CHUNK
        hybrid.lookups.free_lock(hit.lock)
        views = {name: view.view(torch.uint8) for name, view in views.items()}  # random bytes hold NaNs
        before = {name: view.clone() for name, view in views.items()}
        window_start = (2 * CHUNK - WINDOW) // BS  # the blocks vLLM allocates for the sliding group's window
        loads = [
            LoadSpec("b", tokens, targets[0], window_start * BS, group=0),
            LoadSpec("b", tokens, targets[1], 0, group=1),
        ]
        hybrid.worker.start_loads(StepPlan(loads=loads))
        assert hybrid.worker.take_load_errors() == set()
        written = targets[0][window_start:] + targets[1]
        for group, first in ((groups[0], window_start), (groups[1], 0)):
            for name in group.layer_names:
                assert torch.equal(
                    views[name][targets[group.index][first:]], before[name][sources[group.index][first:]]
                )
        for name, view in views.items():  # every other block of every layer, both groups', as it was
            untouched = [b for b in range(view.shape[0]) if b not in written]
            assert torch.equal(view[untouched], before[name][untouched])
    finally:
        hybrid.worker.close()
        hybrid.lookups.close()
