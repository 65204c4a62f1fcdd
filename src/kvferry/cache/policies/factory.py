"""Eviction policies by their config name."""

from __future__ import annotations

from kvferry.cache.policies.base import EvictionPolicy
from kvferry.cache.policies.lru import LRUPolicy
from kvferry.cache.policies.s3fifo import S3FIFOPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, S3FIFOPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    """A new, empty policy named ``name`` (one of ``POLICIES``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"eviction policy {name!r} is unknown; expected one of {sorted(POLICIES)}") from None
    return cls()
