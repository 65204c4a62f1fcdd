"""Host memory pool: chunk objects carved as tensor views out of one aligned, pinned-when-possible slab."""

from kvferry.memory.host_pool import Allocation, HostPool, PoolFullError

__all__ = ["Allocation", "HostPool", "PoolFullError"]
