"""The scheduler half for a hybrid model: one `SchedulerCore` decides, every group gets its share of the plan.

`SchedulerCore` looks up (through `GroupedLookups`: the prefix every group holds), locks, and plans loads and
stores over one block table, the lead group's (a full-attention group where there is one). This wrapper keeps
every group's block table as the engine hands them out and turns each planned load or store into one per group,
over that group's blocks (`LoadSpec.group`). What follows names vLLM's behaviour, the one engine with hybrid
models kvferry runs under (`kvferry.integrations.vllm.scheduler_side` translates its steps).

A windowed group (sliding window, chunked local) differs in two ways:
- a load writes only the group's blocks vLLM allocated, those inside the window at the hit's end (vLLM puts its
  null block before them); what lies before is skipped, not loaded;
- a store reads only blocks vLLM has not freed: vLLM frees a windowed group's blocks as the window slides, at
  the start of a step, so a chunk is stored from the blocks of the step that computed it, never after. A chunk
  with blocks already freed (it straddles steps and the window passed its start) is left out for that group: a
  later lookup then stops before it (a shorter hit), never loads another request's bytes. The worker waits for
  a windowed group's stores before the next step's forward pass (`WorkerSide.settle_windowed_stores`), since
  vLLM may give those blocks to another request then.

A Mamba group (`state_groups`) stores the states vLLM hands over in the step's scheduler output
(``kv_connector_block_state.boundary_state_offloads``: request, group, block, boundary; `StepFacts.state_offers`),
those at chunk
boundaries, each from the exact block vLLM named (never its null block), and settled before the next forward
pass as a windowed group's are; a load writes the one block vLLM allocated for the hit's state, in the background
(vLLM copies that block into the one the request's forward pass starts from, in the step that schedules it, before
a foreground load could write it; and it takes such a model's failed load only from a background one). A boundary past
the prompt (a state vLLM computed while generating: it hands those over unless its
``prefix_cache_retention_interval`` keeps the prompt's last boundary only, its default) is keyed by the request's
tokens as vLLM knows them at that step (``tokens`` of `after_alloc`: vLLM's ``Request.all_token_ids``, a view
that grows as the request generates); with the output stored at the finish, a chat's next turn hits up to there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvferry.connector.kv_groups import NULL_BLOCK, KVGroup, first_unfreed_token
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.scheduler_core import Scheduled, SchedulerCore, StateOffer, StepFacts, Tables


class GroupedSchedulerCore:
    """`SchedulerCore`'s interface for a model of several KV cache groups (``groups``, in the engine's order)."""

    def __init__(self, side: SchedulerCore, groups: Sequence[KVGroup]) -> None:
        if side.tails:
            # A hit is whole chunks that every group holds (`GroupedLookups`): one group's tail is never loaded.
            raise ValueError("a hybrid model's scheduler side stores whole chunks only (tails=False)")
        if any(group.holds_state for group in groups) and not side.in_background:
            raise ValueError("a model with a state group loads in the background only (in_background=True)")
        self.side = side
        self.groups = list(groups)
        attention = [g.index for g in self.groups if not g.windowed and not g.holds_state]
        self.lead = attention[0] if attention else 0  # the group whose table `SchedulerCore` plans over
        self.counters = side.counters
        self._tables: dict[str, Tables] = {}  # running requests' block tables, one list per group
        self._pending: dict[str, Tables] = {}  # an accepted background load's blocks, until planned
        self._finished: dict[str, Tables] = {}  # finished requests' tables, until their stores are planned
        self._tokens: dict[str, Sequence[int]] = {}  # running requests' tokens, a view the engine extends

    def num_new_matched_tokens(
        self, req_id: str, prompt: Sequence[int], num_tokens: int, num_computed_tokens: int, *, cacheable: bool = True
    ) -> tuple[int | None, bool]:
        return self.side.num_new_matched_tokens(req_id, prompt, num_tokens, num_computed_tokens, cacheable=cacheable)

    def after_alloc(
        self, req_id: str, prompt: Sequence[int], block_ids: Tables, num_external: int, tokens: Sequence[int] = ()
    ) -> None:
        """``tokens``: the request's tokens, a view the engine extends as it generates (keys the states it computes
        past the prompt); see `SchedulerCore.after_alloc` for the rest."""
        if prompt and tokens:
            self._tokens[req_id] = tokens
        self.side.after_alloc(req_id, prompt, block_ids[self.lead] if num_external > 0 else [], num_external)
        if num_external > 0 and self.side.in_background:
            self._pending[req_id] = tuple(list(ids) for ids in block_ids)

    def plan_step(self, step: StepFacts) -> StepPlan:
        """The loads and stores of one engine step, each group's; updates each request's block tables."""
        pending, self._pending = self._pending, {}
        finished, self._finished = self._finished, {}
        plan = self.side.start_plan(step.preempted)
        for req_id in plan.preempted:
            self._tables.pop(req_id, None)
        requests = step.requests(self.side.was_preempted)
        computed = self._update_tables(requests)
        for scheduled in requests:  # planned over the lead group's table
            lead = None if scheduled.block_ids is None else (list(scheduled.block_ids[self.lead]),)
            self.side.plan_scheduled(plan, dataclasses.replace(scheduled, block_ids=lead), step.num_scheduled_tokens)
        grouped = StepPlan(preempted=plan.preempted)
        for load in plan.loads:
            tables = pending.get(load.req_id) or self._tables.get(load.req_id)
            if tables is not None:
                grouped.loads += [self._load(load, group, tables[group.index]) for group in self.groups]
        for store in plan.stores:
            tables = finished.get(store.req_id) or self._tables.get(store.req_id)
            if tables is not None:
                num_computed = computed.get(store.req_id)
                grouped.stores += [
                    self._store(store, group, tables[group.index], num_computed)
                    for group in self.groups
                    if not group.holds_state
                ]
        grouped.stores += self._state_stores(step.state_offers)
        return grouped

    def loads_done(self, req_ids: Any, failed: Any = ()) -> None:
        self.side.loads_done(req_ids, failed)

    def stores_done(self, req_ids: Iterable[str]) -> None:
        self.side.stores_done(req_ids)

    def request_finished(self, req_id: str, computed: Sequence[int], block_ids: Tables) -> bool:
        self._tables.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._tokens.pop(req_id, None)
        saving = self.side.request_finished(req_id, computed, block_ids[self.lead])
        if saving:
            self._finished[req_id] = tuple(list(ids) for ids in block_ids)
        return saving

    def close(self) -> None:
        self.side.close()

    def tracked_requests(self) -> Any:
        return self.side.tracked_requests()

    def locks_held(self) -> int:
        return self.side.locks_held()

    # -- helpers ---------------------------------------------------------------------------------------------

    def _update_tables(self, requests: Sequence[Scheduled]) -> dict[str, int]:
        """Every group's block table after the step's allocations; each scheduled request's computed tokens at the
        step's start (what vLLM freed windowed blocks by)."""
        computed = {}
        for scheduled in requests:
            req_id, new_blocks = scheduled.req_id, scheduled.block_ids
            if scheduled.starts or req_id not in self._tables:
                self._tables[req_id] = tuple(list(ids) for ids in new_blocks) if new_blocks else ()
            elif new_blocks:
                for table, ids in zip(self._tables[req_id], new_blocks, strict=True):
                    table.extend(ids)
            computed[req_id] = scheduled.num_computed_tokens
        return computed

    def _state_stores(self, offers: Mapping[str, Sequence[StateOffer]]) -> list[StoreSpec]:
        """The stores of the Mamba states the engine handed over this step: those at chunk boundaries of a running
        request's tokens, each from its own block (the engine's null block never)."""
        stores = []
        for req_id, entries in offers.items():
            for group_id, block_id, boundary in entries:
                if 0 <= group_id < len(self.groups) and self.groups[group_id].holds_state and block_id != NULL_BLOCK:
                    tokens = self.side.plan_state_store(req_id, boundary, self._tokens.get(req_id, ()))
                    if tokens is not None:
                        stores.append(StoreSpec(req_id, tokens, [block_id], 0, group=group_id))
        return stores

    def _load(self, load: LoadSpec, group: KVGroup, table: list[int]) -> LoadSpec:
        end = len(load.tokens)
        ids = table[: -(-end // group.block_size)]
        skip = load.skip_tokens
        if group.holds_state:  # the one block vLLM allocated for the state at the hit's end
            skip = max(skip, end - group.block_size)
        elif group.windowed:  # vLLM allocated only the window's blocks: load from the first it holds
            skip = min(end, first_unfreed_token(group, ids, skip, end) // group.block_size * group.block_size)
        return dataclasses.replace(load, block_ids=ids, skip_tokens=skip, group=group.index)

    def _store(self, store: StoreSpec, group: KVGroup, table: list[int], num_computed: int | None) -> StoreSpec:
        end = len(store.tokens)
        ids = table[: -(-end // group.block_size)]
        skip = store.skip_tokens
        if group.windowed:
            start = first_unfreed_token(group, ids, skip, end)
            if num_computed is not None:  # blocks vLLM freed at this step's start still hold their old ids here
                start = max(start, group.skipped_tokens(num_computed))
            chunk = self.side.chunk_size
            skip = min(end, -(-start // chunk) * chunk)  # whole chunks only: one with a freed block is left out
        return dataclasses.replace(store, block_ids=ids, skip_tokens=skip, group=group.index)
