"""Mooncake Store tier: one store that the kvferry servers of many nodes share, through `MooncakeDistributedStore`.

Each object is a fixed 128-byte header (header.py, padded) followed by the tensor's bytes, under the key's hex.
Every node's client contributes a memory segment (``segment=``) where the master places objects; the bytes move
over TCP or RDMA straight from and into host-pool memory (`use_memory` registers the pool with the client):

    put  one `batch_put_from_multi_buffers` per batch: [header, tensor] of each object, no copy in Python
    get  one `get_into_ranges` for the batch's headers (the shape to allocate), then one
         `batch_get_into_multi_buffers` of [header, pool tensor]; the header is compared with the first read and
         the payload checked against its checksum in the pool before the tensor is returned

Consistency: keys name content, so a key holds the same bytes whoever wrote it; the first put of a key wins and a
second writer's put is a success. A reader sees a whole object or a miss. The master keeps its index in memory
(a restart empties the store) and evicts by its own policy; an object lives in one node's segment, and a node that
leaves takes those objects with it. Use ``cache.tier_write: on_store`` so other nodes see an object when it is
stored, not when this node evicts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvferry.tiers.base import Alloc, Free, Tier, TierUnavailable, resolved
from kvferry.tiers.batching import Batcher
from kvferry.tiers.header import CorruptObject, decode_header, destination_bytes, encode_header, verify_payload
from kvferry.tiers.mooncake_client import (
    MISSING_WHEEL,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    Deadline,
    local_address,
    open_store,
    status_error,
    wheel_installed,
)

log = logging.getLogger(__name__)

HEADER_BYTES = 128  # every header padded to this, so a reader knows how many bytes to fetch before the shape
_PROBE_KEY = "kvferry-probe"
# A batch may take `timeout` plus its bytes at this rate before its requests are misses (a frozen master).
_SLOWEST_BYTES_PER_S = 100e6


@dataclass(eq=False)
class _Request:
    key: bytes
    nbytes: int
    miss: object
    submitted: float
    future: Future = field(default_factory=Future)
    obj: torch.Tensor | None = None  # put
    payload: memoryview | None = None  # put: obj's bytes
    alloc: Alloc | None = None  # get
    free: Free | None = None  # get
    claimed: bool = False  # someone is resolving the future (see MooncakeTier._claim)


class MooncakeTier(Tier):
    locality = "REMOTE"  # one store that many nodes share

    def __init__(
        self,
        master: tuple[str, int],
        metadata: str,
        *,
        segment_bytes: int = 1 << 30,
        buffer_bytes: int = 64 << 20,
        protocol: str = "tcp",
        device: str = "",
        local_host: str | None = None,
        workers: int = 2,
        max_batch: int = 16,
        max_batch_bytes: int = 64 << 20,
        timeout_s: float = 2.0,
        name: str | None = None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        """`master`: the master's (host, RPC port); `metadata`: the metadata server's URL (http://host:port/metadata).
        `segment_bytes`: the memory this node gives the store; `timeout_s` bounds the calls made on a caller's
        thread (contains, delete, the health probe). Batches of at most `max_batch_bytes` let the two workers
        overlap one batch's checksums with the other's transfer."""
        if not wheel_installed():
            raise ValueError(MISSING_WHEEL)
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol={protocol!r} must be tcp or rdma")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        host, port = master
        super().__init__(name or f"mooncake://{host}:{port}", backoff_s=backoff_s, backoff_max_s=backoff_max_s)
        self._config: dict[str, Any] = {
            "local_hostname": local_host or local_address(host, port),
            "metadata_server": metadata,
            "global_segment_size": segment_bytes,
            "local_buffer_size": buffer_bytes,
            "protocol": protocol,
            "rdma_devices": device,
            "master_server_addr": f"{host}:{port}",
        }
        self._max_batch = max_batch
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._memory: list[torch.Tensor] = []  # registered with the client (kept alive here)
        self._scratch = threading.local()  # per worker: registered room for a batch's headers
        self._failed_at = float("-inf")  # when an operation last found the store unreachable
        self._finish_lock = threading.Lock()
        self._timeout_s = timeout_s
        self._typical_bytes = 0
        self._deadline = Deadline(timeout_s, "kvferry-mooncake")
        self._batcher = Batcher(
            self._run_batch, workers=workers, max_items=max_batch, max_bytes=max_batch_bytes, name="kvferry-mooncake"
        )

    @property
    def capacity_bytes(self) -> None:
        """The master places objects in every node's segment and evicts by its own watermark."""
        return None

    @property
    def used_bytes(self) -> None:
        return None

    def evict(self, nbytes: int) -> int:
        """The master evicts by its own policy; the tier frees nothing itself."""
        return 0

    @property
    def client_config(self) -> dict[str, Any]:
        """What the tier sets its `MooncakeDistributedStore` up with (another client of the same store can too)."""
        return dict(self._config)

    def use_memory(self, memory: torch.Tensor) -> None:
        """Register ``memory`` (the host pool's slab) with the client, so transfers go from and into it directly
        (RDMA needs it; over TCP it saves the client's staging copy)."""
        self._memory.append(memory)
        if self._store is not None:
            self._register(self._store, memory)

    def close(self) -> None:
        super().close()
        self._batcher.close()
        self._deadline.close()
        with self._store_lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    # --- calls on the caller's thread -------------------------------------------------------------------------

    def _check(self) -> bool:
        self._unreachable_if(self._deadline.call(self._exists, [_PROBE_KEY])[0] < 0, "probe")
        return True

    def _contains(self, keys: list[bytes]) -> list[bool]:
        found = self._deadline.call(self._exists, [key.hex() for key in keys])
        self._unreachable_if(any(code < 0 for code in found), "batch_is_exist")
        return [code == 1 for code in found]

    def _delete(self, key: bytes) -> None:
        self._forget([self._object_name(key)])
        self._deadline.call(self._remove, key.hex())  # a missing key: nothing more to do

    def _exists(self, names: list[str]) -> list[int]:
        return list(self._connect().batch_is_exist(names))

    def _remove(self, name: str) -> int:
        # force: past a reader's lease (a node mid-read of a removed object fails its checksum: a miss)
        return int(self._connect().remove(name, True))

    def _unreachable_if(self, failed: bool, what: str) -> None:
        if failed:
            self._failed_at = time.monotonic()
            raise TierUnavailable(f"{what} failed: master or segment unreachable")

    # --- batches on the tier's workers ------------------------------------------------------------------------

    def _submit_put(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> Future[bool]:
        request = _Request(key, len(payload), False, time.monotonic(), obj=obj, payload=payload)
        return request.future if self._batcher.submit(request) else resolved(False)

    def _submit_get(self, key: bytes, alloc: Alloc, free: Free | None) -> Future[torch.Tensor | None]:
        request = _Request(key, self._typical_bytes, None, time.monotonic(), alloc=alloc, free=free)
        return request.future if self._batcher.submit(request) else resolved(None)

    def _run_batch(self, batch: list[_Request]) -> None:
        # Queued before an operation found the store gone: each would block in the client for seconds. A request
        # admitted since then is the health gate's probe and goes ahead.
        for request in [r for r in batch if r.submitted < self._failed_at]:
            self._finish(request, request.miss, partial(self._metrics.op, _op(request), "unavailable"))
        fresh = [r for r in batch if r.submitted >= self._failed_at]
        puts = [r for r in fresh if r.obj is not None]
        gets = [r for r in fresh if r.obj is None]
        for requests, run in ((puts, self._put_batch), (gets, self._get_batch)):
            if not requests:
                continue
            # A frozen master never answers: past the deadline the requests are misses and the tier is down. The
            # call goes on; what it later reads is given back to the pool (see _get_batch), never returned.
            seconds = self._timeout_s + sum(r.nbytes for r in requests) / _SLOWEST_BYTES_PER_S
            watchdog = threading.Timer(seconds, self._expire, (requests, seconds))
            watchdog.start()
            try:
                run(requests)
            except Exception as exc:
                if isinstance(exc, TierUnavailable):
                    self._failed_at = time.monotonic()
                for request in requests:
                    self._finish(request, request.miss, partial(self._record_failure, _op(request), exc))
            finally:
                watchdog.cancel()
                watchdog.join()  # an expiry under way completes before the batcher looks at the futures

    def _expire(self, requests: list[_Request], seconds: float) -> None:
        error = TierUnavailable(f"no answer within {seconds:.1f}s")
        for request in requests:
            if self._claim(request):
                self._failed_at = time.monotonic()
                self._record_failure(_op(request), error)
                request.future.set_result(request.miss)

    def _claim(self, request: _Request) -> bool:
        """Take the right to resolve ``request`` (the worker and the watchdog race for it); True if this call did."""
        with self._finish_lock:
            if request.claimed:
                return False
            request.claimed = True
            return True

    def _finish(self, request: _Request, result: object, record: Callable[[], object] | None = None) -> bool:
        """Resolve ``request`` unless the watchdog has, after ``record`` (counting the outcome, dropping a bad
        object): whoever the result wakes sees the tier's state after it."""
        if not self._claim(request):
            return False
        if record is not None:
            record()
        request.future.set_result(result)
        return True

    def _corrupt(self, request: _Request, exc: CorruptObject) -> None:
        self._finish(request, None, partial(self._record_corrupt, request.key, exc))

    def _put_batch(self, batch: list[_Request]) -> None:
        started = time.perf_counter()
        store = self._connect()
        headers = self._headers(store, len(batch))
        pointers, sizes = [], []
        for i, request in enumerate(batch):
            assert request.obj is not None and request.payload is not None  # a put holds its object
            header = encode_header(request.key, request.obj, request.payload, align=HEADER_BYTES)
            headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            pointers.append([headers.data_ptr() + i * HEADER_BYTES, request.obj.data_ptr()])
            sizes.append([HEADER_BYTES, request.nbytes])
        codes = store.batch_put_from_multi_buffers([r.key.hex() for r in batch], pointers, sizes)
        for request, code in zip(batch, codes, strict=True):
            if code in (0, OBJECT_ALREADY_EXISTS):
                self._typical_bytes = request.nbytes
                self._finish(request, True, partial(self._record_success, "put", "stored", request.nbytes, started))
            else:
                self._finish(request, False, partial(self._unreachable_or, code, "put"))

    def _get_batch(self, batch: list[_Request]) -> None:
        started = time.perf_counter()
        store = self._connect()
        headers = self._headers(store, 2 * len(batch))  # first read, then the second read's copy
        names = [r.key.hex() for r in batch]
        first = store.get_into_ranges(
            [headers.data_ptr()],
            [names],
            [[[i * HEADER_BYTES] for i in range(len(batch))]],
            [[[0] for _ in batch]],
            [[[HEADER_BYTES] for _ in batch]],
        )[0]
        ready: list[tuple[_Request, torch.Tensor, bytes, int]] = []
        for i, (request, got) in enumerate(zip(batch, first, strict=True)):
            code = got[0] if got else OBJECT_NOT_FOUND
            if request.claimed:  # expired while the headers were read
                continue
            if code != HEADER_BYTES:
                self._finish_unread(request, code)
                continue
            raw = bytes(headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES].numpy())
            try:
                header = decode_header(request.key, raw)
            except CorruptObject as exc:
                self._corrupt(request, exc)
                continue
            assert request.alloc is not None  # every get gives its allocator
            tensor = request.alloc(header.shape, header.dtype)
            if tensor is None:
                self._finish(request, None, partial(self._record_success, "get", "no_memory"))
                continue
            destination_bytes(tensor, header)  # checks alloc gave what was asked for
            ready.append((request, tensor, raw, header.payload_len))
        if not ready:
            return
        second = len(batch) * HEADER_BYTES
        codes = store.batch_get_into_multi_buffers(
            [r.key.hex() for r, *_ in ready],
            [[headers.data_ptr() + second + i * HEADER_BYTES, t.data_ptr()] for i, (_, t, *_) in enumerate(ready)],
            [[HEADER_BYTES, n] for *_, n in ready],
        )
        for i, ((request, tensor, raw, nbytes), code) in enumerate(zip(ready, codes, strict=True)):
            if code != HEADER_BYTES + nbytes:
                self._give_back(request, tensor)
                self._finish_unread(request, code)
                continue
            again = bytes(headers[second + i * HEADER_BYTES : second + (i + 1) * HEADER_BYTES].numpy())
            try:
                if again != raw:
                    raise CorruptObject("the object changed between the header read and the payload read")
                header = decode_header(request.key, raw)
                verify_payload(header, tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
            except CorruptObject as exc:
                self._give_back(request, tensor)
                self._corrupt(request, exc)
                continue
            self._typical_bytes = nbytes
            if not self._finish(
                request, tensor, partial(self._record_success, "get", "hit", nbytes, started)
            ):  # expired: the caller has its miss, and the memory goes back now that the client is done
                self._give_back(request, tensor)

    def _finish_unread(self, request: _Request, code: int) -> None:
        """A read that did not return the object: absent (a miss), in a segment that cannot be reached (its node
        died: a counted error, the object dropped, the tier still healthy), or a failed call (the store is down)."""
        self._finish(request, None, partial(self._unread, request.key, code))

    def _unread(self, key: bytes, code: int) -> None:
        if code == OBJECT_NOT_FOUND:
            self._record_success("get", "miss")
            self._forget([self._object_name(key)])  # evicted, or its node left
        elif code == TRANSFER_FAIL:
            self._record_success("get", "error")
            log.warning("tier %s: %s is in a segment that cannot be read (its node gone?); dropping it", self.name,
                        key.hex()[:32])  # fmt: skip
            self._delete_quietly(key)
        else:
            self._unreachable_or(code, "get")

    def _unreachable_or(self, code: int, op: str) -> None:
        if code == TRANSFER_FAIL:  # one segment's node is gone: the master places the next put elsewhere
            self._record_success(op, "error")
            return
        error = status_error(code, op)
        if isinstance(error, TierUnavailable):
            self._failed_at = time.monotonic()
        self._record_failure(op, error)

    def _delete_quietly(self, key: bytes) -> None:
        try:
            self._delete(key)
        except Exception as exc:
            self._record_failure("delete", exc)

    @staticmethod
    def _give_back(request: _Request, tensor: torch.Tensor) -> None:
        if request.free is not None:
            request.free(tensor)

    # --- client -----------------------------------------------------------------------------------------------

    def _connect(self) -> Any:
        """The client, set up on first use (mounting this node's segment), with the pool's memory registered."""
        with self._store_lock:
            if self._closed:
                raise TierUnavailable("closed")
            if self._store is None:
                store = open_store(self._config)
                for memory in self._memory:
                    self._register(store, memory)
                self._store = store
            return self._store

    def _register(self, store: Any, memory: torch.Tensor) -> None:
        code = store.register_buffer(memory.data_ptr(), memory.numel() * memory.element_size())
        if code != 0:
            raise TierUnavailable(f"register_buffer of {memory.numel() * memory.element_size()} bytes failed ({code})")

    def _headers(self, store: Any, count: int) -> torch.Tensor:
        """This worker's registered header room for ``count`` headers."""
        room: torch.Tensor | None = getattr(self._scratch, "room", None)
        if room is None or room.numel() < count * HEADER_BYTES:
            room = torch.empty(max(count, 2 * self._max_batch) * HEADER_BYTES, dtype=torch.uint8)
            self._register(store, room)
            self._memory.append(room)  # kept alive while the client may touch it
            self._scratch.room = room
        return room


def _op(request: _Request) -> str:
    return "put" if request.obj is not None else "get"
