"""An engine's KV with layers kept exact beside a codec, in one cache (`kvferry.formats.layer_split`).

`LayerSplitKV` registers each part of the split as KV of its own: a key space of its own (the split's tag its
``split``, its part's codec), the part's layers as views of the engine's tensors, a geometry described once. Its calls
go to every part with the same tokens and block ids; a hit, a store and a retrieve count the tokens every part
holds (the fewest), so an engine never takes a prefix one part lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.cache.engine import CacheEngine
from kvferry.cache.keys import CacheNamespace, TokenIds
from kvferry.formats import EngineKVFormat, KVGeometry, LayerPart, describe, layer_split, select_layers
from kvferry.transfer.block_ids import BlockIds


@dataclass(frozen=True)
class KVPart:
    """One part's layers (views of the engine's tensors), their geometry and their key space."""

    part: LayerPart
    paged: Any
    geometry: KVGeometry
    namespace: CacheNamespace


class LayerSplitKV:
    """``paged`` (format ``fmt``) of ``model`` in ``cache``: layers ``exact_layers`` (positions, negative from the
    last; default the config's ``cache.exact_layers``) keep the engine's bytes, the others are in ``codec``
    (default the config's ``cache.codec``). ValueError saying why where a part's KV cannot take its codec."""

    def __init__(
        self,
        cache: CacheEngine,
        model: str,
        fmt: EngineKVFormat | int,
        paged: Any,
        *,
        codec: str | None = None,
        exact_layers: Sequence[int] | None = None,
        salt: str = "",
        block_size: int | None = None,
    ) -> None:
        self.cache = cache
        self.fmt = EngineKVFormat(fmt)
        whole = describe(self.fmt, paged, block_size)
        exact = cache.config.cache.exact_layers if exact_layers is None else exact_layers
        self.split = layer_split(whole.nl, cache.codec if codec is None else codec, exact)
        parts = []
        for part in self.split.parts:
            sub = paged if len(self.split.parts) == 1 else select_layers(self.fmt, paged, part.layers)
            geometry = describe(self.fmt, sub, block_size)
            namespace = cache.namespace_for(
                model,
                self.fmt,
                sub,
                salt=salt,
                split=self.split.tag or None,
                block_size=block_size,
                geometry=geometry,
                codec=part.codec,
            )
            parts.append(KVPart(part, sub, geometry, namespace))
        self.parts = tuple(parts)

    def lookup(self, tokens: TokenIds) -> int:
        """Prefix tokens every part holds in the host pool."""
        return min(self.cache.lookup(tokens, namespace=p.namespace) for p in self.parts)

    def store(self, tokens: TokenIds, block_ids: BlockIds, **options: Any) -> int:
        """Every part's `CacheEngine.store` (``options``: its own); the tokens every part stored."""
        return min(self._call(self.cache.store, p, tokens, block_ids, options) for p in self.parts)

    def retrieve(self, tokens: TokenIds, block_ids: BlockIds, **options: Any) -> int:
        """Every part's `CacheEngine.retrieve`; the tokens every part wrote (blocks after them may hold a part's
        KV and others' old bytes: the engine recomputes them)."""
        return min(self._call(self.cache.retrieve, p, tokens, block_ids, options) for p in self.parts)

    def _call(self, method: Any, part: KVPart, tokens: TokenIds, block_ids: BlockIds, options: dict[str, Any]) -> int:
        return int(
            method(tokens, part.paged, block_ids, self.fmt, namespace=part.namespace, geometry=part.geometry, **options)
        )
