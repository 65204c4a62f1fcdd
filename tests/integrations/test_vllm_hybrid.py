"""Hybrid models (vLLM's hybrid KV cache manager): groups read off vLLM's specs, each group's share of a plan, and
the bytes a hybrid hit loads, over a real cache engine (no vLLM engine needed)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.connector.backends import EmbeddedBackend, Hit
from kvferry.connector.kv_groups import GroupedLookups, KVGroup, UnsupportedGroups
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.window_groups import WindowedBackend
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm.kv_layout import recognise
from kvferry.integrations.vllm.scheduler_side import GroupedSchedulerSide, SchedulerSide
from kvferry.integrations.vllm.vllm_groups import groups_of

BS, CHUNK, WINDOW, NB = 16, 64, 32, 64
SLIDING = KVGroup(0, "sliding_window", BS, ("model.layers.0.attn",), WINDOW)
FULL = KVGroup(1, "full", BS, ("model.layers.1.attn",))


def test_groups_are_read_off_vllms_specs_and_mamba_is_refused() -> None:
    kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    specs = [
        kv_cache_interface.SlidingWindowSpec(**common, sliding_window=128),
        kv_cache_interface.FullAttentionSpec(**common),
        kv_cache_interface.ChunkedLocalAttentionSpec(**common, attention_chunk_size=256),
    ]
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=[f"l{i}"], kv_cache_spec=s) for i, s in enumerate(specs)]
    )
    groups = groups_of(config)
    assert [(g.kind, g.window) for g in groups] == [("sliding_window", 128), ("full", 0), ("chunked_local", 256)]
    assert len({g.tag for g in groups}) == 3  # each group its own key space
    assert groups[0].skipped_tokens(300) == 160  # 300 - 128 + 1 = 173, down to whole blocks
    assert groups[2].skipped_tokens(300) == 256 and groups[1].skipped_tokens(300) == 0
    mamba = kv_cache_interface.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    config.kv_cache_groups.append(SimpleNamespace(layer_names=["m"], kv_cache_spec=mamba))
    with pytest.raises(UnsupportedGroups, match="MambaSpec"):
        groups_of(config)


def _step(new: list[Any] = (), cached: list[tuple[str, Any, int]] = (), scheduled: dict[str, int] | None = None):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=set(),
            all_token_ids={},
            new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(),
    )


def _side(hit: int = 0) -> GroupedSchedulerSide:
    side = SchedulerSide(
        lambda tokens: Hit(hit, "lock"), lambda lock: None, block_size=BS, chunk_size=CHUNK, tails=False
    )
    return GroupedSchedulerSide(side, [SLIDING, FULL])


def test_a_windowed_group_stores_what_the_step_computed_and_never_a_freed_block() -> None:
    side = _side()
    prompt = list(range(300))
    tables = (list(range(1, 20)), list(range(21, 40)))
    new = SimpleNamespace(req_id="r", prompt_token_ids=prompt, block_ids=tables, num_computed_tokens=0)
    plan = side.build_plan(_step(new=[new], scheduled={"r": 120}))  # chunk 0 computed
    assert [(s.group, len(s.tokens), s.skip_tokens) for s in plan.stores] == [(0, 64, 0), (1, 64, 0)]
    assert plan.stores[0].block_ids == tables[0][:4] and plan.stores[1].block_ids == tables[1][:4]
    # Next step: vLLM freed the windowed blocks before token 120 - 32 + 1 = 89 (blocks 0..4): chunk 1 (64..128)
    # lost its first block there, so that group leaves it out (chunk 2 it stores); the full group stores both.
    plan = side.build_plan(_step(cached=[("r", None, 120)], scheduled={"r": 100}))
    assert [(s.group, len(s.tokens), s.skip_tokens) for s in plan.stores] == [(0, 192, 128), (1, 192, 64)]
    # Finished: its table as vLLM hands it over, freed windowed blocks null
    freed = ([0] * 14 + tables[0][14:], tables[1])
    assert side.request_finished("r", prompt[:299], freed)
    plan = side.build_plan(_step())
    assert [(s.group, len(s.tokens), s.skip_tokens) for s in plan.stores] == [(0, 256, 256), (1, 256, 192)]


def test_a_windowed_group_loads_only_the_blocks_vllm_allocated_in_its_window() -> None:
    side = _side(hit=256)
    prompt = list(range(300))
    assert side.num_new_matched_tokens("r", prompt, 300, 0) == (256, False)
    tables = ([0] * 13 + list(range(1, 7)), list(range(21, 40)))  # window at token 256: blocks 13.. (token 208..)
    side.after_alloc("r", prompt, tables, 256)
    new = SimpleNamespace(req_id="r", prompt_token_ids=prompt, block_ids=tables, num_computed_tokens=0)
    plan = side.build_plan(_step(new=[new], scheduled={"r": 44}))
    sliding, full = plan.loads
    assert (sliding.group, sliding.skip_tokens, sliding.block_ids[13:]) == (0, 13 * BS, [1, 2, 3])
    assert (full.group, full.skip_tokens, full.block_ids) == (1, 0, tables[1][:16])


@pytest.fixture
def hybrid() -> Iterator[tuple[GroupedLookups, WorkerSide, list[list[torch.Tensor]]]]:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.01}})
    engine = CacheEngine(config)
    made, layers = [], []
    for group in (SLIDING, FULL):
        buf = torch.randn(2, NB, 2, BS, 128).to(torch.bfloat16)  # 2 layers of vLLM's CPU layout per group
        kv = recognise({f"model.layers.{i}.attn": buf[i] for i in range(2)}, isa="vec", kv_cache_dtype="auto")
        ns = engine.namespace_for("tiny", kv.fmt, kv.layers, block_size=BS, group=group.tag)
        made.append(EmbeddedBackend(engine, kv, ns))
        layers.append(kv.layers)
    backends = [WindowedBackend(made[0], SLIDING), made[1]]
    worker = WorkerSide(backends, block_size=[BS, BS], counted_group=1, windowed_groups=[0])
    yield GroupedLookups(backends, [SLIDING, FULL]), worker, layers
    worker.close()
    engine.close()


def _store(worker: WorkerSide, tokens: list[int], ids: list[int], sliding_skip: int = 0) -> None:
    plan = StepPlan(
        stores=[StoreSpec("a", tokens, ids, sliding_skip, group=0), StoreSpec("a", tokens, ids, 0, group=1)]
    )
    worker.start_stores(plan)
    worker.settle_windowed_stores()
    worker.preempted(["a"])


def test_a_hybrid_hit_loads_each_groups_own_bytes(hybrid) -> None:
    lookups, worker, layers = hybrid
    tokens = [random.Random(1).randrange(32_000) for _ in range(4 * CHUNK)]
    src, dst = list(range(1, 17)), list(range(30, 46))
    _store(worker, tokens, src)
    assert worker.counters.tokens_stored == 4 * CHUNK  # counted once, not per group
    hit = lookups.lookup(tokens)
    assert hit is not None and hit.tokens == 4 * CHUNK
    lookups.free_lock(hit.lock)
    before = [[t.clone() for t in group] for group in layers]
    window = 14  # the windowed group's first block vLLM allocates for a hit at token 256
    worker.start_loads(
        StepPlan(loads=[LoadSpec("b", tokens, dst, window * BS, group=0), LoadSpec("b", tokens, dst, 0, group=1)])
    )
    assert worker.take_load_errors() == set()
    for group, first in ((0, window), (1, 0)):
        for layer, old in zip(layers[group], before[group], strict=True):
            assert torch.equal(layer[dst[first:]], old[src[first:]])  # each group's own bytes
            untouched = [b for b in range(NB) if b not in dst[first:]]
            assert torch.equal(layer[untouched], old[untouched])  # nothing before the window is written


def _sliding(lookups: GroupedLookups) -> EmbeddedBackend:
    sliding = lookups.backends[0]
    assert isinstance(sliding, WindowedBackend) and isinstance(sliding.backend, EmbeddedBackend)
    return sliding.backend


def test_a_windowed_chunk_evicted_or_never_written_is_a_shorter_hit(hybrid) -> None:
    lookups, worker, _ = hybrid
    rng = random.Random(2)
    tokens = [rng.randrange(32_000) for _ in range(4 * CHUNK)]
    _store(worker, tokens, list(range(1, 17)))
    sliding = _sliding(lookups)
    engine = sliding.engine

    def evict(chunk: int) -> None:  # the windowed group's chunk goes (eviction); the full group keeps all four
        with engine._res.lock:
            entry = engine._res.index.get(engine.chunk_keys(tokens, namespace=sliding.namespace)[chunk])
            assert entry is not None
            engine._res.detach_locked(entry)

    def hit_of(prompt: list[int]) -> int:
        hit = lookups.lookup(prompt)
        assert hit is not None
        lookups.free_lock(hit.lock)
        assert engine.stats()["locks"] == 0
        return hit.tokens

    evict(2)
    assert hit_of(tokens) == 4 * CHUNK  # a 4-chunk hit loads the 32-token window in chunk 3 only
    evict(3)
    assert hit_of(tokens) == 2 * CHUNK  # the window at 3 chunks needs chunk 2, the one at 2 chunks chunk 1
    other = [rng.randrange(32_000) for _ in range(4 * CHUNK)]
    _store(worker, other, list(range(20, 36)), sliding_skip=4 * CHUNK)  # the windowed group wrote nothing
    assert hit_of(other) == 0


def test_a_store_demotes_the_windowed_chunks_its_boundary_supersedes(hybrid) -> None:
    lookups, worker, _ = hybrid
    tokens = [random.Random(3).randrange(32_000) for _ in range(4 * CHUNK)]
    _store(worker, tokens[: 2 * CHUNK], list(range(1, 9)))
    _store(worker, tokens, list(range(1, 17)), sliding_skip=2 * CHUNK)  # the request's next step
    sliding = _sliding(lookups)
    res = sliding.engine._res
    keys = sliding.engine.chunk_keys(tokens, namespace=sliding.namespace)
    with res.lock:  # first in the eviction order: the windowed chunks before the window at 4 chunks (0, 1, 2)
        first = res.policy.evict(3, lambda key: True)
    assert set(first) == set(keys[:3])
    hit = lookups.lookup(tokens[: 2 * CHUNK])  # demoted, not dropped: a shorter prompt still hits them
    assert hit is not None and hit.tokens == 2 * CHUNK
    lookups.free_lock(hit.lock)


def test_superseded_windowed_chunks_are_demoted_once_the_request_s_stores_ended(hybrid) -> None:
    """Not as the windowed store ends: the request's own full-attention stores would then evict them first when
    the pool is short, and the request would be gone before it was reported stored."""
    lookups, worker, _ = hybrid
    tokens = [random.Random(4).randrange(32_000) for _ in range(4 * CHUNK)]
    for end in (2 * CHUNK, 4 * CHUNK):  # the request's two steps: each supersedes chunks (0; 1 and 2)
        ids = list(range(1, end // BS + 1))
        stores = [
            StoreSpec("a", tokens[:end], ids, end - 2 * CHUNK, group=0),
            StoreSpec("a", tokens[:end], ids, 0, group=1),
        ]
        worker.start_stores(StepPlan(stores=stores))
        worker.settle_windowed_stores()
    sliding = _sliding(lookups)
    res = sliding.engine._res
    keys = sliding.engine.chunk_keys(tokens, namespace=sliding.namespace)
    worker.drain()  # the full group's store too: every store ended, none reported yet
    with res.lock:
        order = [key for key in res.policy._order if key in keys]  # type: ignore[attr-defined]
    assert order == keys  # in the order stored: nothing demoted (a demotion puts 0-2 first, the last first)
    assert worker.finished_sending(["a"]) == {"a"}  # reported: the request's chunks 0-2 of the window go first
    with res.lock:
        assert set(res.policy.evict(3, lambda key: True)) == set(keys[:3])


def test_a_background_load_is_planned_per_group_and_reported_once_every_group_ran() -> None:
    side = SchedulerSide(
        lambda tokens: Hit(128, "lock"),
        lambda lock: None,
        block_size=BS,
        chunk_size=CHUNK,
        tails=False,
        in_background=True,
    )
    grouped = GroupedSchedulerSide(side, [SLIDING, FULL])
    prompt = list(range(200))
    assert grouped.num_new_matched_tokens("r", prompt, 200, 0) == (128, True)
    tables = ([0] * 6 + [7, 8], list(range(21, 29)))  # the window at token 128: blocks 6, 7
    grouped.after_alloc("r", prompt, tables, 128)
    sliding, full = grouped.build_plan(_step()).loads  # the request waits for it: not in the step
    assert (sliding.in_background, sliding.skip_tokens, sliding.block_ids[6:]) == (True, 6 * BS, [7, 8])
    assert (full.skip_tokens, full.block_ids) == (0, tables[1])

    done = {0: Future(), 1: Future()}
    backends = [SimpleNamespace(retrieve_async=lambda *args, g=g: done[g]) for g in (0, 1)]
    worker = WorkerSide(backends, block_size=[BS, BS], counted_group=1, windowed_groups=[0])
    worker.start_loads(StepPlan(loads=[sliding, full]))
    done[1].set_result(128)
    assert worker.finished_loading() == set()  # the sliding group's load still runs
    done[0].set_result(128)  # what the blocks hold now, the skipped prefix included
    assert worker.finished_loading() == {"r"}
    assert worker.take_load_report() == ({"r"}, set()) and worker.take_load_errors() == set()
    assert worker.counters.tokens_loaded == 128  # the full group's tokens, once


def test_a_hybrid_scheduler_refuses_a_side_that_stores_tails() -> None:
    side = SchedulerSide(lambda tokens: Hit(0), lambda lock: None, block_size=BS, chunk_size=CHUNK)
    with pytest.raises(ValueError, match="whole chunks only"):
        GroupedSchedulerSide(side, [SLIDING, FULL])


def test_demoting_superseded_window_chunks_keeps_more_hits_in_a_small_pool() -> None:
    """`kvferry.bench.hybrid_eviction` on a small traffic: round-robin conversations in a pool of 70% of what they
    store hit every earlier turn with the demotion, and lose some without it."""
    from kvferry.bench.hybrid_eviction import OBJECT_BYTES, Traffic, run_traffic

    traffic = Traffic(conversations=8, turns=4, turn_chunks=2, window=64)
    pool = int(traffic.stored_objects * 0.7) * OBJECT_BYTES
    plain, asked = run_traffic(traffic, pool, demote=False)
    demoted, _ = run_traffic(traffic, pool, demote=True)
    most = sum(2 * (t - 1) * CHUNK for t in range(2, 5)) * traffic.conversations  # all but each turn's new chunks
    assert demoted == most and plain < most and asked == sum(2 * t * CHUNK for t in range(2, 5)) * 8
