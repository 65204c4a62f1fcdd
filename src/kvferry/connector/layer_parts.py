"""Layers kept exact beside a codec, in the connector: each layer part of a model's KV is a backend of its own.

A split (`kvferry.formats.layer_split`) cuts the engine's KV into parts, each registered as KV of its own as a
hybrid model's groups are: its own key space (the split's tag, its codec), in embedded mode in the one cache engine,
in server mode a registration (and a session) of its own. The parts share vLLM's block table, so
`LayerSplitBackend` is one backend to the scheduler and worker halves: a hit is the longest prefix every part holds
(a tail included: every store writes the same tail to each part), a load or store goes to every part and counts the
tokens every part moved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvferry.cache import CacheEngine
from kvferry.cache.keys import TokenIds
from kvferry.connector.backends import Backend, EmbeddedBackend, KeySpace
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.kv_groups import GroupedLookups
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import make_worker_backend
from kvferry.connector.worker_side import WorkerSide
from kvferry.formats import layer_split, select_layers
from kvferry.futures import when_all

# What a worker tells a scheduler half in another process: one key space's fields, or a split's, one per part.
KeySpaceFields = dict[str, Any] | list[dict[str, Any]]


class LayerSplitBackend(GroupedLookups):
    """The backends of a model's layer parts (over one block table) as one backend."""

    def __init__(self, parts: Sequence[Backend]) -> None:
        super().__init__(parts, whole_chunks=False)

    def retrieve_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return _fewest([part.retrieve_async(tokens, block_ids, skip_prefix_tokens) for part in self.backends])

    def retrieve(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> int:
        return self.retrieve_async(tokens, block_ids, skip_prefix_tokens).result()

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return _fewest([part.store_async(tokens, block_ids, skip_prefix_tokens) for part in self.backends])

    def demote(self, tokens: TokenIds, chunks: range) -> None:
        for part in self.backends:
            part.demote(tokens, chunks)


def make_backend(
    settings: ConnectorSettings,
    kv: EngineKV,
    *,
    exact_layers: Sequence[int],
    model: str,
    block_size: int,
    name: str,
    on_chunk_size: Callable[[int], None] | None = None,
    group_tag: str = "",
    engine: CacheEngine | None = None,
) -> EmbeddedBackend | ServerBackend | LayerSplitBackend:
    """`make_worker_backend`'s backend for ``kv``, whose layers at positions ``exact_layers`` keep their exact bytes
    beside the settings' codec: one backend per part of the split, or the one backend when nothing is split."""
    codec = settings.objects_codec()  # None in server mode: the server's cache.codec
    parts: list[tuple[EngineKV, str | None]] = [(kv, codec)]
    tag = ""
    if exact_layers:
        assert codec is not None  # server mode's exact layers come with a codec (`ConnectorSettings`)
        split = layer_split(len(kv.layers), codec, exact_layers)
        parts = [(part_kv(kv, p.layers) if len(split.parts) > 1 else kv, p.codec) for p in split.parts]
        tag = split.tag
    made: list[EmbeddedBackend | ServerBackend] = []
    try:
        for part, part_codec in parts:
            shared = made[0].engine if made and isinstance(made[0], EmbeddedBackend) else engine
            made.append(
                make_worker_backend(
                    settings,
                    part,
                    model=model,
                    block_size=block_size,
                    name=name,
                    on_chunk_size=on_chunk_size,
                    group_tag=group_tag,
                    engine=shared,
                    codec=part_codec,
                    split_tag=tag,
                )
            )
    except BaseException:
        for backend in made:
            backend.close()
        raise
    return made[0] if len(made) == 1 else LayerSplitBackend(made)


def engine_of(backend: Any) -> CacheEngine | None:
    """The cache engine of an embedded backend (of its first part, for a split; of its first group, for a hybrid
    model's, whose groups share it; under a window's or a Mamba state's backend); None in server mode."""
    if isinstance(backend, EmbeddedBackend):
        return backend.engine
    inner = [*getattr(backend, "backends", ()), getattr(backend, "backend", None)]
    return engine_of(inner[0]) if inner[0] is not None else None


def part_kv(kv: EngineKV, layers: Sequence[int]) -> EngineKV:
    """``kv`` restricted to the layers at ``layers`` (views of the same tensors)."""
    return dataclasses.replace(
        kv,
        paged=select_layers(kv.fmt, kv.paged, layers),
        layers=[kv.layers[i] for i in layers],
        layer_names=[kv.layer_names[i] for i in layers],
    )


@dataclasses.dataclass
class StartedWorker:
    """One KV cache group's worker half, as `start_worker` made it."""

    backend: EmbeddedBackend | ServerBackend | LayerSplitBackend  # what a scheduler half in this process looks up
    key_space: KeySpaceFields  # for a scheduler half in another process
    worker: WorkerSide
    exact_layers: list[int]  # positions of the layers kept exact beside the codec


def start_worker(
    settings: ConnectorSettings, kv: EngineKV, *, model: str, block_size: int, name: str, engine: CacheEngine | None
) -> StartedWorker:
    """The backend and worker half of an engine's one KV cache group ``kv`` (``engine``: embedded mode's cache engine
    to register into; None: a new one). The settings' load hook sees every loaded block's layers."""
    exact = exact_positions(kv, kv.layer_names, settings.objects_exact_layers())
    made = make_backend(settings, kv, exact_layers=exact, model=model, block_size=block_size, name=name, engine=engine)
    hook = settings.load_after_load_hook()
    after_load = None if hook is None else lambda ids: hook(kv.layers, list(kv.kernel_block_ids(ids)))
    worker = WorkerSide(made, block_size=block_size, after_load=after_load)
    return StartedWorker(made, key_space_fields(made), worker, exact)


def exact_positions(kv: EngineKV, model_layers: Sequence[str], exact_layers: Sequence[int]) -> list[int]:
    """Positions in ``kv`` of the model's layers ``exact_layers`` (positions in ``model_layers``, every attention
    layer of the model in order; negative from the last). ValueError for one the model does not have."""
    n = len(model_layers)
    bad = [i for i in exact_layers if not -n <= i < n]
    if bad:
        raise ValueError(f"KvferryConnector: exact_layers {bad} are not attention layers of the model (0..{n - 1})")
    names = {model_layers[i] for i in exact_layers}
    return [i for i, layer_name in enumerate(kv.layer_names) if layer_name in names]


def key_space_fields(backend: Backend | LayerSplitBackend) -> KeySpaceFields:
    """What a scheduler half in another process looks ``backend``'s KV up with (`lookups_from_fields`)."""
    if isinstance(backend, LayerSplitBackend):
        return [_fields(part) for part in backend.backends]
    return _fields(backend)


def lookups_from_fields(
    link: ServerLink, fields: KeySpaceFields, block_size: int | None = None, *, locate: bool = False
) -> ServerBackend | LayerSplitBackend:
    """A scheduler half's lookups through ``link`` in the key space(s) a worker reported; ``locate``: they locate
    their hits for the worker's direct loads (one key space's only: a split's parts' hits are joined)."""
    if isinstance(fields, list):
        return LayerSplitBackend([ServerBackend(link, KeySpace(**part), block_size=block_size) for part in fields])
    return ServerBackend(link, KeySpace(**fields), block_size=block_size, locate_hits=locate)


def _fields(backend: Any) -> dict[str, Any]:
    key_space = backend.key_space
    assert isinstance(key_space, KeySpace), "a worker's backend knows its key space"
    return key_space.fields()


def _fewest(futures: list[Future[int]]) -> Future[int]:
    """A future of the fewest tokens of ``futures`` once all are done; the first failure fails it."""
    return when_all(futures, lambda: min(future.result() for future in futures))
