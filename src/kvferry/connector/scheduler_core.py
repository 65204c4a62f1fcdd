"""The scheduler half of a connector, engine-neutral: which prompt prefixes to load from kvferry and which to store.

It holds no KV and moves no bytes. It asks the cache how many leading prompt tokens it holds (``lookup``), keeps
each running request's block table as the engine's scheduler hands out blocks, and turns every engine step into a
`StepPlan` for the worker half. An engine adapter (`kvferry.integrations.vllm.scheduler_side`) translates its
scheduler's requests and steps into the calls and dataclasses here (`Scheduled`, `StepFacts`); a hybrid model's
groups are planned by `hybrid_scheduler` over this.

Invariants:
- One lookup per request, not per re-ask: an engine asks again every step a request waits, and the answer is kept
  (renewed after ``refresh_s``). The lookup locks its hit; the lock is freed when the engine did not take the hit,
  or the request was preempted or finished (aborts included), and once planned for a load, only once every rank
  reported that load: a direct load copies the objects under it (`Hit.located`). Locks never outlive that.
- A load never covers the engine's own prefix hit: ``skip_tokens`` is the block-aligned count the engine reported
  as computed, and those blocks may be shared with other running requests.
- A request whose load failed is not offered kvferry's hit again (the engine recomputes it).
- Whole chunks of the prompt are stored once per request, after the step that computes their last token (the
  worker stores after the forward pass). When the request finishes, everything it computed (its generated tokens
  too: a chat's next turn repeats them) is stored in the step after, in whole blocks: full chunks, and the blocks
  after the last one as a tail object (`kvferry.cache.tails`), which the next turn's lookup hits.
- A hit is block-aligned: full chunks, then a stored tail.
- A lookup of a prompt that goes on from a finished request's tokens whose store is still in flight waits for it
  (answers "not known yet"; at most ``refresh_s``): a chat's or an agent's next turn, sent the moment the last one
  finished, hits all of it. The engine runs the step that issues the store meanwhile.
- A request whose KV token ids alone do not determine is neither looked up nor stored.
- A preempted request that resumes is planned as a resume (`Scheduled.resumed`): looked up again, its blocks
  replaced, chunks already stored not stored again; its prefill's tokens (prompt and output) key the chunks it
  stores from then on.
- A request that had any store planned since it last started is reported to the engine as "saving
  asynchronously" when it finishes, so the engine keeps its blocks until the worker reports the stores done. A
  preempted request's stores are waited for by the worker before its blocks go (and then forgotten on both sides).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.cache.keys import TokenIds, token_array
from kvferry.client.records import LocateResult
from kvferry.connector.backends import Hit
from kvferry.connector.counters import SchedulerCounters
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec

log = logging.getLogger(__name__)

Lookup = Callable[[TokenIds], Hit | None]
FreeLock = Callable[[Any], None]
Tables = tuple[list[int], ...]  # a request's block ids, one list per KV cache group (one group: a 1-tuple)


@dataclass(frozen=True)
class Scheduled:
    """One request of an engine step."""

    req_id: str
    num_computed_tokens: int
    block_ids: Tables | None  # ``starts``: its whole block table; else the blocks it got this step
    starts: bool  # new, or resumed after a preemption: ``block_ids`` replace its table
    resumed: bool  # it was preempted before (its blocks were freed, the connector forgot them)
    prompt: Sequence[int] | None = None  # a new request's prompt (some engines send it again on a resume)
    tokens: Sequence[int] | None = None  # a resumed request's tokens to prefill (prompt and output), where sent


# A state a hybrid model's engine hands over in a step for storing: (group index, block id, boundary in tokens).
StateOffer = tuple[int, int, int]


@dataclass(frozen=True)
class StepFacts:
    """One engine step, as the scheduler half plans it.

    ``requests(preempted_before)`` lists the step's scheduled requests; it is called once the step's
    ``preempted`` requests are taken in, and ``preempted_before(req_id)`` tells whether the request was preempted
    since it last ran (what tells a resume from a new request for an engine that lists both alike).
    ``num_scheduled_tokens``: the tokens each request computes in the step. ``state_offers``: per request, the
    states (a Mamba group's) the engine hands over for storing (`hybrid_scheduler`)."""

    requests: Callable[[Callable[[str], bool]], Sequence[Scheduled]]
    num_scheduled_tokens: Mapping[str, int]
    preempted: Collection[str] = ()
    state_offers: Mapping[str, Sequence[StateOffer]] = field(default_factory=dict)


@dataclass
class _Request:
    """What this side knows of one request, from its first lookup until the engine finished it (and its load ran)."""

    prompt: np.ndarray = field(default_factory=lambda: _NO_TOKENS)  # `token_array`: plans hand on its slices
    looked_up: np.ndarray | None = None  # the prompt as last looked up (the same request's prompt, converted)
    hit: int = 0  # the cache's hit at the last lookup (block-aligned)
    skip: int = 0  # the engine's own computed tokens at the last lookup
    lock: Any = None  # the last lookup's, until a load is planned with it
    located: LocateResult | None = None  # the hit's objects, under ``lock`` (`Hit.located`)
    load_locks: list[Any] = field(default_factory=list)  # planned loads' locks, freed once all ranks reported
    looked_up_at: float | None = None
    pending_load: list[int] | None = None  # an accepted hit's block ids (background load), until planned
    accepted: bool = False  # the engine took the hit; its load is planned with the request's first schedule
    reports_due: int = 0  # ranks' reports yet to come of the planned loads (0: no load in flight)
    load_failed: bool = False
    uncacheable: bool = False
    finished: bool = False
    # once scheduled: the block table (token i lives in block i // block_size) and what the cache holds
    running: bool = False
    preempted: bool = False  # since it last ran: its next schedule is a resume
    block_ids: list[int] = field(default_factory=list)
    stored_upto: int = 0
    stores_planned: bool = False


_NO_TOKENS: np.ndarray = np.empty(0, dtype="<u4")


class SchedulerCore:
    """Lookups, locks and each step's plan of one engine's scheduler (see the module's invariants)."""

    def __init__(
        self,
        lookup: Lookup,
        free_lock: FreeLock,
        *,
        block_size: int,
        chunk_size: int,
        in_background: bool = False,
        refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        ranks: int = 1,
        tails: bool = True,
    ) -> None:
        """``lookup``, ``free_lock``: the cache's (`kvferry.connector.backends.Lookups`). ``block_size``: the
        engine's tokens per block; ``chunk_size``: the cache's, a multiple of it. ``in_background``: hits load
        while the engine runs other requests (the request waits for its load). ``ranks``: the engine's
        tensor-parallel workers; each loads its slice and reports it. ``tails``: a finished request also stores
        its last partial chunk in whole blocks (False: whole chunks only)."""
        if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
            raise ValueError(
                f"chunk_size={chunk_size} must be a positive multiple of the engine's block_size={block_size}"
            )
        self._lookup = lookup
        self._free_lock = free_lock
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.in_background = in_background
        self._refresh_s = refresh_s
        self._clock = clock
        self._ranks = ranks
        self.tails = tails
        self._requests: dict[str, _Request] = {}
        self._finishing: list[StoreSpec] = []  # stores of finished requests, for the next step's plan
        # Finished requests' stores not reported done yet: their tokens, and until when a lookup waits for them
        self._saving: dict[str, tuple[np.ndarray, float]] = {}
        self.counters = SchedulerCounters()

    def num_new_matched_tokens(
        self, req_id: str, prompt: Sequence[int], num_tokens: int, num_computed_tokens: int, *, cacheable: bool = True
    ) -> tuple[int | None, bool]:
        """(tokens beyond the engine's ``num_computed_tokens`` that kvferry can load, or None if not known yet;
        whether the load runs in the background).

        At most ``num_tokens - 1`` tokens count as computed: the engine must run at least one token to sample
        from. The load itself still fills every block of the hit; the engine then recomputes that last token in
        place.
        ``cacheable=False`` (KV that token ids alone do not determine: images, LoRA adapters, a per-request
        cache salt) means no lookup and no store for this request.
        """
        req = self._requests.setdefault(req_id, _Request())
        if not cacheable:
            req.uncacheable = True
            return 0, False
        if req.load_failed or len(prompt) < self.block_size:
            return 0, False
        stale = req.looked_up_at is not None and self._clock() - req.looked_up_at > self._refresh_s
        if req.looked_up_at is None or stale:
            if self._saving and self._extends_a_store_in_flight(prompt):
                return None, False
            self._release(req)
            req.looked_up = token_array(prompt)
            found = self._lookup(req.looked_up)
            if found is None:
                return None, False
            req.hit = min(found.tokens, len(prompt)) // self.block_size * self.block_size
            req.lock = found.lock
            # a load copies the located objects only where it loads all of them (a hit cut short here: it locates)
            req.located = found.located if found.located is not None and found.located.tokens == req.hit else None
            if req.hit == 0:
                self._release(req)  # nothing to pin
            if req.looked_up_at is None:
                self.counters.count_lookup(req.hit)
            req.looked_up_at = self._clock()
        req.skip = num_computed_tokens
        matched = max(0, min(req.hit, num_tokens - 1) - num_computed_tokens)
        return matched, self.in_background and matched > 0

    def after_alloc(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int], num_external: int) -> None:
        """The engine allocated ``block_ids`` for the request; ``num_external`` > 0 means it took the hit of the
        last ``num_new_matched_tokens`` call (whose engine-computed prefix the load skips), 0 that it did not."""
        req = self._requests.get(req_id)
        if num_external <= 0:
            if req is not None:
                self._release(req)  # not taken (or a background load's second allocation, after it ran)
            return
        if req is None or req.hit <= req.skip:
            hit, skip = (0, 0) if req is None else (req.hit, req.skip)
            raise RuntimeError(
                f"the engine accepted {num_external} external tokens for request {req_id!r} "
                f"but the last lookup found {hit} (already computed: {skip})"
            )
        req.prompt = _prompt_of(req, prompt)
        req.accepted = True
        self.counters.hit_tokens_taken += num_external
        if self.in_background:
            req.pending_load = list(block_ids)

    def plan_step(self, step: StepFacts) -> StepPlan:
        """The loads and stores of one engine step; updates each request's block table."""
        plan = self.start_plan(step.preempted)
        for scheduled in step.requests(self.was_preempted):
            self.plan_scheduled(plan, scheduled, step.num_scheduled_tokens)
        return plan

    def start_plan(self, preempted: Iterable[str]) -> StepPlan:
        """A step's plan before its scheduled requests (`plan_scheduled`): finished requests' stores, the step's
        ``preempted`` requests, background loads."""
        plan = StepPlan(preempted=sorted(preempted))
        plan.stores += self._finishing  # their requests are gone from the step; the engine keeps their blocks
        self._finishing = []
        for req_id in plan.preempted:
            req = self._requests.get(req_id)
            if req is not None:  # its blocks are freed; it is looked up again when it resumes
                self._release(req)
                req.block_ids, req.looked_up_at, req.stores_planned, req.preempted = [], None, False, True
        for req_id, req in self._requests.items():
            if req.pending_load is not None:
                blocks = req.pending_load
                req.pending_load = None
                self._plan_load(plan, req_id, req, blocks, in_background=True)
        return plan

    def plan_scheduled(self, plan: StepPlan, scheduled: Scheduled, num_scheduled: Mapping[str, int]) -> None:
        """Adds the loads and stores of one scheduled request (its block ids: the table this side plans over)."""
        req_id = scheduled.req_id
        req = self._requests.get(req_id) if not scheduled.starts else self._requests.setdefault(req_id, _Request())
        if req is None or req.uncacheable or not (req.running or scheduled.starts):
            return
        blocks = list(scheduled.block_ids[0]) if scheduled.block_ids else []
        if scheduled.resumed:
            # The prefill recomputes its prompt and what it generated: chunks of both are stored as computed.
            tokens = scheduled.tokens if scheduled.tokens is not None else scheduled.prompt
            if tokens is not None and len(tokens) > len(req.prompt):
                req.prompt = token_array(tokens)
            req.preempted = False
            self.counters.requests_resumed += 1
        elif scheduled.starts:
            req.prompt = _prompt_of(req, scheduled.prompt or ())
        if scheduled.starts:
            req.block_ids = blocks
            self._start_running(req)
        else:
            req.block_ids.extend(blocks)
        self._plan_request(plan, req_id, req, scheduled.num_computed_tokens, num_scheduled)

    def loads_done(self, req_ids: Iterable[str], failed: Iterable[str] = ()) -> None:
        """Workers ran these loads, each id one rank's report (``failed``: those that came back short on some
        rank); a load's lock goes once every rank reported it."""
        for req_id in failed:
            req = self._requests.get(req_id)
            if req is not None:
                req.load_failed = True
                req.stored_upto = 0  # what it could not load may be missing from the cache: store it again
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is None or not req.reports_due:
                continue
            req.reports_due -= 1
            if req.reports_due:
                continue
            self._release(req)
            self._free_load_locks(req)
            if req.finished:
                del self._requests[req_id]

    def request_finished(
        self, req_id: str, computed: Sequence[int] = (), block_ids: Sequence[int] | None = None
    ) -> bool:
        """The engine finished (or aborted) the request, which had computed the KV of the tokens ``computed`` (its
        prompt and what it generated but the last token) into ``block_ids`` (None: the block table kept here).
        Plans the store of their whole blocks not stored yet (full chunks, then a tail). True when stores were
        planned for the request: the engine must keep its blocks until the worker reports them done."""
        req = self._requests.get(req_id)
        if req is None:
            return False
        self._release(req)
        if req.reports_due:  # the engine keeps its blocks until the worker reports the load; forget it then
            req.finished = True
            return False
        del self._requests[req_id]
        unit = self.block_size if self.tails else self.chunk_size
        end = len(computed) // unit * unit
        table = list(block_ids) if block_ids is not None else req.block_ids
        needed = end // self.block_size
        if req.running and not req.uncacheable and end > req.stored_upto and len(table) >= needed:
            tokens = token_array(computed[:end])
            self._finishing.append(StoreSpec(req_id, tokens, table[:needed], req.stored_upto))
            self._saving[req_id] = (tokens, self._clock() + self._refresh_s)
            req.stores_planned = True
        return req.stores_planned

    def plan_state_store(self, req_id: str, boundary: int, tokens: Sequence[int] = ()) -> np.ndarray | None:
        """The tokens up to ``boundary`` when a state computed there (a Mamba group's) is to be stored: the request
        runs, is cacheable and ``boundary`` is a chunk boundary of its prompt, or of ``tokens`` (its tokens as the
        engine knows them now: prompt and output so far, for a state computed while generating); else None. The
        engine then keeps the request's blocks at its finish until the worker reports its stores done."""
        req = self._requests.get(req_id)
        if req is None or not req.running or req.uncacheable or not len(req.prompt):  # no token ids: nothing keys it
            return None
        if boundary <= 0 or boundary % self.chunk_size:
            return None
        known = req.prompt if boundary <= len(req.prompt) else tokens
        if boundary > len(known):
            return None
        req.stores_planned = True
        return token_array(known[:boundary])

    def stores_done(self, req_ids: Iterable[str]) -> None:
        """The worker finished the stores of these (finished) requests: lookups need not wait for them."""
        for req_id in req_ids:
            self._saving.pop(req_id, None)

    def close(self) -> None:
        """Free every lock still held (the engine is shutting down)."""
        for req in self._requests.values():
            self._release(req)
            self._free_load_locks(req)

    def tracked_requests(self) -> Iterable[str]:
        """Ids of the requests currently known (for tests and leak checks)."""
        return self._requests.keys()

    def locks_held(self) -> int:
        return sum((req.lock is not None) + len(req.load_locks) for req in self._requests.values())

    def was_preempted(self, req_id: str) -> bool:
        """Whether the request was preempted since it last ran (its next schedule is a resume)."""
        req = self._requests.get(req_id)
        return req is not None and req.preempted

    # -- helpers ---------------------------------------------------------------------------------------------

    def _extends_a_store_in_flight(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` shares its first block and on with the tokens of a finished request's store in
        flight (forgetting those past their wait)."""
        now = self._clock()
        for req_id, (tokens, until) in list(self._saving.items()):
            if now > until:
                del self._saving[req_id]
                continue
            n = min(len(tokens), len(prompt))
            if n >= self.block_size and tokens[0] == prompt[0] and np.array_equal(token_array(prompt[:n]), tokens[:n]):
                return True
        return False

    def _release(self, req: _Request) -> None:
        """Free the last lookup's lock (not the planned loads': `_free_load_locks`)."""
        req.located = None  # its lease is the lock
        if req.lock is not None:
            lock, req.lock = req.lock, None
            self._free_lock(lock)

    def _free_load_locks(self, req: _Request) -> None:
        locks, req.load_locks = req.load_locks, []
        for lock in locks:
            self._free_lock(lock)

    def _start_running(self, req: _Request) -> None:
        req.running = True
        if req.stored_upto == 0 and not req.load_failed:
            req.stored_upto = req.hit  # what the cache held at lookup need not be stored again

    def _plan_load(
        self, plan: StepPlan, req_id: str, req: _Request, block_ids: list[int], *, in_background: bool
    ) -> None:
        needed = -(-req.hit // self.block_size)
        if len(block_ids) < needed:
            raise RuntimeError(f"request {req_id!r} holds {len(block_ids)} blocks, {req.hit} tokens need {needed}")
        plan.loads.append(
            LoadSpec(req_id, req.prompt[: req.hit], block_ids[:needed], req.skip, in_background, located=req.located)
        )
        if req.lock is not None:  # the load's now: held until every rank reported it, whatever else happens
            req.load_locks.append(req.lock)
            req.lock, req.located = None, None
        req.accepted = False
        req.reports_due += self._ranks

    def _plan_request(
        self, plan: StepPlan, req_id: str, req: _Request, num_computed: int, num_scheduled: Mapping[str, int]
    ) -> None:
        if req.accepted:  # a hit loaded before this step's forward pass
            self._plan_load(plan, req_id, req, req.block_ids, in_background=False)
        computed_after = num_computed + num_scheduled.get(req_id, 0)
        end = min(computed_after, len(req.prompt)) // self.chunk_size * self.chunk_size
        if end > req.stored_upto and len(req.block_ids) * self.block_size < end:
            log.warning("kvferry: request %s holds too few blocks for %d tokens; not storing them", req_id, end)
        elif end > req.stored_upto:
            needed = -(-end // self.block_size)
            plan.stores.append(StoreSpec(req_id, req.prompt[:end], req.block_ids[:needed], req.stored_upto))
            req.stored_upto = end
            req.stores_planned = True


def _prompt_of(req: _Request, prompt: Sequence[int]) -> np.ndarray:
    """The request's prompt as an array: its lookup's where the lengths agree (an engine sends it alike each time)."""
    looked_up = req.looked_up
    return looked_up if looked_up is not None and len(looked_up) == len(prompt) else token_array(prompt)
