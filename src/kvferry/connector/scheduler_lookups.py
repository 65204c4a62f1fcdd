"""A connector's scheduler half, engine-neutral set-up: whether its loads run in the background, and its lookups
through a server session of its own when the worker half lives in another process (the key space the worker
reported in its handshake)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvferry.connector import hybrid_worker, layer_parts
from kvferry.connector.kv_groups import GroupedLookups, KVGroup
from kvferry.connector.layer_parts import KeySpaceFields, LayerSplitBackend
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings

log = logging.getLogger(__name__)

ServerLookups = ServerBackend | LayerSplitBackend | GroupedLookups  # a scheduler half's own server session's


def loads_in_background(settings: ConnectorSettings, groups: Sequence[KVGroup]) -> bool:
    """Whether loads run in the background: as set, but always for a model of several KV cache groups, whose
    failed load an engine may take only by request and only from a load it waits for (vLLM's
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
        lookups = layer_parts.lookups_from_fields(link, key_space, block_size, locate=settings.direct_loads)
    try:
        link.connect(check_chunk_size=check_chunk_size)
    except ValueError as exc:
        log.error("kvferry connector disabled: %s", exc)
        link.close()
    return lookups
