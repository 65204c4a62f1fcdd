"""Moving KV between an engine's paged blocks and chunk objects."""

from kvferry.transfer.api import BACKENDS, Direction, check_request, transfer, transfer_async

__all__ = ["BACKENDS", "Direction", "check_request", "transfer", "transfer_async"]
