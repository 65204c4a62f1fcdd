"""The Mooncake Store client as the Mooncake tier uses it: setup, what its status codes mean, calls with a deadline.

`MooncakeDistributedStore` (the ``mooncake-transfer-engine`` wheels, extra ``kvferry[mooncake]``) reports every
outcome as an int: a byte count or 0 for success, a negative `ErrorCode` otherwise. Its ``get`` returns empty bytes
both on a miss and on a failed call, so the tier never uses it; the ``*_into`` / ``*_from`` calls say which. Once
the master is gone each call blocks for ~4.5 s in the client before failing, which is why calls on a caller's
thread go through `Deadline`.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvferry.tiers.base import TierFull, TierUnavailable

T = TypeVar("T")

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that the tier tells apart.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705  # another writer stored the key first: the same bytes, since keys name content
OBJECT_HAS_LEASE = -706  # a reader holds it; the master drops it when the lease ends
NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
TRANSFER_FAIL = -800  # the segment holding the object did not answer (its node gone)
_UNREACHABLE = {-900: "RPC_FAIL", TRANSFER_FAIL: "TRANSFER_FAIL", -1: "INTERNAL_ERROR", -1010: "CLIENT_NOT_AVAILABLE"}

MISSING_WHEEL = "the mooncake:// tier needs the Mooncake Store client: pip install 'kvferry[mooncake]'"


def wheel_installed() -> bool:
    return importlib.util.find_spec("mooncake") is not None


def status_error(code: int, what: str) -> Exception:
    """The tier's exception for a failed status ``code``: no room -> TierFull, anything else -> TierUnavailable
    (the client folds a dead master, a dead segment owner and a refused transfer into a few codes)."""
    if code == NO_AVAILABLE_HANDLE:
        return TierFull(f"{what}: no segment has room (NO_AVAILABLE_HANDLE)")
    return TierUnavailable(f"{what} failed: {_UNREACHABLE.get(code, 'error')} ({code})")


def local_address(master_host: str, master_port: int) -> str:
    """The address of this machine's interface towards the master: what other nodes dial for its segment."""
    family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master_host, master_port))  # UDP: picks a route, sends nothing
        return str(probe.getsockname()[0])


def open_store(config: dict[str, Any]) -> Any:
    """A set-up `MooncakeDistributedStore` (this node's segment mounted); TierUnavailable if setup fails."""
    from mooncake.store import MooncakeDistributedStore  # optional dependency: imported on first use

    store = MooncakeDistributedStore()
    code = store.setup(config)
    if code != 0:
        raise TierUnavailable(f"Mooncake setup with master {config['master_server_addr']} failed ({code})")
    return store


class Deadline:
    """Runs client calls on its own threads and waits at most ``timeout_s`` for each: a call stuck in the client
    (master gone) becomes a TierUnavailable for the caller while it finishes in the background."""

    def __init__(self, timeout_s: float, name: str) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(2, f"{name}-calls")

    def call(self, fn: Callable[..., T], *args: object) -> T:
        future = self._pool.submit(fn, *args)
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            raise TierUnavailable(f"no answer within {self.timeout_s:g}s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
