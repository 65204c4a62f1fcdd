"""kvferry: KV-cache offload and sharing for LLM serving engines."""

from kvferry import transfer  # the package, callable as the operation: kvferry.transfer(paged, objects, ...)
from kvferry.formats import EngineKVFormat, KVGeometry, describe, object_dtype, object_shape
from kvferry.transfer import Direction, transfer_async

__version__ = "0.1.0"


__all__ = [
    "Direction",
    "EngineKVFormat",
    "KVGeometry",
    "describe",
    "object_dtype",
    "object_shape",
    "transfer",
    "transfer_async",
]
