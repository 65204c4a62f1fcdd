"""The scheduler half of the vLLM connector: the connector's scheduler core (`kvferry.connector.scheduler_core`,
`kvferry.connector.hybrid_scheduler`) fed with vLLM's objects.

`SchedulerSide` (one KV cache group) and `GroupedSchedulerSide` (a hybrid model's groups) read vLLM's scheduler
output through `vllm_versions` (the one place that knows how each vLLM version lists a step's new, resumed and
running requests) and vLLM's ``Request`` by attribute only, so they run in tests without vLLM. Their
``get_num_new_matched_tokens``, ``update_state_after_alloc`` and ``request_finished_all_groups`` are the
connector's hooks of those names, less the connector's guard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvferry.connector import hybrid_worker, layer_parts
from kvferry.connector.backends import Lookups
from kvferry.connector.hybrid_scheduler import GroupedSchedulerCore
from kvferry.connector.kv_groups import GroupedLookups, KVGroup
from kvferry.connector.layer_parts import KeySpaceFields, LayerSplitBackend
from kvferry.connector.plan import StepPlan
from kvferry.connector.scheduler_core import FreeLock, Lookup, SchedulerCore, Tables
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.vllm import vllm_versions
from kvferry.integrations.vllm.vllm_versions import SchedulerStep, VllmFacts

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

ServerLookups = ServerBackend | LayerSplitBackend | GroupedLookups  # a scheduler half's own server session's


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


def loads_in_background(settings: ConnectorSettings, groups: Sequence[KVGroup]) -> bool:
    """Whether loads run in the background: as set, but always for a model of several KV cache groups, whose
    failed load vLLM takes only by request and only from a load it waits for (the connector's
    ``get_transfer_results``)."""
    return settings.async_load or len(groups) > 1


def server_lookups(
    settings: ConnectorSettings,
    key_space: KeySpaceFields,
    group_key_spaces: Sequence[KeySpaceFields] | None,
    groups: Sequence[KVGroup],
    *,
    block_size: int,
    check_chunk_size: Callable[[int], None],
) -> ServerLookups:
    """A scheduler half's lookups through a server session of its own, in the key space(s) the worker reported
    (``group_key_spaces``: a hybrid model's, one per group; their lookups share the session). Connected now: a
    server whose chunk size fails ``check_chunk_size`` turns the lookups off (each a miss)."""
    link = ServerLink(settings.server_url, timeout_s=settings.timeout_s, curve=settings.client_curve())
    lookups: ServerLookups
    if group_key_spaces is not None:
        lookups = hybrid_worker.lookups_from_handshake(link, group_key_spaces, groups)
    else:
        lookups = layer_parts.lookups_from_fields(link, key_space, block_size)
    try:
        link.connect(check_chunk_size=check_chunk_size)
    except ValueError as exc:
        log.error("kvferry connector disabled: %s", exc)
        link.close()
    return lookups


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
