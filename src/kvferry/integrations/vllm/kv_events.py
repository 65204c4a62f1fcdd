"""kvferry's blocks in vLLM's KV events: what the scheduler's connector hands vLLM from ``take_events()``.

vLLM's scheduler joins the connector's events with its own each step and publishes them (``--kv-events-config``),
so a router following the engine learns what kvferry holds in the hashes it already knows, vLLM's own
(``request.block_hashes``, which vLLM computes whenever a connector is configured), at vLLM's block size:
``BlockStored`` with medium CPU (kvferry's host pool) or STORAGE (a disk or Redis tier), token ids and parent hash,
``BlockRemoved`` once when kvferry lets the blocks go. Only the scheduler's connector emits (one emitter per
engine, whatever its tensor-parallel size). `kvferry.connector.block_events` keeps the mapping from kvferry's chunk
keys to vLLM's hashes; this module only reads vLLM's objects and writes vLLM's event classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvferry.cache.events import OWNERSHIP
from kvferry.connector.block_events import BlockEvent, BlockEvents, BlocksStored
from kvferry.connector.counters import EventCounters
from kvferry.connector.event_feeds import block_events_for
from kvferry.connector.kv_groups import KVGroup
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.vllm import vllm_versions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)  # a stand-in config may leave it out
    return config is not None and bool(config.enable_kv_cache_events)


# kvferry's group kinds as vLLM's events name them (``KVCacheSpecKind``)
_SPEC_KINDS = {"full": "full_attention", "sliding_window": "sliding_window", "chunked_local": "chunked_local_attention"}


class VllmKVEvents:
    """`BlockEvents` fed with vLLM's requests, giving vLLM's event objects."""

    def __init__(self, events: BlockEvents, groups: Sequence[KVGroup] = ()) -> None:
        """``groups``: a hybrid model's KV cache groups, in the order `BlockEvents` names them: each group's blocks
        are announced in its ``group_idx``, with its spec's kind and window, as vLLM's own events of the model are
        (none: one group, ``group_idx`` 0)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self.events = events
        self.groups = list(groups)
        # vLLM's own events name a block as this does: its hash's bytes, or an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self._external: Callable[[bytes], Any] = maybe_convert_block_hash  # type: ignore[assignment]
        self._stored_fields, self._removed_fields = vllm_versions.block_event_fields()

    def finished(self, request: Request, stored: bool) -> None:
        """vLLM finished ``request``; ``stored``: the connector keeps its blocks for stores of its tokens."""
        if stored:
            computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            self.events.finished(request.request_id, request.all_token_ids[: max(0, computed)], request.block_hashes)

    def stores_done(self, req_ids: set[str]) -> None:
        self.events.stores_done(req_ids)

    def take(self) -> list[KVCacheEvent]:
        return [self._vllm_event(event) for event in self.events.take()]

    def counters(self) -> EventCounters:
        """What the events lost so far (running totals, reported with the connector's other counters)."""
        return EventCounters(events_dropped=self.events.dropped, event_feed_losses=self.events.feed.losses)

    def close(self) -> None:
        self.events.close()

    def _vllm_event(self, event: BlockEvent) -> KVCacheEvent:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        hashes = [self._external(h) for h in event.hashes]
        wanted: dict[str, Any] = {"group_idx": 0, "locality": event.locality, "ownership": OWNERSHIP}
        if event.group is not None:
            group = self.groups[event.group]
            wanted["group_idx"] = group.index
            if isinstance(event, BlocksStored):
                wanted["kv_cache_spec_kind"] = _SPEC_KINDS[group.kind]
                wanted["kv_cache_spec_sliding_window"] = group.window if group.kind == "sliding_window" else None
        if isinstance(event, BlocksStored):
            return BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if event.parent is None else self._external(event.parent),
                token_ids=list(event.tokens), block_size=self.events.block_size, lora_id=None,
                medium=event.medium, lora_name=None, **_known(self._stored_fields, wanted),
            )  # fmt: skip
        return BlockRemoved(block_hashes=hashes, medium=event.medium, **_known(self._removed_fields, wanted))


def _known(fields: frozenset[str], wanted: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``wanted`` that the installed vLLM's event class has."""
    return {name: value for name, value in wanted.items() if name in fields}


def kv_events_for(
    vllm_config: VllmConfig,
    settings: ConnectorSettings,
    lookups: Any,
    groups: Sequence[KVGroup] = (),
    *,
    block_size: int,
    chunk_size: int,
) -> VllmKVEvents | None:
    """The scheduler's KV events of kvferry's blocks, when vLLM publishes KV events: from the cache engine behind
    ``lookups`` (embedded mode) or the server's stream (server mode, ``settings.events_url``); None otherwise.
    ``groups``: a hybrid model's KV cache groups (none: one group), each announced on its own. Not announced: a
    model with Mamba states (kept at some chunk boundaries only: chunks announced past the last would promise a
    hit kvferry cannot load) or whose groups' blocks are not vLLM's ``block_size`` (the hashes vLLM's requests
    carry)."""
    if not events_enabled(vllm_config):
        return None
    if any(g.holds_state or g.block_size != block_size for g in groups):
        log.warning(
            "kvferry: vLLM publishes KV events, but this model's blocks in kvferry are not among them (Mamba "
            "states, or KV cache groups of another block size: docs/events.md)"
        )
        return None
    tags = [g.tag for g in groups]
    events = block_events_for(settings, lookups, block_size=block_size, chunk_size=chunk_size, groups=tags)
    return None if events is None else VllmKVEvents(events, groups)
