"""The KV cache: token prefixes -> chunk objects in the host pool, with locks, eviction and storage tiers."""

from kvferry.cache.engine import CacheEngine, Located, LookupResult
from kvferry.cache.keys import CacheNamespace, ChunkHasher, token_bytes
from kvferry.cache.layer_split import LayerSplitKV
from kvferry.cache.policies import POLICIES, EvictionPolicy, make_policy

__all__ = [
    "POLICIES",
    "CacheEngine",
    "CacheNamespace",
    "ChunkHasher",
    "EvictionPolicy",
    "LayerSplitKV",
    "Located",
    "LookupResult",
    "make_policy",
    "token_bytes",
]
