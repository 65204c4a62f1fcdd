"""Moving KV between an engine's paged blocks and chunk objects.

The package is also the operation: ``kvferry.transfer(paged, objects, ...)`` is `transfer`, and the package's other
names (``kvferry.transfer.configure_gpu``, ``.ordered_after``, ...) are reached through the same name.
"""

import sys
import types
from typing import Any

from kvferry.transfer.api import (
    BACKENDS,
    configure_gpu,
    forget_plans,
    geometry_of,
    ordered_after,
    ordering_event,
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
    "ordering_event",
    "transfer",
    "transfer_async",
]


class _Operation(types.ModuleType):
    """This package, callable as its `transfer`."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return transfer(*args, **kwargs)


sys.modules[__name__].__class__ = _Operation
