"""The scheduler half of the vLLM connector: which prompt prefixes to load from kvferry and which to store.

It holds no KV and moves no bytes. It asks the cache how many leading prompt tokens it holds (``lookup``), keeps
each running request's block table as the scheduler hands out blocks, and turns every scheduler step into a
`StepPlan` for the worker half. It reads vLLM's scheduler output by attribute only (see the protocols below), so
it runs in tests without vLLM.

Invariants:
- A load never covers vLLM's own prefix hit: ``skip_tokens`` is the block-aligned count vLLM reported as
  computed, and those blocks may be shared with other running requests.
- Only whole chunks of the prompt are stored, each once per request, and only after the step that computes
  its last token (the worker stores after the forward pass).
- A request whose KV token ids alone do not determine is neither looked up nor stored.
- A request that had any store planned is reported to vLLM as "saving asynchronously" when it finishes, so vLLM
  keeps its blocks until the worker reports the stores done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvferry.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec

log = logging.getLogger(__name__)

# tokens -> leading tokens the cache holds (a multiple of the chunk size), or None for "not known yet" (a
# prefetch from a lower tier is running; vLLM asks again on a later step).
Lookup = Callable[[list[int]], int | None]


class NewRequest(Protocol):
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class CachedRequests(Protocol):
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]


class SchedulerStep(Protocol):
    """The fields of vLLM's ``SchedulerOutput`` this module reads."""

    scheduled_new_reqs: Sequence[NewRequest]
    scheduled_cached_reqs: CachedRequests
    num_scheduled_tokens: Mapping[str, int]
    preempted_req_ids: set[str] | None


@dataclass
class _Tracked:
    """A request the scheduler is running: its prompt, its blocks (token i lives in block ``i // block_size``)
    and how far the cache holds its prompt."""

    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    stored_upto: int = 0
    stores_planned: bool = False


class SchedulerSide:
    def __init__(self, lookup: Lookup, *, block_size: int, chunk_size: int) -> None:
        if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
            raise ValueError(f"chunk_size={chunk_size} must be a positive multiple of vLLM's block_size={block_size}")
        self._lookup = lookup
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._matches: dict[str, tuple[int, int]] = {}  # req_id -> (cache hit, vLLM's hit) at its last lookup
        self._pending_loads: dict[str, tuple[list[int], int, int]] = {}  # req_id -> (prompt, hit, skip)
        self._requests: dict[str, _Tracked] = {}
        self._uncacheable: set[str] = set()

    def num_new_matched_tokens(
        self, req_id: str, prompt: Sequence[int], num_tokens: int, num_computed_tokens: int, *, cacheable: bool = True
    ) -> int | None:
        """Tokens beyond vLLM's own ``num_computed_tokens`` that kvferry can load, or None if not known yet.

        At most ``num_tokens - 1`` tokens count as computed: vLLM must run at least one token to sample from.
        The load itself still fills every block of the hit; vLLM then recomputes that last token in place.
        ``cacheable=False`` (KV that token ids alone do not determine: images, LoRA adapters, a per-request
        cache salt) means no lookup and no store for this request.
        """
        if not cacheable:
            self._uncacheable.add(req_id)
            return 0
        if len(prompt) < self.chunk_size:
            return 0
        hit = self._lookup(list(prompt))
        if hit is None:
            return None
        hit = min(hit, len(prompt)) // self.chunk_size * self.chunk_size
        self._matches[req_id] = (hit, num_computed_tokens)
        return max(0, min(hit, num_tokens - 1) - num_computed_tokens)

    def after_alloc(self, req_id: str, prompt: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request; ``num_external_tokens`` > 0 means it accepted the hit of the
        last ``num_new_matched_tokens`` call, whose vLLM-computed prefix the load skips."""
        if num_external_tokens > 0:
            hit, skip = self._matches.get(req_id, (0, 0))
            if hit <= skip:
                raise RuntimeError(
                    f"vLLM accepted {num_external_tokens} external tokens for request {req_id!r} "
                    f"but the last lookup found {hit} (already computed: {skip})"
                )
            self._pending_loads[req_id] = (list(prompt), hit, skip)

    def build_plan(self, step: SchedulerStep) -> StepPlan:
        """The loads and stores of one scheduler step; updates each request's block table."""
        plan = StepPlan(preempted=sorted(step.preempted_req_ids or ()))
        for req_id in plan.preempted:
            if req_id in self._requests:
                self._requests[req_id].block_ids = []  # freed; a resumed request gets a new table
        for new in step.scheduled_new_reqs:
            if new.req_id in self._uncacheable:
                continue
            tracked = _Tracked(prompt=list(new.prompt_token_ids or []), block_ids=list(new.block_ids[0]))
            tracked.stored_upto = self._matches.get(new.req_id, (0, 0))[0]
            self._requests[new.req_id] = tracked
            self._plan_request(plan, new.req_id, new.num_computed_tokens, step.num_scheduled_tokens)
        cached = step.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue  # an uncacheable request: nothing to load or store
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            self._plan_request(plan, req_id, cached.num_computed_tokens[i], step.num_scheduled_tokens)
        return plan

    def request_finished(self, req_id: str) -> bool:
        """Forget the request; True when stores were planned for it (vLLM must keep its blocks until the
        worker reports them done)."""
        self._matches.pop(req_id, None)
        self._uncacheable.discard(req_id)
        self._pending_loads.pop(req_id, None)
        tracked = self._requests.pop(req_id, None)
        return tracked is not None and tracked.stores_planned

    def _plan_request(self, plan: StepPlan, req_id: str, num_computed: int, num_scheduled: Mapping[str, int]) -> None:
        tracked = self._requests[req_id]
        pending = self._pending_loads.pop(req_id, None)
        if pending is not None:
            prompt, hit, skip = pending
            plan.loads.append(LoadSpec(req_id, prompt[:hit], self._blocks_for(tracked, hit, req_id), skip_tokens=skip))
            tracked.stored_upto = max(tracked.stored_upto, hit)
        computed_after = num_computed + num_scheduled.get(req_id, 0)
        end = min(computed_after, len(tracked.prompt)) // self.chunk_size * self.chunk_size
        if end > tracked.stored_upto and len(tracked.block_ids) * self.block_size < end:
            log.warning("kvferry: request %s holds too few blocks for %d tokens; not storing them", req_id, end)
        elif end > tracked.stored_upto:
            plan.stores.append(
                StoreSpec(
                    req_id,
                    tracked.prompt[:end],
                    self._blocks_for(tracked, end, req_id),
                    skip_tokens=tracked.stored_upto,
                )
            )
            tracked.stored_upto = end
            tracked.stores_planned = True

    def _blocks_for(self, tracked: _Tracked, num_tokens: int, req_id: str) -> list[int]:
        needed = -(-num_tokens // self.block_size)
        if len(tracked.block_ids) < needed:
            raise RuntimeError(
                f"request {req_id!r} holds {len(tracked.block_ids)} blocks, {num_tokens} tokens need {needed}"
            )
        return tracked.block_ids[:needed]

    def tracked_requests(self) -> Iterable[str]:
        """Ids of the requests currently tracked (for tests and leak checks)."""
        return self._requests.keys()
