"""Mooncake Store tier: one store that the kvferry servers of many nodes share, through `MooncakeDistributedStore`.

Each object is a fixed 128-byte header (header.py, padded) followed by the tensor's bytes, under the key's hex.
Every node's client contributes a memory segment (``segment=``) where the master places objects; the bytes move
over TCP or RDMA straight from and into host-pool memory (`use_memory` registers the pool with the client):

    put  one `batch_put_from_multi_buffers` per batch: [header, tensor] of each object, no copy in Python
    get  the batch's sizes from the master, then one `batch_get_into_multi_buffers` of [header, pool tensor] for
         the objects of the size the tier last stored or read; the others are read after their headers
         (mooncake_reads.py). Each header is checked (checksum, key tag, shape, dtype, size) before its tensor is
         returned

Checksums (``checksum=``): by default a header's checksum covers the header only. Mooncake guarantees that a get
returns the whole object as written (the master holds a lease on it while it is read and the transports check
what they carry); summing every payload byte on both sides is one more pass over memory, a third of the work
where the copy is memory-bound. ``checksum=payload`` covers the payload too. Readers verify whatever an object
carries, so nodes with either setting share a store.

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
from functools import partial
from typing import Any

import torch

from kvferry.tiers.base import Alloc, Free, Tier, TierUnavailable, resolved
from kvferry.tiers.batching import Batcher
from kvferry.tiers.header import CorruptObject, encode_header
from kvferry.tiers.mooncake_client import (
    MISSING_WHEEL,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    Deadline,
    LazyStore,
    local_address,
    status_error,
    wheel_installed,
)
from kvferry.tiers.mooncake_reads import ObjectReads, ReadOutcomes, Request

log = logging.getLogger(__name__)

HEADER_BYTES = 128  # every header padded to this, so a reader knows how many bytes to fetch before the shape
_PROBE_KEY = "kvferry-probe"
# A batch may take `timeout` plus its bytes at this rate before its requests are misses (a frozen master).
_SLOWEST_BYTES_PER_S = 100e6
CHECKSUMS = ("header", "payload")


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
        max_batch_bytes: int = 512 << 20,
        timeout_s: float = 2.0,
        checksum: str = "header",
        name: str | None = None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        """`master`: the master's (host, RPC port); `metadata`: the metadata server's URL (http://host:port/metadata).
        `segment_bytes`: the memory this node gives the store; `timeout_s` bounds the calls made on a caller's
        thread (contains, delete, the health probe). A batch (up to `max_batch` objects and `max_batch_bytes`) is
        one call of the client: over TCP, 16 objects a call went 0.89-1.00 of the raw client's rate, 2 a call
        0.79-0.93. `checksum`: what an object's checksum covers, "header" or "payload" (the module's docstring
        says why the header is enough here)."""
        if not wheel_installed():
            raise ValueError(MISSING_WHEEL)
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol={protocol!r} must be tcp or rdma")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum={checksum!r} must be one of {', '.join(CHECKSUMS)}")
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
        self._client = LazyStore(self._config, HEADER_BYTES)
        self._payload_checksum = checksum == "payload"
        outcomes = ReadOutcomes(self._hit, self._no_memory, self._corrupt, self._read_failed)
        self._reads = ObjectReads(self._client, outcomes, HEADER_BYTES)
        self._failed_at = float("-inf")  # when an operation last found the store unreachable
        self._finish_lock = threading.Lock()
        self._timeout_s = timeout_s
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
        self._client.use_memory(memory)

    def store(self) -> Any:
        """The tier's `MooncakeDistributedStore`, set up on first call with the registered memory: for tools that
        set the tier beside the raw client (``kvferry bench tiers``) or look into the store."""
        return self._client.client()

    def close(self) -> None:
        super().close()
        self._batcher.close()
        self._deadline.close()
        self._client.close()

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
        return list(self._client.client().batch_is_exist(names))

    def _remove(self, name: str) -> int:
        # force: past a reader's lease (a node mid-read of a removed object fails its checksum: a miss)
        return int(self._client.client().remove(name, True))

    def _unreachable_if(self, failed: bool, what: str) -> None:
        if failed:
            self._failed_at = time.monotonic()
            raise TierUnavailable(f"{what} failed: master or segment unreachable")

    # --- batches on the tier's workers ------------------------------------------------------------------------

    def _submit_put(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> Future[bool]:
        request = Request(key, len(payload), False, time.monotonic(), obj=obj, payload=payload)
        return request.future if self._batcher.submit(request) else resolved(False)

    def _submit_get(self, key: bytes, alloc: Alloc, free: Free | None) -> Future[torch.Tensor | None]:
        nbytes = self._reads.usual[2] if self._reads.usual is not None else 0
        request = Request(key, nbytes, None, time.monotonic(), alloc=alloc, free=free)
        return request.future if self._batcher.submit(request) else resolved(None)

    def _run_batch(self, batch: list[Request]) -> None:
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

    def _expire(self, requests: list[Request], seconds: float) -> None:
        error = TierUnavailable(f"no answer within {seconds:.1f}s")
        for request in requests:
            if self._claim(request):
                self._failed_at = time.monotonic()
                self._record_failure(_op(request), error)
                request.future.set_result(request.miss)

    def _claim(self, request: Request) -> bool:
        """Take the right to resolve ``request`` (the worker and the watchdog race for it); True if this call did."""
        with self._finish_lock:
            if request.claimed:
                return False
            request.claimed = True
            return True

    def _finish(self, request: Request, result: object, record: Callable[[], object] | None = None) -> bool:
        """Resolve ``request`` unless the watchdog has, after ``record`` (counting the outcome, dropping a bad
        object): whoever the result wakes sees the tier's state after it."""
        if not self._claim(request):
            return False
        if record is not None:
            record()
        request.future.set_result(result)
        return True

    def _put_batch(self, batch: list[Request]) -> None:
        started = time.perf_counter()
        store = self._client.client()
        headers = self._client.headers(len(batch))
        pointers, sizes = [], []
        for i, request in enumerate(batch):
            assert request.obj is not None and request.payload is not None  # a put holds its object
            header = encode_header(
                request.key, request.obj, request.payload, align=HEADER_BYTES, payload_checksum=self._payload_checksum
            )
            headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            pointers.append([headers.data_ptr() + i * HEADER_BYTES, request.obj.data_ptr()])
            sizes.append([HEADER_BYTES, request.nbytes])
        codes = store.batch_put_from_multi_buffers([r.key.hex() for r in batch], pointers, sizes)
        for request, code in zip(batch, codes, strict=True):
            if code in (0, OBJECT_ALREADY_EXISTS):
                assert request.obj is not None
                self._reads.usual = (tuple(request.obj.shape), request.obj.dtype, request.nbytes)
                self._finish(request, True, partial(self._record_success, "put", "stored", request.nbytes, started))
            else:
                self._finish(request, False, partial(self._unreachable_or, code, "put"))

    def _get_batch(self, batch: list[Request]) -> None:
        self._reads.read(batch)

    # --- how reads end (ReadOutcomes) ---------------------------------------------------------------------------

    def _hit(self, request: Request, tensor: torch.Tensor, nbytes: int, started: float) -> bool:
        return self._finish(request, tensor, partial(self._record_success, "get", "hit", nbytes, started))

    def _no_memory(self, request: Request) -> None:
        self._finish(request, None, partial(self._record_success, "get", "no_memory"))

    def _corrupt(self, request: Request, exc: CorruptObject) -> None:
        self._finish(request, None, partial(self._record_corrupt, request.key, exc))

    def _read_failed(self, request: Request, code: int) -> None:
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


def _op(request: Request) -> str:
    return "put" if request.obj is not None else "get"
