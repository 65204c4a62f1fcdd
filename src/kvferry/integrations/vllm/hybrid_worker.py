"""The worker half's set-up for a hybrid model: one backend per KV cache group, one `WorkerSide` over them all.

Each group's layers are KV of their own (recognised apart: a group's layers share a format and shape), in a key
space named by the group (`KVGroup.tag`). In embedded mode the groups share one cache engine; in server mode
each group registers its KV in a session of its own, while a scheduler half in another process looks every group
up through one session (`lookups_from_handshake`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvferry.integrations.vllm.backends import EmbeddedBackend, ServerBackend
from kvferry.integrations.vllm.kv_groups import GroupedLookups, KVGroup
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
) -> HybridWorker:
    """The backends and worker half of a model whose group ``groups[i]`` holds the KV ``kvs[i]``; ``model_layers``:
    the model's attention layers in order, which the settings' exact layers count (`layer_parts`)."""
    exact = settings.objects_exact_layers()
    made: list[EmbeddedBackend | ServerBackend | LayerSplitBackend] = []
    try:
        for kv, group in zip(kvs, groups, strict=True):
            made.append(
                make_backend(
                    settings,
                    kv,
                    exact_layers=exact_positions(kv, model_layers, exact) if exact else [],
                    model=model,
                    block_size=group.block_size,
                    name=name,
                    group_tag=group.tag,
                    engine=engine_of(made[0]) if made else None,
                )
            )
    except BaseException:
        for backend in made:
            backend.close()
        raise
    key_spaces = [key_space_fields(backend) for backend in made]
    full = [i for i, group in enumerate(groups) if not group.windowed]
    counted = full[0] if full else 0  # counters count the tokens of a group that holds every token
    hook = after_load_hook
    worker = WorkerSide(
        made,
        block_size=[group.block_size for group in groups],
        after_load=None
        if hook is None
        else lambda ids: hook(kvs[counted].layers, list(kvs[counted].kernel_block_ids(ids))),
        counted_group=counted,
        windowed_groups=[i for i, group in enumerate(groups) if group.windowed],
    )
    return HybridWorker(GroupedLookups(made), key_spaces, worker)


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
