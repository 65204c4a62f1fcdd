"""Eviction policies for the host pool: one per file behind ``EvictionPolicy``, chosen by name."""

from kvferry.cache.policies.base import EvictionPolicy
from kvferry.cache.policies.factory import POLICIES, make_policy
from kvferry.cache.policies.lru import LRUPolicy
from kvferry.cache.policies.s3fifo import S3FIFOPolicy

__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "S3FIFOPolicy", "make_policy"]
