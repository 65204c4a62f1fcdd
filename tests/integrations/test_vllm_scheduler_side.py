"""The scheduler half of the vLLM connector, driven with hand-made scheduler outputs (no vLLM needed)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvferry.client.records import LocateResult
from kvferry.connector.backends import Hit
from kvferry.connector.plan import LoadSpec, StoreSpec
from kvferry.integrations.vllm.scheduler_side import SchedulerSide
from kvferry.integrations.vllm.vllm_versions import VllmFacts

BS = 32
CHUNK = 128
VLLM_032 = VllmFacts("0.32.0", resumed_among_cached=True)  # the scheduler outputs below are 0.32's


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
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Step:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] | None = None


class FakeCache:
    """Answers ``hit`` (None: "not known yet") and locks every hit; ``held`` are the locks not freed yet.
    ``located``: each hit is located too (a server's for direct loads), under its lock."""

    def __init__(self, hit: int | None = 0, located: bool = False) -> None:
        self.hit = hit
        self.located = located
        self.calls: list[list[int]] = []
        self.held: set[int] = set()
        self._next_lock = 0

    def lookup(self, tokens: list[int]) -> Hit | None:
        self.calls.append(tokens)
        if self.hit is None:
            return None
        if not self.hit:
            return Hit(0)
        self._next_lock += 1
        self.held.add(self._next_lock)
        objects = [(i * 4096, min(CHUNK, self.hit - i * CHUNK)) for i in range(-(-self.hit // CHUNK))]
        located = LocateResult(self.hit, self._next_lock, 1e9, objects, (1, 2, 3)) if self.located else None
        return Hit(self.hit, self._next_lock, located)

    def free_lock(self, lock: int) -> None:
        self.held.remove(lock)  # KeyError on a double free


def make_side(cache: FakeCache, **kwargs: object) -> SchedulerSide:
    return SchedulerSide(cache.lookup, cache.free_lock, block_size=BS, chunk_size=CHUNK, vllm=VLLM_032, **kwargs)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def blocks(n: int, start: int = 100) -> list[int]:
    return list(range(start + n - 1, start - 1, -1))  # descending: order must be kept, not sorted


def matched(side: SchedulerSide, req_id: str, toks: list[int], num_tokens: int, computed: int) -> int | None:
    count, in_background = side.num_new_matched_tokens(req_id, toks, num_tokens, computed)
    assert in_background == (side.in_background and bool(count))
    return count


def test_miss_then_store_full_chunks_only() -> None:
    cache = FakeCache(hit=0)
    side = make_side(cache)
    toks, ids = prompt(300), blocks(10)
    assert matched(side, "a", toks, len(toks), 0) == 0
    side.after_alloc("a", toks, ids, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 0)], num_scheduled_tokens={"a": 300}))
    assert plan.loads == []
    assert plan.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=0)]
    assert side.request_finished("a") is True
    assert list(side.tracked_requests()) == []
    assert side.counters.lookup_requests == 1 and side.counters.lookup_hit_tokens == 0


def test_chunked_prefill_stores_each_chunk_once_after_it_is_computed() -> None:
    side = make_side(FakeCache(0))
    toks, ids = prompt(300), blocks(10)
    matched(side, "a", toks, 300, 0)
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


def test_hit_is_loaded_and_not_stored_again_and_its_lock_goes_when_the_load_ran() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache)
    toks, ids = prompt(300), blocks(10)
    assert matched(side, "a", toks, 300, 0) == 256
    assert [list(c) for c in cache.calls] == [toks] and len(cache.held) == 1  # the hit is pinned from the lookup on
    side.after_alloc("a", toks, ids, 256)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    assert plan.loads == [LoadSpec("a", toks[:256], ids[:8], skip_tokens=0)]
    assert np.shares_memory(plan.loads[0].tokens, cache.calls[0])  # the prompt converted once, for the lookup
    assert plan.stores == []
    assert cache.held  # still pinned: the worker has not run the load yet
    side.loads_done({"a"})
    assert not cache.held
    assert side.request_finished("a") is False  # nothing stored: vLLM may free the blocks at once
    assert side.counters.lookup_hit_tokens == 256 and side.counters.hit_tokens_taken == 256


@pytest.mark.parametrize("in_background", [False, True])
def test_a_located_hit_goes_to_its_load_and_not_past_a_clipped_hit_or_its_lock(in_background: bool) -> None:
    """The worker copies a located hit without locating it again, under the scheduler's lock: the load carries
    the located objects only where it loads them all, and only while that lock is held."""
    cache = FakeCache(hit=256, located=True)
    side = make_side(cache, in_background=in_background)
    toks, ids = prompt(300), blocks(10)
    assert matched(side, "a", toks, 300, 0) == 256
    side.after_alloc("a", toks, ids, 256)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    (load,) = plan.loads
    assert load.located is not None and load.located.lease in cache.held and load.located.tokens == 256
    side.build_plan(Step(preempted_req_ids={"a"}))  # preempted before the workers reported the load
    assert side.request_finished("a") is False
    assert cache.held == {load.located.lease}  # the copy may still run: its lease stays until the report
    side.loads_done({"a"})
    assert not cache.held and list(side.tracked_requests()) == []
    clipped = FakeCache(hit=512, located=True)  # past the prompt: the load covers less than was located
    side = make_side(clipped, in_background=in_background)
    assert matched(side, "b", toks, 300, 0) == 288
    side.after_alloc("b", toks, ids, 288)
    plan = side.build_plan(Step([NewReq("b", toks, (ids,), 288)], num_scheduled_tokens={"b": 12}))
    assert [load.located for load in plan.loads] == [None] and len(clipped.held) == 1
    untaken = FakeCache(hit=256, located=True)
    side = make_side(untaken, in_background=in_background)
    assert matched(side, "c", toks, 300, 0) == 256
    side.after_alloc("c", toks, ids, 0)  # not taken: the lock goes, and with it what it located
    assert not untaken.held
    plan = side.build_plan(Step([NewReq("c", toks, (ids,), 0)], num_scheduled_tokens={"c": 300}))
    assert plan.loads == []


def test_vllm_asking_again_reuses_the_lookup_until_it_is_stale() -> None:
    cache, now = FakeCache(hit=256), [0.0]
    side = make_side(cache, refresh_s=10.0, clock=lambda: now[0])
    toks = prompt(300)
    for computed in (0, 0, 32, 0):  # a request that cannot be scheduled yet is asked about every step
        assert matched(side, "a", toks, 300, computed) == 256 - computed
    assert len(cache.calls) == 1 and len(cache.held) == 1
    assert side.counters.lookup_requests == 1 and side.counters.lookup_hit_tokens == 256
    now[0] = 11.0  # older than refresh_s: looked up again, the old lock freed, a new one taken
    assert matched(side, "a", toks, 300, 0) == 256
    assert len(cache.calls) == 2 and len(cache.held) == 1
    assert side.counters.lookup_requests == 1  # still one request
    assert side.request_finished("a") is False
    assert not cache.held


def test_full_prompt_hit_leaves_one_token_to_compute_but_loads_every_block() -> None:
    side = make_side(FakeCache(hit=256))
    toks, ids = prompt(256), blocks(8)
    assert matched(side, "a", toks, 256, 0) == 255
    side.after_alloc("a", toks, ids, 255)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 255)], num_scheduled_tokens={"a": 1}))
    assert plan.loads == [LoadSpec("a", toks, ids, skip_tokens=0)]
    assert plan.stores == []


def test_vllm_prefix_hit_is_skipped_by_the_load() -> None:
    side = make_side(FakeCache(hit=256))
    toks, ids = prompt(300), blocks(10)
    assert matched(side, "a", toks, 300, 64) == 192
    side.after_alloc("a", toks, ids, 192)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    assert plan.loads == [LoadSpec("a", toks[:256], ids[:8], skip_tokens=64)]


def test_a_hit_vllm_does_not_take_is_unlocked_at_once() -> None:
    cache = FakeCache(hit=128)
    side = make_side(cache)
    toks, ids = prompt(300), blocks(10)
    assert matched(side, "a", toks, 300, 160) == 0  # vLLM's own prefix hit is longer
    side.after_alloc("a", toks, ids, 0)
    assert not cache.held
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 160)], num_scheduled_tokens={"a": 140}))
    assert plan.loads == []
    assert plan.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=128)]


def test_unknown_hit_and_short_prompts() -> None:
    cache = FakeCache(hit=None)
    side = make_side(cache)
    assert matched(side, "a", prompt(300), 300, 0) is None  # vLLM asks again later
    assert matched(side, "b", prompt(31), 31, 0) == 0
    assert len(cache.calls) == 1  # a prompt shorter than a block never costs a lookup
    assert side.counters.lookup_requests == 0  # an answer not known yet is not a lookup


def test_a_hit_past_the_prompt_is_clipped_to_whole_prompt_blocks() -> None:
    side = make_side(FakeCache(hit=1024))
    assert matched(side, "a", prompt(300), 300, 0) == 288


def test_a_hit_that_ends_in_a_tail_is_loaded_block_by_block() -> None:
    """A stored tail (kvferry.cache.tails) makes a hit of whole blocks past the last full chunk."""
    side = make_side(FakeCache(hit=CHUNK + 2 * BS + 5))  # a hit is whole blocks: 5 more tokens are none
    toks, ids = prompt(400), blocks(13)
    assert matched(side, "a", toks, len(toks), 0) == CHUNK + 2 * BS
    side.after_alloc("a", toks, ids, CHUNK + 2 * BS)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), CHUNK + 2 * BS)], num_scheduled_tokens={"a": 208}))
    assert plan.loads == [LoadSpec("a", toks[: CHUNK + 2 * BS], ids[:6], 0)]
    assert plan.stores == [StoreSpec("a", toks[:384], ids[:12], skip_tokens=CHUNK + 2 * BS)]  # chunks 1 and 2


def test_background_load_is_planned_when_blocks_are_allocated_then_the_request_runs() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache, in_background=True)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("a", toks, 300, 0) == (256, True)
    side.after_alloc("a", toks, ids[:8], 256)  # blocks for the hit; vLLM does not schedule the request yet
    plan = side.build_plan(Step())
    assert plan.loads == [LoadSpec("a", toks[:256], ids[:8], 0, in_background=True)]
    assert side.build_plan(Step()).is_empty()  # planned once
    side.loads_done({"a"})
    assert not cache.held
    side.after_alloc("a", toks, [], 0)  # vLLM's second allocation, once the load is in
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    assert plan.loads == [] and plan.stores == []  # the loaded chunks are in the cache already
    assert side.request_finished("a") is False
    assert list(side.tracked_requests()) == []


def test_a_lock_goes_once_every_tensor_parallel_rank_reported_its_load() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache, in_background=True, ranks=2)
    toks, ids = prompt(300), blocks(10)
    side.num_new_matched_tokens("a", toks, 300, 0)
    side.after_alloc("a", toks, ids[:8], 256)
    side.build_plan(Step())
    side.loads_done(["a"])  # rank 0's load ran; rank 1's still reads the locked chunks
    assert cache.held
    side.loads_done(["a"], failed={"a"})  # rank 1's, short
    assert not cache.held
    assert side.num_new_matched_tokens("a", toks, 300, 0) == (0, False)  # a failed load is not offered again
    side.loads_done(["a"])  # a late report of a load no longer planned changes nothing
    assert not cache.held


def test_a_request_aborted_while_its_background_load_runs_is_forgotten_once_the_load_ends() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache, in_background=True)
    toks, ids = prompt(300), blocks(8)
    side.num_new_matched_tokens("a", toks, 300, 0)
    side.after_alloc("a", toks, ids, 256)
    side.build_plan(Step())
    assert side.request_finished("a") is False  # vLLM keeps the blocks until the load is reported
    assert len(cache.held) == 1  # the load still runs: a direct load copies the objects under this lock
    assert list(side.tracked_requests()) == ["a"]
    side.loads_done({"a"})
    assert list(side.tracked_requests()) == [] and not cache.held


def test_a_failed_load_is_not_offered_again_and_its_chunks_are_stored_again() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache, in_background=True)
    toks, ids = prompt(300), blocks(10)
    side.num_new_matched_tokens("a", toks, 300, 0)
    side.after_alloc("a", toks, ids[:8], 256)
    side.build_plan(Step())
    side.loads_done({"a"}, failed={"a"})
    # vLLM recomputes: the request comes back with nothing computed and is asked about again
    assert side.num_new_matched_tokens("a", toks, 300, 0) == (0, False)
    assert len(cache.calls) == 1 and not cache.held
    side.after_alloc("a", toks, ids, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (ids,), 0)], num_scheduled_tokens={"a": 300}))
    assert plan.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=0)]


def test_preempted_request_frees_its_lock_gets_its_new_block_table_and_loads_again() -> None:
    cache = FakeCache(hit=0)
    side = make_side(cache)
    toks, ids = prompt(300), blocks(10)
    matched(side, "a", toks, 300, 0)
    side.build_plan(Step([NewReq("a", toks, (ids,), 0)], num_scheduled_tokens={"a": 300}))
    preempt = side.build_plan(Step(preempted_req_ids={"a"}))
    assert preempt.preempted == ["a"]
    # resumed: the cache now holds the first two chunks; vLLM gives the request a new block table
    cache.hit = 256
    assert matched(side, "a", toks, 301, 0) == 256
    side.after_alloc("a", toks, blocks(10, start=500), 256)
    new_ids = blocks(10, start=500)
    cached = Cached(["a"], {"a"}, [(new_ids,)], [256])
    plan = side.build_plan(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 45}))
    assert plan.loads == [LoadSpec("a", toks[:256], new_ids[:8], skip_tokens=0)]
    assert plan.stores == []
    assert side.request_finished("a") is False  # its stores before the preemption were waited for then
    assert len(cache.held) == 1  # the load's lock, until the worker reports the load
    side.loads_done({"a"})
    assert not cache.held and list(side.tracked_requests()) == []


def test_a_preempted_request_waiting_with_a_locked_hit_releases_it() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache)
    toks, ids = prompt(300), blocks(10)
    matched(side, "a", toks, 300, 0)
    side.after_alloc("a", toks, ids, 256)
    side.build_plan(Step([NewReq("a", toks, (ids,), 256)], num_scheduled_tokens={"a": 44}))
    side.loads_done({"a"})
    cache.hit = 256
    side.build_plan(Step(preempted_req_ids={"a"}))
    assert matched(side, "a", toks, 300, 0) == 256  # looked up again after the preemption
    assert len(cache.held) == 1
    side.build_plan(Step(preempted_req_ids={"a"}))  # preempted again before it was scheduled
    assert not cache.held
    side.request_finished("a")
    assert list(side.tracked_requests()) == []


def test_locks_never_outlive_a_request_whatever_path_it_takes() -> None:
    """Random interleavings of lookups, re-asks, allocations, loads, preemptions and aborts: once every request
    finished (and its loads ran), no lock is held and no request is tracked."""
    rng = random.Random(5)
    for in_background in (False, True):
        cache = FakeCache(hit=256)
        side = make_side(cache, in_background=in_background)
        loading: set[str] = set()
        for i in range(200):
            req_id, toks, ids = f"r{i}", prompt(300, seed=i), blocks(10)
            cache.hit = rng.choice([0, 128, 256, None])
            for _ in range(rng.randrange(1, 4)):
                got = matched(side, req_id, toks, 300, 0)
            if got and rng.random() < 0.7:
                side.after_alloc(req_id, toks, ids, got)
                plan = side.build_plan(
                    Step() if in_background else Step([NewReq(req_id, toks, (ids,), got)], num_scheduled_tokens={})
                )
                loading.update(spec.req_id for spec in plan.loads)
                if rng.random() < 0.3:
                    side.build_plan(Step(preempted_req_ids={req_id}))
            if rng.random() < 0.5:
                side.loads_done(loading, failed={r for r in loading if rng.random() < 0.2})
                loading.clear()
            side.request_finished(req_id)
        side.loads_done(loading)
        assert not cache.held and side.locks_held() == 0
        assert list(side.tracked_requests()) == []


def test_bad_geometry_and_broken_promises_raise() -> None:
    with pytest.raises(ValueError, match="chunk_size=100 must be a positive multiple"):
        SchedulerSide(FakeCache().lookup, FakeCache().free_lock, block_size=BS, chunk_size=100)
    cache = FakeCache(hit=0)
    side = make_side(cache)
    with pytest.raises(RuntimeError, match="accepted 128 external tokens"):
        side.after_alloc("never-looked-up", prompt(300), blocks(10), 128)
    toks = prompt(300)
    cache.hit = 256
    matched(side, "a", toks, 300, 0)
    side.after_alloc("a", toks, blocks(2), 256)
    with pytest.raises(RuntimeError, match="holds 2 blocks, 256 tokens need 8"):
        side.build_plan(Step([NewReq("a", toks, (blocks(2),), 256)], num_scheduled_tokens={"a": 44}))


def test_uncacheable_requests_are_neither_looked_up_nor_stored() -> None:
    cache = FakeCache(hit=256)
    side = make_side(cache)
    toks, ids = prompt(300), blocks(10)
    assert side.num_new_matched_tokens("img", toks, 300, 0, cacheable=False) == (0, False)
    assert cache.calls == []
    side.after_alloc("img", toks, ids, 0)
    plan = side.build_plan(Step([NewReq("img", toks, (ids,), 0)], num_scheduled_tokens={"img": 300}))
    assert plan.is_empty()
    assert side.request_finished("img") is False
    assert list(side.tracked_requests()) == []


def test_a_short_block_table_skips_the_store_instead_of_failing(caplog: pytest.LogCaptureFixture) -> None:
    side = make_side(FakeCache(hit=0))
    toks = prompt(300)
    matched(side, "a", toks, 300, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (blocks(3),), 0)], num_scheduled_tokens={"a": 300}))
    assert plan.stores == []
    assert "holds too few blocks for 256 tokens" in caplog.text
    assert side.request_finished("a") is False


def test_a_finished_request_stores_the_whole_chunks_it_generated_in_the_next_step() -> None:
    """A chat's next turn repeats the last one's output: what a request computed is stored when it finishes (its
    prompt's chunks were stored during the prefill), and vLLM keeps the blocks until the store is done."""
    side = make_side(FakeCache(0))
    toks, ids = prompt(300), blocks(14)
    assert matched(side, "a", toks, len(toks), 0) == 0
    side.after_alloc("a", toks, ids, 0)
    plan = side.build_plan(Step([NewReq("a", toks, (ids[:10],), 0)], num_scheduled_tokens={"a": 300}))
    assert plan.stores == [StoreSpec("a", toks[:256], ids[:8], skip_tokens=0)]
    computed = toks + prompt(100, seed=1)  # 300 prompt tokens, then 100 generated (the KV of 400)
    assert side.request_finished("a", computed, ids) is True
    assert list(side.tracked_requests()) == []
    plan = side.build_plan(Step())
    assert plan.stores == [StoreSpec("a", computed[:384], ids[:12], skip_tokens=256)]
    assert side.build_plan(Step()).stores == []  # planned once


def test_a_finished_request_stores_its_last_partial_chunk_in_whole_blocks() -> None:
    """What a request computed past its last whole chunk is stored too (as a tail object), in whole blocks: the
    next turn's hit then covers this turn's prompt and output but for less than a block."""
    side = make_side(FakeCache(0))
    toks, ids = prompt(300), blocks(14)
    matched(side, "a", toks, len(toks), 0)
    side.after_alloc("a", toks, ids, 0)
    side.build_plan(Step([NewReq("a", toks, (ids[:10],), 0)], num_scheduled_tokens={"a": 300}))
    computed = toks + prompt(130, seed=1)  # 430 tokens: 3 chunks and 1 block more (14 tokens recomputed)
    assert side.request_finished("a", computed, ids) is True
    assert side.build_plan(Step()).stores == [StoreSpec("a", computed[:416], ids[:13], skip_tokens=256)]


@pytest.mark.parametrize("generated", [0, 10])
def test_a_finished_request_with_no_new_whole_block_plans_nothing_more(generated: int) -> None:
    side = make_side(FakeCache(0))
    toks, ids = prompt(270), blocks(9)
    matched(side, "a", toks, len(toks), 0)
    side.after_alloc("a", toks, ids, 0)
    side.build_plan(Step([NewReq("a", toks, (ids,), 0)], num_scheduled_tokens={"a": 270}))
    assert side.request_finished("a", toks + prompt(generated, seed=2), ids) is True  # the prefill's stores
    assert side.build_plan(Step()).stores == []


def test_a_request_finished_before_it_ran_or_uncacheable_stores_nothing_at_the_end() -> None:
    side = make_side(FakeCache(0))
    toks = prompt(600)
    matched(side, "waiting", toks, len(toks), 0)  # looked up, aborted before it was scheduled
    assert side.request_finished("waiting", toks, blocks(20)) is False
    side.num_new_matched_tokens("img", toks, len(toks), 0, cacheable=False)
    assert side.request_finished("img", toks, blocks(20)) is False
    assert side.build_plan(Step()).stores == []


def test_a_next_turn_waits_for_the_last_turns_store_in_flight() -> None:
    """An agent's next request, sent the moment the last one finished, must not miss what that one is storing."""
    now = [0.0]
    cache = FakeCache(0)
    side = make_side(cache, clock=lambda: now[0])
    toks, ids = prompt(300), blocks(14)
    matched(side, "a", toks, len(toks), 0)
    side.after_alloc("a", toks, ids, 0)
    side.build_plan(Step([NewReq("a", toks, (ids[:10],), 0)], num_scheduled_tokens={"a": 300}))
    said = toks + prompt(100, seed=1)
    assert side.request_finished("a", said, ids) is True
    next_turn, other = [*said, *prompt(50, seed=2)], prompt(400, seed=3)
    calls = len(cache.calls)
    assert matched(side, "b", next_turn, len(next_turn), 0) is None  # not known yet: the store is in flight
    assert matched(side, "c", other, len(other), 0) == 0  # another prompt is looked up at once
    side.build_plan(Step())  # the step that issues the store
    side.stores_done(["a"])
    assert matched(side, "b", next_turn, len(next_turn), 0) == 0  # looked up now (the fake cache misses)
    assert len(cache.calls) == calls + 2
    assert side.request_finished("b", next_turn, blocks(15)) is False  # it never ran: nothing to store
    side.request_finished("c", other)
    # A store never reported done holds a lookup back for refresh_s (10 s) at most.
    matched(side, "e", toks, len(toks), 0)
    side.after_alloc("e", toks, ids, 0)
    side.build_plan(Step([NewReq("e", toks, (ids[:10],), 0)], num_scheduled_tokens={"e": 300}))
    assert side.request_finished("e", said, ids) is True
    assert matched(side, "d", next_turn, len(next_turn), 0) is None
    now[0] = 10.5
    assert matched(side, "d", next_turn, len(next_turn), 0) == 0
