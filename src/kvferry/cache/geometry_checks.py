"""The KV geometry of a call's KV cache, checked against the key space the call names, and the layout a key space
records for a geometry.

A registered engine passes the same geometry and key space on every call: each pair is checked once, then
recognised (the last pair by identity, others by a weak dictionary), so a call does not re-describe or re-check.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvferry.cache.keys import CacheNamespace
from kvferry.cache.request import dtype_name, layout_name
from kvferry.formats import EngineKVFormat, KVGeometry, with_codec
from kvferry.transfer import geometry_of


class GeometryChecks:
    """The geometries a cache engine's calls pass, and the key spaces each was found to fit. Thread-safe: a race
    only checks a pair twice."""

    def __init__(self, chunk_size: int) -> None:
        self._chunk_size = chunk_size
        # Geometries already checked against a namespace (registered engines pass the same one every call).
        # Weak: a geometry holds the engine's tensors, which must go when their owner unregisters.
        self._matched: weakref.WeakValueDictionary[tuple[int, bytes], KVGeometry] = weakref.WeakValueDictionary()
        self._last_match: tuple[weakref.ref[KVGeometry], CacheNamespace] | None = None

    def namespace(
        self,
        model: str,
        fmt: EngineKVFormat | int,
        paged: Any,
        block_size: int | None,
        geometry: KVGeometry | None,
        codec: str,
        world_size: int,
        rank: int,
        salt: str,
        names: dict[str, str | None],
    ) -> CacheNamespace:
        """`CacheEngine.namespace_for`: the key space of ``model``'s KV cache ``paged`` in ``codec`` (refused where
        it cannot take it); ``names``: `CacheNamespace`'s keyword fields. Ranks holding a slice of the heads share
        the model's key space."""
        geom = with_codec(self.checked(fmt, paged, block_size, geometry), codec)
        if geom.partial_heads:
            world_size, rank = 1, 0
        return CacheNamespace(
            model, dtype_name(geom.dtype), self.layout(geom), world_size, rank, salt, codec, **names
        )  # fmt: skip

    def checked(
        self,
        fmt: EngineKVFormat | int,
        paged: Any,
        block_size: int | None,
        geometry: KVGeometry | None,
        ns: CacheNamespace | None = None,
    ) -> KVGeometry:
        """``geometry``, or ``paged``'s (described now, or recognised if described before); checked against
        ``fmt`` and against ``ns`` when given (then in ``ns``'s codec)."""
        if geometry is None:
            geom = geometry_of(fmt, paged, block_size)
        elif not isinstance(geometry, KVGeometry) or geometry.fmt != EngineKVFormat(fmt):
            raise ValueError(f"geometry={geometry!r} does not describe fmt={EngineKVFormat(fmt).name}")
        else:
            geom = geometry
        if ns is None:
            return geom
        geom = with_codec(geom, ns.codec)  # the same coded geometry for the same geometry
        last = self._last_match  # the pair checked last: one engine calls with the same pair every time
        if last is not None and last[1] is ns and last[0]() is geom:
            return geom
        if self._matched.get((id(geom), ns.digest)) is not geom:
            layout = self.layout(geom)
            kv_dtype = dtype_name(geom.dtype)
            if ns.layout != layout or ns.kv_dtype != kv_dtype:
                raise ValueError(
                    f"namespace was made for layout {ns.layout} / {ns.kv_dtype}, but the KV cache passed gives "
                    f"{layout} / {kv_dtype}: build the namespace with namespace_for() for this KV cache"
                )
            self._matched[(id(geom), ns.digest)] = geom  # an entry dies with geom, so its id is never stale
        self._last_match = (weakref.ref(geom), ns)
        return geom

    def layout(self, geom: KVGeometry) -> str:
        """The key space's layout: the objects' kind and their shape before any codec (which the key space names
        apart), so a process that holds no KV (a scheduler) names it from the model alone."""
        return layout_name(geom.fmt, (geom.kv_size, geom.nl, self._chunk_size, geom.object_width))
