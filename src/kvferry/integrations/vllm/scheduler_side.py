"""The scheduler half of the vLLM connector: the connector's scheduler core (`kvferry.connector.scheduler_core`,
`kvferry.connector.hybrid_scheduler`) fed with vLLM's objects.

`SchedulerSide` (one KV cache group) and `GroupedSchedulerSide` (a hybrid model's groups) read vLLM's scheduler
output through `vllm_versions` (the one place that knows how each vLLM version lists a step's new, resumed and
running requests) and vLLM's ``Request`` by attribute only, so they run in tests without vLLM. Their
``get_num_new_matched_tokens``, ``update_state_after_alloc`` and ``request_finished_all_groups`` are the
connector's hooks of those names, less the connector's guard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvferry.connector.backends import Lookups
from kvferry.connector.hybrid_scheduler import GroupedSchedulerCore
from kvferry.connector.kv_groups import KVGroup
from kvferry.connector.plan import StepPlan
from kvferry.connector.scheduler_core import FreeLock, Lookup, SchedulerCore, Tables
from kvferry.connector.scheduler_lookups import loads_in_background
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.vllm import vllm_versions
from kvferry.integrations.vllm.vllm_versions import SchedulerStep, VllmFacts

if TYPE_CHECKING:
    from vllm.v1.request import Request


class SchedulerSide(SchedulerCore):
    """`SchedulerCore` over vLLM's scheduler steps (``vllm``: how they list resumes; default: the installed
    vLLM's way)."""

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
        vllm: VllmFacts | None = None,
    ) -> None:
        super().__init__(
            lookup, free_lock, block_size=block_size, chunk_size=chunk_size, in_background=in_background,
            refresh_s=refresh_s, clock=clock, ranks=ranks, tails=tails,
        )  # fmt: skip
        self.vllm = vllm or vllm_versions.installed()

    def build_plan(self, step: SchedulerStep) -> StepPlan:
        """The loads and stores of one scheduler step; updates each request's block table."""
        return self.plan_step(vllm_versions.step_facts(step, self.vllm))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.num_new_matched_tokens(*_asked(request), num_computed_tokens, cacheable=_cacheable(request))

    def update_state_after_alloc(self, request: Request, block_ids: Tables, num_external_tokens: int) -> None:
        """``block_ids``: vLLM's ``KVCacheBlocks.get_block_ids()``."""
        blocks = block_ids[0] if num_external_tokens > 0 else []
        self.after_alloc(request.request_id, request.prompt_token_ids or [], blocks, num_external_tokens)

    def request_finished_all_groups(self, request: Request, block_ids: Tables) -> bool:
        return self.request_finished(request.request_id, _computed(request), block_ids[0])


class GroupedSchedulerSide(GroupedSchedulerCore):
    """`GroupedSchedulerCore` over vLLM's scheduler steps (read as ``side`` reads them)."""

    def __init__(self, side: SchedulerSide, groups: Sequence[KVGroup]) -> None:
        super().__init__(side, groups)
        self.vllm = side.vllm

    def build_plan(self, step: SchedulerStep) -> StepPlan:
        return self.plan_step(vllm_versions.step_facts(step, self.vllm))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.num_new_matched_tokens(*_asked(request), num_computed_tokens, cacheable=_cacheable(request))

    def update_state_after_alloc(self, request: Request, block_ids: Tables, num_external_tokens: int) -> None:
        """``block_ids``: vLLM's ``KVCacheBlocks.get_block_ids()``; the request's ``all_token_ids`` (a view vLLM
        extends as it generates) key the states it computes past its prompt."""
        prompt = request.prompt_token_ids or []
        self.after_alloc(request.request_id, prompt, block_ids, num_external_tokens, request.all_token_ids)

    def request_finished_all_groups(self, request: Request, block_ids: Tables) -> bool:
        return self.request_finished(request.request_id, _computed(request), block_ids)


def scheduler_side_for(
    lookups: Lookups, settings: ConnectorSettings, groups: Sequence[KVGroup], block_size: int, ranks: int
) -> SchedulerSide | GroupedSchedulerSide | None:
    """The scheduler half over ``lookups``: of a hybrid model's ``groups``, or of vLLM's one group of
    ``block_size`` (no ``groups``) across ``ranks`` tensor-parallel workers. None while the cache's chunk size is
    not known (a server never reached: its link warned and keeps trying; lookups miss)."""
    chunk_size = lookups.chunk_size
    if chunk_size is None:
        return None
    side = SchedulerSide(
        lookups.lookup,
        lookups.free_lock,
        block_size=groups[0].block_size if groups else block_size,
        chunk_size=chunk_size,
        in_background=loads_in_background(settings, groups),
        refresh_s=settings.lock_refresh_s,
        ranks=ranks,
        tails=not groups,
    )
    return GroupedSchedulerSide(side, groups) if groups else side


def _asked(request: Request) -> tuple[str, Sequence[int], int]:
    """What a lookup is asked of the request: its id, prompt and tokens (prompt and output so far)."""
    return request.request_id, request.prompt_token_ids or [], request.num_tokens


def _cacheable(request: Request) -> bool:
    """Whether token ids alone determine the request's KV (not with images, a LoRA adapter, a cache salt)."""
    return not (request.mm_features or request.lora_request or request.cache_salt)


def _computed(request: Request) -> Sequence[int]:
    """The tokens whose KV a finished request computed: its tokens but the last generated one, less any still in
    flight (vLLM's async scheduling)."""
    computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
    return request.all_token_ids[: max(0, computed)]
