"""What differs between the vLLM versions the connector runs on, read once from the installed vLLM's classes.

kvferry's connector is tested with vLLM 0.32, 0.33 and 0.34 (`TESTED`). Where they differ for it, this module
is the one place that knows: `VllmFacts` holds what feature detection (the fields of vLLM's classes, never its
version string) found, and `scheduled_requests` reads a scheduler step the same way on each (`step_facts`: the
step as the connector's scheduler core plans it):

- 0.32, 0.33: a preempted request that resumes is listed among the step's running ("cached") requests, named in
  ``CachedRequestData.resumed_req_ids`` (its block ids then replace its table instead of extending it), with its
  tokens in ``CachedRequestData.all_token_ids``; with vLLM's V2 model runner it is sent among the new requests.
- 0.34: those fields are gone; a resumed request is always sent again among the new requests, with its
  ``prefill_token_ids`` (prompt and generated tokens). Only the connector knows it was preempted before.

Other differences need nothing of the connector: ``ModelRunnerOutput.req_id_to_index`` (gone in 0.34) and
``KVCacheSpec.is_draft`` (new in 0.33) are not read; ``CacheHitSource`` (a ``StrEnum`` in 0.34) is used by
member; ``may_load_async`` and ``supports_lookahead_block_hashes`` (new in 0.34) keep vLLM's defaults (no load
admitted past a full batch under ``--max-num-inflight-kv-loads``; no lookahead hashing); a prompt's token ids
(an int32 buffer in 0.34) are converted once into a uint32 array (`token_array`) wherever they are kept.

KV events (`kv_events`): ``BlockStored`` gained ``lookahead_token_ids`` in 0.33 (left at its default); the
optional fields kvferry sets (``group_idx``, ``locality``, ``ownership``) are set where the installed vLLM's
classes have them (`block_event_fields`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvferry.connector.scheduler_core import Scheduled, StepFacts

log = logging.getLogger(__name__)

TESTED = ("0.32", "0.33", "0.34")


# Read-only properties, not attributes: vLLM's dataclasses then match with their own (narrower) field types.
class NewRequest(Protocol):
    @property
    def req_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def block_ids(self) -> tuple[list[int], ...]: ...
    @property
    def num_computed_tokens(self) -> int: ...


class CachedRequests(Protocol):
    """vLLM's ``CachedRequestData``, less what only some versions have (read through `VllmFacts`)."""

    @property
    def req_ids(self) -> list[str]: ...
    @property
    def new_block_ids(self) -> list[tuple[list[int], ...] | None]: ...
    @property
    def num_computed_tokens(self) -> list[int]: ...


class SchedulerStep(Protocol):
    """The fields of vLLM's ``SchedulerOutput`` the connector reads."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequest]: ...
    @property
    def scheduled_cached_reqs(self) -> CachedRequests: ...
    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...
    @property
    def preempted_req_ids(self) -> set[str] | None: ...


@dataclass(frozen=True)
class VllmFacts:
    """What the connector needs to know of a vLLM: its version (for messages) and how its steps name resumes."""

    version: str | None  # None: vLLM is not installed
    resumed_among_cached: bool  # ``CachedRequestData.resumed_req_ids`` and ``.all_token_ids`` exist (0.32, 0.33)

    @property
    def tested(self) -> bool:
        return self.version is not None and ".".join(self.version.split(".")[:2]) in TESTED


@functools.cache
def installed() -> VllmFacts:
    """The facts of the vLLM this process imports (found once)."""
    try:
        import vllm
        from vllm.v1.core.sched.output import CachedRequestData
    except ImportError:
        return VllmFacts(version=None, resumed_among_cached=False)
    fields = {f.name for f in dataclasses.fields(CachedRequestData)}
    return VllmFacts(
        version=str(getattr(vllm, "__version__", "unknown")),
        resumed_among_cached={"resumed_req_ids", "all_token_ids"} <= fields,
    )


@functools.cache
def block_event_fields() -> tuple[frozenset[str], frozenset[str]]:
    """The fields of the installed vLLM's ``BlockStored`` and ``BlockRemoved`` events."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    return frozenset(BlockStored.__struct_fields__), frozenset(BlockRemoved.__struct_fields__)


@functools.cache
def warn_if_untested() -> VllmFacts:
    """The installed vLLM's facts; one warning per process when kvferry was not tested with its version."""
    facts = installed()
    if facts.version is not None and not facts.tested:
        log.warning(
            "kvferry: vLLM %s is not a version kvferry's connector was tested with (%s); it runs as on the nearest "
            "one, but a change in vLLM's connector interface may break it",
            facts.version,
            ", ".join(TESTED),
        )
    return facts


def scheduled_requests(
    step: SchedulerStep, facts: VllmFacts, preempted_before: Callable[[str], bool]
) -> list[Scheduled]:
    """The step's new, resumed and running requests. ``preempted_before(req_id)``: whether the connector saw the
    request preempted since it last ran (what tells a resume sent among the new requests from a new request)."""
    out = []
    for new in step.scheduled_new_reqs:
        resumed = preempted_before(new.req_id)
        prefill: Sequence[int] | None = getattr(new, "prefill_token_ids", None) if resumed else None
        out.append(
            Scheduled(new.req_id, new.num_computed_tokens, new.block_ids, True, resumed, new.prompt_token_ids, prefill)
        )
    cached: Any = step.scheduled_cached_reqs
    resumed_ids: set[str] = cached.resumed_req_ids if facts.resumed_among_cached else set()
    all_tokens: Mapping[str, Sequence[int]] = cached.all_token_ids if facts.resumed_among_cached else {}
    for i, req_id in enumerate(cached.req_ids):
        resumed = req_id in resumed_ids
        tokens = all_tokens.get(req_id) if resumed else None
        out.append(Scheduled(req_id, cached.num_computed_tokens[i], cached.new_block_ids[i], resumed, resumed,
                             tokens=tokens))  # fmt: skip
    return out


def step_facts(step: SchedulerStep, facts: VllmFacts) -> StepFacts:
    """The step as the connector's scheduler core plans it: its requests (`scheduled_requests`), preemptions, and
    the Mamba states it hands over (``kv_connector_block_state.boundary_state_offloads``, where vLLM has it)."""
    state = getattr(step, "kv_connector_block_state", None)
    offers: Mapping[str, Sequence[tuple[int, int, int]]] = getattr(state, "boundary_state_offloads", None) or {}
    requests = functools.partial(scheduled_requests, step, facts)
    return StepFacts(requests, step.num_scheduled_tokens, step.preempted_req_ids or (), offers)
