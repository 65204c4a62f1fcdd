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
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import torch

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


class LazyStore:
    """A `MooncakeDistributedStore` set up on first use (mounting this node's segment), with the memory registered
    that transfers go from and into, and per-thread registered room for headers."""

    def __init__(self, config: dict[str, Any], header_bytes: int) -> None:
        self._config = config
        self._header_bytes = header_bytes
        self._store: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._memory: list[torch.Tensor] = []  # registered with the client (kept alive here)
        self._scratch = threading.local()

    def client(self) -> Any:
        with self._lock:
            if self._closed:
                raise TierUnavailable("closed")
            if self._store is None:
                store = open_store(self._config)
                for memory in self._memory:
                    _register(store, memory)
                self._store = store
            return self._store

    def use_memory(self, memory: torch.Tensor) -> None:
        with self._lock:
            self._memory.append(memory)
            if self._store is not None:
                _register(self._store, memory)

    def headers(self, count: int) -> torch.Tensor:
        """This thread's registered room for at least ``count`` headers."""
        room: torch.Tensor | None = getattr(self._scratch, "room", None)
        if room is None or room.numel() < count * self._header_bytes:
            room = torch.empty(max(count, 32) * self._header_bytes, dtype=torch.uint8)
            self.use_memory(room)  # kept alive while the client may touch it
            self._scratch.room = room
        return room

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()


def _register(store: Any, memory: torch.Tensor) -> None:
    nbytes = memory.numel() * memory.element_size()
    code = store.register_buffer(memory.data_ptr(), nbytes)
    if code != 0:
        raise TierUnavailable(f"register_buffer of {nbytes} bytes failed ({code})")
