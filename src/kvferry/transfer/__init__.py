"""Moving KV between an engine's paged blocks and chunk objects."""

from kvferry.transfer.api import (
    BACKENDS,
    configure_gpu,
    forget_plans,
    geometry_of,
    ordered_after,
    transfer,
    transfer_async,
)
from kvferry.transfer.request import Direction, check_request

__all__ = [
    "BACKENDS",
    "Direction",
    "check_request",
    "configure_gpu",
    "forget_plans",
    "geometry_of",
    "ordered_after",
    "transfer",
    "transfer_async",
]
