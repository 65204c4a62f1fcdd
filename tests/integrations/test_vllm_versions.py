"""The facts of the installed vLLM (`vllm_versions`) and a preempted request's resume, listed either way vLLM lists
it: among the running requests (0.32, 0.33) or sent again among the new ones (0.34; 0.32's V2 model runner)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvferry.connector.plan import LoadSpec, StoreSpec
from kvferry.integrations.vllm import vllm_versions
from kvferry.integrations.vllm.scheduler_side import SchedulerSide
from kvferry.integrations.vllm.vllm_versions import TESTED, VllmFacts

from .test_vllm_scheduler_side import BS, CHUNK, Cached, FakeCache, NewReq, Step, blocks, prompt

VLLM_032 = VllmFacts("0.32.0", resumed_among_cached=True)
VLLM_034 = VllmFacts("0.34.0", resumed_among_cached=False)


@dataclasses.dataclass
class NewReq034(NewReq):
    prefill_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Cached034:
    req_ids: list[str] = dataclasses.field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)


def test_the_installed_vllms_facts_are_read_off_its_classes() -> None:
    output = pytest.importorskip("vllm.v1.core.sched.output")
    import vllm

    facts = vllm_versions.installed()
    fields = {f.name for f in dataclasses.fields(output.CachedRequestData)}
    assert facts.version == vllm.__version__
    assert facts.resumed_among_cached == ("resumed_req_ids" in fields)
    assert facts.resumed_among_cached == (not vllm.__version__.startswith("0.34"))
    assert facts.tested  # CI runs the tested versions only


def test_an_untested_vllm_gets_one_warning_naming_the_tested_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger(vllm_versions.__name__)  # vLLM's logging may stop it propagating to pytest's capture
    monkeypatch.setattr(vllm_versions, "installed", lambda: VllmFacts("0.35.1", resumed_among_cached=False))
    vllm_versions.warn_if_untested.cache_clear()
    logger.addHandler(handler)
    try:
        for _ in range(3):  # each connector instance asks
            vllm_versions.warn_if_untested()
    finally:
        logger.removeHandler(handler)
        vllm_versions.warn_if_untested.cache_clear()
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 1 and "vLLM 0.35.1" in warnings[0] and ", ".join(TESTED) in warnings[0]
    assert VllmFacts("0.33.1", True).tested and not VllmFacts("0.3.3", True).tested


def _side(cache: FakeCache, facts: VllmFacts) -> SchedulerSide:
    return SchedulerSide(cache.lookup, cache.free_lock, block_size=BS, chunk_size=CHUNK, vllm=facts)


@pytest.mark.parametrize("listed", ["cached", "new"])
def test_a_resume_is_planned_as_a_resume_whichever_way_vllm_lists_it(listed: str) -> None:
    """Stored chunks are not stored again, the lock of the lookup before the preemption goes at the preemption, the
    resume's hit loads into the new blocks, and what the resumed prefill computes past the prompt (vLLM's generated
    tokens, recomputed) is stored by those tokens."""
    cache = FakeCache(hit=0)
    side = _side(cache, VLLM_032 if listed == "cached" else VLLM_034)
    toks, ids = prompt(300), blocks(10)
    side.num_new_matched_tokens("a", toks, 300, 0)
    first = NewReq034("a", toks, (ids,), 0, prefill_token_ids=toks)
    assert side.build_plan(Step([first], num_scheduled_tokens={"a": 300})).stores == [
        StoreSpec("a", toks[:256], ids[:8], 0)
    ]
    cache.hit = 256  # a lookup holds a lock until the request runs
    side.build_plan(Step(preempted_req_ids={"a"}))
    assert side.num_new_matched_tokens("a", toks, 301, 0) == (256, False)
    assert len(cache.held) == 1
    side.build_plan(Step(preempted_req_ids={"a"}))  # preempted again (vLLM could not schedule it): the lock goes
    assert not cache.held
    assert side.num_new_matched_tokens("a", toks, 301, 0) == (256, False)
    generated = prompt(90, seed=9)
    tokens = toks + generated  # 390: its prefill computes chunks 0 to 2 (chunk 2 holds generated tokens)
    new_ids = blocks(13, start=500)
    side.after_alloc("a", toks, new_ids, 256)
    if listed == "cached":
        cached = Cached(["a"], {"a"}, [(new_ids,)], [256], {"a": tokens})
        step = Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 134})
    else:
        step = Step([NewReq034("a", toks, (new_ids,), 256, prefill_token_ids=tokens)], num_scheduled_tokens={"a": 134})
    plan = side.build_plan(step)
    assert side.counters.requests_resumed == 1
    assert plan.loads == [LoadSpec("a", toks[:256], new_ids[:8], skip_tokens=0)]
    assert plan.stores == [StoreSpec("a", tokens[:384], new_ids[:12], skip_tokens=256)]  # only the new chunk
    side.loads_done({"a"})
    assert not cache.held
    computed = tokens + prompt(40, seed=10)  # 430: a block past chunk 2, stored as a tail at the finish
    assert side.request_finished("a", computed, [*new_ids, 600]) is True
    assert side.build_plan(Step()).stores == [StoreSpec("a", computed[:416], new_ids, skip_tokens=384)]
    assert list(side.tracked_requests()) == [] and side.locks_held() == 0


def test_a_new_request_is_not_taken_for_a_resume() -> None:
    """On 0.34 only the connector's memory of a preemption tells a resume from a new request: one never preempted
    (or preempted, resumed and running since) is new or running."""
    side = _side(FakeCache(hit=0), VLLM_034)
    toks, ids = prompt(300), blocks(10)
    side.num_new_matched_tokens("a", toks, 300, 0)
    side.build_plan(Step([NewReq034("a", toks, (ids,), 0, prefill_token_ids=toks)], num_scheduled_tokens={"a": 100}))
    running = Cached034(["a"], [(blocks(2, start=300),)], [100])
    plan = side.build_plan(Step(scheduled_cached_reqs=running, num_scheduled_tokens={"a": 200}))
    assert side.counters.requests_resumed == 0
    assert plan.stores == [StoreSpec("a", toks[:256], (ids + blocks(2, start=300))[:8], 0)]


def test_a_hybrid_models_resume_among_the_new_requests_loads_each_group_into_its_new_table() -> None:
    """0.34's resume of a hybrid model's request: each group's new table replaces the old (its blocks were freed)."""
    from kvferry.integrations.vllm.scheduler_side import GroupedSchedulerSide

    from .test_vllm_hybrid import BS as HBS
    from .test_vllm_hybrid import CHUNK as HCHUNK
    from .test_vllm_hybrid import FULL, SLIDING

    cache = FakeCache(hit=0)
    side = SchedulerSide(cache.lookup, cache.free_lock, block_size=HBS, chunk_size=HCHUNK, tails=False, vllm=VLLM_034)
    grouped = GroupedSchedulerSide(side, [SLIDING, FULL])
    toks = prompt(200)
    old = (list(range(1, 14)), list(range(21, 34)))
    grouped.num_new_matched_tokens("r", toks, 200, 0)
    grouped.after_alloc("r", toks, old, 0, toks)
    step = Step([NewReq034("r", toks, old, 0, prefill_token_ids=toks)], num_scheduled_tokens={"r": 200})
    assert len(grouped.build_plan(step).stores) == 2  # chunks 0-2, each group
    grouped.build_plan(Step(preempted_req_ids={"r"}))
    cache.hit = 3 * HCHUNK
    assert grouped.num_new_matched_tokens("r", toks, 205, 0) == (3 * HCHUNK, False)
    new = ([0] * 10 + [51, 52, 53], list(range(61, 74)))  # the window at token 192: blocks 10.. (token 160..)
    grouped.after_alloc("r", toks, new, 3 * HCHUNK, toks)
    tokens = [*toks, *prompt(5, seed=3)]
    plan = grouped.build_plan(Step([NewReq034("r", toks, new, 3 * HCHUNK, tokens)], num_scheduled_tokens={"r": 13}))
    assert side.counters.requests_resumed == 1
    sliding, full = plan.loads
    assert (sliding.group, sliding.skip_tokens, sliding.block_ids[10:]) == (0, 10 * HBS, [51, 52])
    assert (full.group, full.skip_tokens, full.block_ids) == (1, 0, new[1][:12])
    assert plan.stores == []  # chunks 0-2 are stored; the resume computes no further whole chunk
    grouped.loads_done({"r"})
    assert not cache.held
