"""The worker half's set-up for a hybrid model: one backend per KV cache group, one `WorkerSide` over them all.

Each group's layers are KV of their own (recognised apart: a group's layers share a format and shape), in a key
space named by the group (`KVGroup.tag`). In embedded mode the groups share one cache engine; in server mode
each group registers its KV in a session of its own, while a scheduler half in another process looks every group
up through one session (`lookups_from_handshake`). A Mamba group's backend is a `StateBackend` over its state
views (`state_groups.state_kv`); its stores end before the next forward pass, as a windowed group's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvferry.integrations.vllm.backends import Backend, EmbeddedBackend, ServerBackend, make_worker_backend
from kvferry.integrations.vllm.kv_groups import GroupedLookups, KVGroup, UnsupportedGroups
from kvferry.integrations.vllm.kv_layout import EngineKV
from kvferry.integrations.vllm.layer_parts import (
    KeySpaceFields,
    LayerSplitBackend,
    engine_of,
    exact_positions,
    key_space_fields,
    lookups_from_fields,
    make_backend,
)
from kvferry.integrations.vllm.server_link import ServerLink
from kvferry.integrations.vllm.settings import ConnectorSettings
from kvferry.integrations.vllm.state_groups import StateBackend
from kvferry.integrations.vllm.window_groups import WindowedBackend
from kvferry.integrations.vllm.worker_side import WorkerSide


@dataclass(frozen=True)
class HybridWorker:
    lookups: GroupedLookups  # what the scheduler half in this process looks up through
    key_spaces: list[KeySpaceFields]  # each group's, for a scheduler half in another process
    worker: WorkerSide


def start_hybrid_worker(
    settings: ConnectorSettings,
    kvs: Sequence[EngineKV],
    groups: Sequence[KVGroup],
    *,
    model: str,
    name: str,
    after_load_hook: Callable[..., None] | None = None,
    model_layers: Sequence[str] = (),
    demote_superseded: bool = True,
) -> HybridWorker:
    """The backends and worker half of a model whose group ``groups[i]`` holds the KV ``kvs[i]``; ``model_layers``:
    the model's attention layers in order, which the settings' exact layers count (`layer_parts`).
    ``demote_superseded``: chunks and states a newer boundary supersedes go first when the cache evicts
    (`window_groups`; False: the plain eviction order, for comparison)."""
    exact = settings.objects_exact_layers()
    made: list[EmbeddedBackend | ServerBackend | LayerSplitBackend] = []
    try:
        for kv, group in zip(kvs, groups, strict=True):
            engine = engine_of(made[0]) if made else None
            if group.holds_state:
                if settings.mode == "server":
                    raise UnsupportedGroups(
                        f"{group.tag}: kvferry keeps Mamba states in embedded mode only (a state object's rows "
                        "depend on the chunk size, which a server tells only once connected)"
                    )
                # A state is opaque bytes, not KV per token: kept exact whatever the codec.
                made.append(
                    make_worker_backend(
                        settings,
                        kv,
                        model=model,
                        block_size=group.block_size,
                        name=name,
                        group_tag=group.tag,
                        engine=engine,
                        codec="none",
                    )
                )
                continue
            made.append(
                make_backend(
                    settings,
                    kv,
                    exact_layers=exact_positions(kv, model_layers, exact) if exact else [],
                    model=model,
                    block_size=group.block_size,
                    name=name,
                    group_tag=group.tag,
                    engine=engine,
                )
            )
    except BaseException:
        for backend in made:
            backend.close()
        raise
    key_spaces = [key_space_fields(backend) for backend in made]
    full = [i for i, group in enumerate(groups) if not group.windowed and not group.holds_state]
    counted = full[0] if full else 0  # counters count the tokens of a group that holds every token
    hook = after_load_hook
    backends = [_group_backend(backend, group, demote_superseded) for backend, group in zip(made, groups, strict=True)]
    worker = WorkerSide(
        backends,
        block_size=[group.block_size for group in groups],
        after_load=None
        if hook is None
        else lambda ids: hook(kvs[counted].layers, list(kvs[counted].kernel_block_ids(ids))),
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


def lookups_from_handshake(link: ServerLink, key_spaces: Sequence[KeySpaceFields]) -> GroupedLookups:
    """A scheduler half's lookups, through ``link``, for the groups whose key spaces a worker reported."""
    return GroupedLookups([lookups_from_fields(link, fields) for fields in key_spaces])


def describe(settings: ConnectorSettings, kvs: Sequence[EngineKV], groups: Sequence[KVGroup], chunk: int | None) -> str:
    """The connector's start-up line for a hybrid model."""
    mode = f"server mode ({settings.server_url})" if settings.mode == "server" else "embedded mode"
    size = chunk if chunk is not None else "the server's (not reached yet)"
    listed = ", ".join(f"{g.tag} ({len(g.layer_names)} layers, block size {g.block_size})" for g in groups)
    return (
        f"kvferry connector active: {mode}, hybrid model: {listed}; {kvs[0].kv_dtype} KV, vLLM order {kvs[0].order} "
        f"as {kvs[0].fmt.name}, chunk size {size}"
    )
