"""The scheduler half of the vLLM connector, driven with hand-made scheduler outputs (no vLLM needed)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvferry.integrations.vllm.plan import LoadSpec, StoreSpec
from kvferry.integrations.vllm.scheduler_side import SchedulerSide

BS = 32
CHUNK = 128


@dataclass
class NewReq:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Step:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] | None = None


class FakeCache:
    def __init__(self, hit: int | None = 0) -> None:
        self.hit = hit
        self.calls: list[list[int]] = []

    def __call__(self, tokens: list[int]) -> int | None:
        self.calls.append(tokens)
        return self.hit


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def blocks(n: int, start: int = 100) -> list[int]:
    return list(range(start + n - 1, start - 1, -1))  # descending: order must be kept, not sorted


def test_miss_then_store_full_chunks_only() -> None:
    cache = FakeCache(hit=0)
    side = SchedulerSide(cache, block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("a", toks, len(toks), 0) == 0
    side.after_alloc("a", toks, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 0)], num_scheduled_tokens={"a": 300}))
    assert plan.loads == []
    assert plan.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=0)]
    assert side.request_finished("a") is True
    assert list(side.tracked_requests()) == []


def test_chunked_prefill_stores_each_chunk_once_after_it_is_computed() -> None:
    side = SchedulerSide(FakeCache(0), block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    side.num_new_matched_tokens("a", toks, 300, 0)
    first = side.build_plan(Step([NewReq("a", toks, (ids[:4],), 0)], num_scheduled_tokens={"a": 100}))
    assert first.stores == []  # 100 tokens computed: no whole chunk yet
    cached = Cached(["a"], set(), [(ids[4:8],)], [100])
    second = side.build_plan(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 150}))
    assert second.stores == [StoreSpec("a", toks[:128], ids[:4], skip_tokens=0)]
    cached = Cached(["a"], set(), [(ids[8:10],)], [250])
    third = side.build_plan(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 50}))
    assert third.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=128)]
    decode = side.build_plan(
        Step(scheduled_cached_reqs=Cached(["a"], set(), [None], [300]), num_scheduled_tokens={"a": 1})
    )
    assert decode.is_empty()


def test_hit_is_loaded_and_not_stored_again() -> None:
    cache = FakeCache(hit=256)
    side = SchedulerSide(cache, block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("a", toks, 300, 0) == 256
    assert cache.calls == [toks]
    side.after_alloc("a", toks, 256)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    assert plan.loads == [LoadSpec("a", toks[:256], ids[:8], skip_tokens=0)]
    assert plan.stores == []
    assert side.request_finished("a") is False  # nothing stored: vLLM may free the blocks at once


def test_full_prompt_hit_leaves_one_token_to_compute_but_loads_every_block() -> None:
    side = SchedulerSide(FakeCache(hit=256), block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(256), blocks(8)
    assert side.num_new_matched_tokens("a", toks, 256, 0) == 255
    side.after_alloc("a", toks, 255)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 255)], num_scheduled_tokens={"a": 1}))
    assert plan.loads == [LoadSpec("a", toks, ids, skip_tokens=0)]
    assert plan.stores == []


def test_vllm_prefix_hit_is_skipped_by_the_load() -> None:
    side = SchedulerSide(FakeCache(hit=256), block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("a", toks, 300, 64) == 192
    side.after_alloc("a", toks, 192)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    assert plan.loads == [LoadSpec("a", toks[:256], ids[:8], skip_tokens=64)]


def test_vllm_prefix_hit_longer_than_ours_loads_nothing_and_stores_only_new_chunks() -> None:
    side = SchedulerSide(FakeCache(hit=128), block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("a", toks, 300, 160) == 0
    side.after_alloc("a", toks, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 160)], num_scheduled_tokens={"a": 140}))
    assert plan.loads == []
    assert plan.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=128)]


def test_unknown_hit_and_short_prompts() -> None:
    cache = FakeCache(hit=None)
    side = SchedulerSide(cache, block_size=BS, chunk_size=CHUNK)
    assert side.num_new_matched_tokens("a", prompt(300), 300, 0) is None  # vLLM asks again later
    assert side.num_new_matched_tokens("b", prompt(127), 127, 0) == 0
    assert len(cache.calls) == 1  # a prompt shorter than a chunk never costs a lookup


def test_a_hit_past_the_prompt_is_clipped_to_whole_prompt_chunks() -> None:
    side = SchedulerSide(FakeCache(hit=1024), block_size=BS, chunk_size=CHUNK)
    assert side.num_new_matched_tokens("a", prompt(300), 300, 0) == 256


def test_preempted_request_gets_its_new_block_table_and_loads_again() -> None:
    side = SchedulerSide(FakeCache(hit=0), block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    side.num_new_matched_tokens("a", toks, 300, 0)
    side.build_plan(Step([NewReq("a", toks, (ids,), 0)], num_scheduled_tokens={"a": 300}))
    preempt = side.build_plan(Step(preempted_req_ids={"a"}))
    assert preempt.preempted == ["a"]
    # resumed: the cache now holds the first two chunks; vLLM gives the request a new block table
    side._lookup = FakeCache(hit=256)  # the cache filled up meanwhile
    assert side.num_new_matched_tokens("a", toks, 301, 0) == 256
    side.after_alloc("a", toks, 256)
    new_ids = blocks(10, start=500)
    cached = Cached(["a"], {"a"}, [(new_ids,)], [256])
    plan = side.build_plan(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 45}))
    assert plan.loads == [LoadSpec("a", toks[:256], new_ids[:8], skip_tokens=0)]
    assert plan.stores == []
    assert side.request_finished("a") is True  # its first run stored chunks


def test_bad_geometry_and_broken_promises_raise() -> None:
    with pytest.raises(ValueError, match="chunk_size=100 must be a positive multiple"):
        SchedulerSide(FakeCache(), block_size=BS, chunk_size=100)
    side = SchedulerSide(FakeCache(hit=0), block_size=BS, chunk_size=CHUNK)
    with pytest.raises(RuntimeError, match="accepted 128 external tokens"):
        side.after_alloc("never-looked-up", prompt(300), 128)
    toks = prompt(300)
    side._lookup = FakeCache(hit=256)
    side.num_new_matched_tokens("a", toks, 300, 0)
    side.after_alloc("a", toks, 256)
    with pytest.raises(RuntimeError, match="holds 2 blocks, 256 tokens need 8"):
        side.build_plan(Step([NewReq("a", toks, (blocks(2),), 256)], num_scheduled_tokens={"a": 44}))


def test_uncacheable_requests_are_neither_looked_up_nor_stored() -> None:
    cache = FakeCache(hit=256)
    side = SchedulerSide(cache, block_size=BS, chunk_size=CHUNK)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("img", toks, 300, 0, cacheable=False) == 0
    assert cache.calls == []
    side.after_alloc("img", toks, 0)
    plan = side.build_plan(Step([NewReq("img", toks, (ids,), 0)], num_scheduled_tokens={"img": 300}))
    assert plan.is_empty()
    assert side.request_finished("img") is False


def test_a_short_block_table_skips_the_store_instead_of_failing(caplog: pytest.LogCaptureFixture) -> None:
    side = SchedulerSide(FakeCache(hit=0), block_size=BS, chunk_size=CHUNK)
    toks = prompt(300)
    side.num_new_matched_tokens("a", toks, 300, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (blocks(3),), 0)], num_scheduled_tokens={"a": 300}))
    assert plan.stores == []
    assert "holds too few blocks for 256 tokens" in caplog.text
    assert side.request_finished("a") is False
