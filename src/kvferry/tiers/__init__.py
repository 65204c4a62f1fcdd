"""Storage tiers below the host pool: local disk, Redis/Valkey (standalone or cluster) and Mooncake Store.

tier = make_tier("disk:/var/cache/kvferry?size=200GB")   # or redis://host:6379, redis+cluster://h:7000
tier.put(key, tensor)            -> Future[bool]
tier.get(key, pool.try_alloc)    -> Future[Tensor | None]   (verified, or a miss)
"""

from kvferry.tiers.base import Alloc, Free, Tier, TierFull, TierUnavailable
from kvferry.tiers.disk import DiskTier
from kvferry.tiers.header import FORMAT_VERSION, CorruptObject
from kvferry.tiers.mooncake_tier import MooncakeTier
from kvferry.tiers.redis_tier import RedisTier
from kvferry.tiers.url import TierURLError, make_tier, parse_duration, parse_size, parse_tier_url

__all__ = [
    "FORMAT_VERSION",
    "Alloc",
    "CorruptObject",
    "DiskTier",
    "Free",
    "MooncakeTier",
    "RedisTier",
    "Tier",
    "TierFull",
    "TierURLError",
    "TierUnavailable",
    "make_tier",
    "parse_duration",
    "parse_size",
    "parse_tier_url",
]
