"""The worker half's set-up for a hybrid model: one backend per KV cache group, one `WorkerSide` over them all.

Each group's layers are KV of their own (recognised apart: a group's layers share a format and shape), in a key
space named by the group (`KVGroup.tag`). In embedded mode the groups share one cache engine; in server mode
each group registers its KV in a session of its own, while a scheduler half in another process looks every group
up through one session (`lookups_from_handshake`). A Mamba group's backend is a `StateBackend` over its state
views (`worker_backend.make_state_backend`); its stores end before the next forward pass, as a windowed group's
do. Under tensor parallelism each rank stores its own shard of a state, so a scheduler's lookup of a state asks
for every rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvferry.cache import CacheEngine
from kvferry.connector.backends import Backend, EmbeddedBackend
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.kv_groups import GroupedLookups, KVGroup
from kvferry.connector.layer_parts import (
    KeySpaceFields,
    LayerSplitBackend,
    engine_of,
    exact_positions,
    key_space_fields,
    lookups_from_fields,
    make_backend,
)
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.state_groups import StateBackend
from kvferry.connector.window_groups import WindowedBackend
from kvferry.connector.worker_backend import StateViews, make_state_backend, make_worker_backend
from kvferry.connector.worker_side import WorkerSide


@dataclass(frozen=True)
class HybridWorker:
    lookups: GroupedLookups  # what the scheduler half in this process looks up through
    key_spaces: list[KeySpaceFields]  # each group's, for a scheduler half in another process
    worker: WorkerSide


def start_hybrid_worker(
    settings: ConnectorSettings,
    kvs: Sequence[EngineKV | StateViews],
    groups: Sequence[KVGroup],
    *,
    model: str,
    name: str,
    after_load_hook: Callable[..., None] | None = None,
    model_layers: Sequence[str] = (),
    demote_superseded: bool = True,
    tp: tuple[int, int] = (0, 1),
    engine: CacheEngine | None = None,
) -> HybridWorker:
    """The backends and worker half of a model whose group ``groups[i]`` holds the KV ``kvs[i]`` (a Mamba group's:
    its `StateViews`, or an `EngineKV` of them cut already, embedded mode); ``model_layers``: the model's attention
    layers in order, which the settings' exact layers count (`layer_parts`). ``demote_superseded``: chunks and
    states a newer boundary supersedes go first when the cache evicts (`window_groups`; False: the plain eviction
    order, for comparison). ``tp``: this worker's (rank, size) in its tensor-parallel group. ``engine``: embedded
    mode's cache engine to register into (None: a new one)."""
    exact = settings.objects_exact_layers()
    made: list[EmbeddedBackend | ServerBackend | LayerSplitBackend] = []
    try:
        for kv, group in zip(kvs, groups, strict=True):
            engine = engine_of(made[0]) if made else engine
            size, tag = group.block_size, group.tag
            if isinstance(kv, StateViews):
                made.append(
                    make_state_backend(
                        settings, kv, model=model, block_size=size, name=name, group_tag=tag, engine=engine, tp=tp
                    )
                )
            elif group.holds_state:  # a state is opaque bytes, not KV per token: kept exact whatever the codec
                made.append(
                    make_worker_backend(
                        settings,
                        kv,
                        model=model,
                        block_size=size,
                        name=name,
                        group_tag=tag,
                        engine=engine,
                        codec="none",
                    )
                )
            else:
                positions = exact_positions(kv, model_layers, exact) if exact else []
                made.append(
                    make_backend(
                        settings, kv, exact_layers=positions, model=model, block_size=size, name=name, group_tag=tag,
                        engine=engine,
                    )
                )  # fmt: skip
    except BaseException:
        for backend in made:
            backend.close()
        raise
    key_spaces = [
        _every_rank(key_space_fields(backend), tp[1]) if group.holds_state else key_space_fields(backend)
        for backend, group in zip(made, groups, strict=True)
    ]
    full = [i for i, group in enumerate(groups) if not group.windowed and not group.holds_state]
    counted = full[0] if full else 0  # counters count the tokens of a group that holds every token
    hook, counted_kv = after_load_hook, kvs[counted]
    after_load: Callable[[list[int]], None] | None = None
    if hook is not None and isinstance(counted_kv, EngineKV):
        loaded_kv, run = counted_kv, hook

        def hooked(ids: list[int]) -> None:
            run(loaded_kv.layers, list(loaded_kv.kernel_block_ids(ids)))

        after_load = hooked
    backends = [_group_backend(backend, group, demote_superseded) for backend, group in zip(made, groups, strict=True)]
    worker = WorkerSide(
        backends,
        block_size=[group.block_size for group in groups],
        after_load=after_load,
        counted_group=counted,
        windowed_groups=[i for i, group in enumerate(groups) if group.windowed or group.holds_state],
    )
    return HybridWorker(GroupedLookups(backends, groups), key_spaces, worker)


def _group_backend(backend: Backend, group: KVGroup, demote_superseded: bool) -> Backend:
    if group.holds_state:
        return StateBackend(backend, demote_superseded=demote_superseded)
    if group.windowed:
        return WindowedBackend(backend, group, demote_superseded=demote_superseded)
    return backend


def _every_rank(fields: KeySpaceFields, world_size: int) -> KeySpaceFields:
    """A state group's key space on each rank of the tensor-parallel group (its own key space without one)."""
    if world_size == 1 or not isinstance(fields, dict):
        return fields
    return [{**fields, "rank": rank} for rank in range(world_size)]


def lookups_from_handshake(
    link: ServerLink, key_spaces: Sequence[KeySpaceFields], groups: Sequence[KVGroup]
) -> GroupedLookups:
    """A scheduler half's lookups, through ``link``, for the groups whose key spaces a worker reported: a windowed
    group's from its window on, a Mamba group's the state at a boundary on every rank (each rank's a part that
    must be there, as a layer split's)."""
    lookups: list[Backend] = []
    for fields, group in zip(key_spaces, groups, strict=True):
        found = lookups_from_fields(link, fields)
        lookups.append(StateBackend(found) if group.holds_state else found)
    return GroupedLookups(lookups, groups)


def describe(
    settings: ConnectorSettings, kvs: Sequence[EngineKV | StateViews], groups: Sequence[KVGroup], chunk: int | None
) -> str:
    """The connector's start-up line for a hybrid model."""
    mode = f"server mode ({settings.server_url})" if settings.mode == "server" else "embedded mode"
    size = chunk if chunk is not None else "the server's (not reached yet)"
    listed = ", ".join(f"{g.tag} ({len(g.layer_names)} layers, block size {g.block_size})" for g in groups)
    attention = [kv for kv, group in zip(kvs, groups, strict=True) if not group.holds_state]
    kv = attention[0] if attention and isinstance(attention[0], EngineKV) else None
    held = f"{kv.kv_dtype} KV, vLLM order {kv.order} as {kv.fmt.name}, " if kv is not None else ""
    return f"kvferry connector active: {mode}, hybrid model: {listed}; {held}chunk size {size}"
