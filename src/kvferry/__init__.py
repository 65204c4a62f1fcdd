"""kvferry: KV-cache offload and sharing for LLM serving engines."""

from kvferry.formats import EngineKVFormat, KVGeometry, describe, object_shape
from kvferry.transfer import Direction, transfer, transfer_async

__version__ = "0.1.0"


def object_dtype(paged: object) -> "torch.dtype":  # noqa: F821 (resolved lazily for a light import)
    """The dtype chunk objects use: the engine's KV dtype (the first tensor found in `paged`)."""
    node = paged
    while isinstance(node, (list, tuple)):
        node = node[0]
    return node.dtype  # type: ignore[attr-defined]


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
