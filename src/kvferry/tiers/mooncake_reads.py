"""The Mooncake tier's requests and its read path: a batch of gets into host-pool tensors, each object's header
checked and its checksum verified before the tensor is handed back.

A read must name buffers of exactly the object's size (the client refuses smaller ones and fails larger ones as
if the segment were gone), and the shape to allocate is in the header. Objects of one cache have one shape, so a
batch asks the master for its objects' sizes (one metadata call, ~0.1 ms) and reads each object of the size the
tier last stored or read with its header in one call, into a tensor of that shape. Any other object, or one the
master did not list, is read in two: its header first (the shape to allocate; a miss or a dead store shows here),
then header and payload again, the two headers compared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvferry.tiers.base import Alloc, Free
from kvferry.tiers.header import CorruptObject, ObjectHeader, decode_header, destination_bytes, verify_payload
from kvferry.tiers.mooncake_client import OBJECT_NOT_FOUND, LazyStore


@dataclass(eq=False)
class Request:
    """A put or a get waiting in the tier's batcher."""

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


class ReadOutcomes(NamedTuple):
    """How a read's requests end (the tier counts each and resolves its future)."""

    hit: Callable[[Request, torch.Tensor, int, float], bool]  # (request, tensor, nbytes, started): False if expired
    no_memory: Callable[[Request], None]
    corrupt: Callable[[Request, CorruptObject], None]
    unread: Callable[[Request, int], None]  # the client's read failed with this status (miss, dead segment or store)


class ObjectReads:
    def __init__(self, client: LazyStore, outcomes: ReadOutcomes, header_bytes: int) -> None:
        self._client = client
        self._outcomes = outcomes
        self._header_bytes = header_bytes
        self.usual: tuple[tuple[int, ...], torch.dtype, int] | None = None  # shape, dtype, bytes last stored or read

    def read(self, batch: list[Request]) -> None:
        started = time.perf_counter()
        rest = self._read_whole(batch, started) if self.usual is not None else batch
        if rest:
            self._read_in_two(rest, started)

    def _header(self, headers: torch.Tensor, i: int) -> bytes:
        return bytes(headers[i * self._header_bytes : (i + 1) * self._header_bytes].numpy())

    def _read_whole(self, batch: list[Request], started: float) -> list[Request]:
        """Read each object of the usual size with its header in one call into a tensor of the usual shape;
        returns the requests to read in two (other sizes and shapes, unlisted objects, and a get that could not
        give back a tensor it did not need)."""
        assert self.usual is not None
        shape, dtype, nbytes = self.usual
        store, size = self._client.client(), self._header_bytes
        sizes = _sizes(store, [r.key.hex() for r in batch])
        fits = [r for r in batch if r.free is not None and sizes.get(r.key.hex()) == size + nbytes]
        rest, reads = [r for r in batch if r not in fits], []
        for request in fits:
            assert request.alloc is not None  # every get gives its allocator
            tensor = request.alloc(shape, dtype)
            if tensor is None:
                self._outcomes.no_memory(request)
            else:
                reads.append((request, tensor))
        if not reads:
            return rest
        headers = self._client.headers(len(reads))
        codes = store.batch_get_into_multi_buffers(
            [r.key.hex() for r, _ in reads],
            [[headers.data_ptr() + i * size, t.data_ptr()] for i, (_, t) in enumerate(reads)],
            [[size, nbytes]] * len(reads),
        )
        for i, ((request, tensor), code) in enumerate(zip(reads, codes, strict=True)):
            if code != size + nbytes:
                _give_back(request, tensor)
                self._outcomes.unread(request, code)
                continue
            try:
                header = decode_header(request.key, self._header(headers, i))
            except CorruptObject as exc:
                _give_back(request, tensor)
                self._outcomes.corrupt(request, exc)
                continue
            if header.shape == shape and header.dtype == dtype:
                self._deliver(request, tensor, header, started)
            else:  # as many bytes in another shape
                _give_back(request, tensor)
                rest.append(request)
        return rest

    def _read_in_two(self, batch: list[Request], started: float) -> None:
        size = self._header_bytes
        store, headers = self._client.client(), self._client.headers(2 * len(batch))  # first read, then second
        first = store.get_into_ranges(
            [headers.data_ptr()],
            [[r.key.hex() for r in batch]],
            [[[i * size] for i in range(len(batch))]],
            [[[0] for _ in batch]],
            [[[size] for _ in batch]],
        )[0]
        ready: list[tuple[Request, torch.Tensor, bytes, ObjectHeader]] = []
        for i, (request, got) in enumerate(zip(batch, first, strict=True)):
            code = got[0] if got else OBJECT_NOT_FOUND
            if request.claimed:  # expired while the headers were read
                continue
            if code != size:
                self._outcomes.unread(request, code)
                continue
            raw = self._header(headers, i)
            try:
                header = decode_header(request.key, raw)
            except CorruptObject as exc:
                self._outcomes.corrupt(request, exc)
                continue
            assert request.alloc is not None  # every get gives its allocator
            tensor = request.alloc(header.shape, header.dtype)
            if tensor is None:
                self._outcomes.no_memory(request)
                continue
            destination_bytes(tensor, header)  # checks alloc gave what was asked for
            ready.append((request, tensor, raw, header))
        if not ready:
            return
        codes = store.batch_get_into_multi_buffers(
            [r.key.hex() for r, *_ in ready],
            [[headers.data_ptr() + (len(batch) + i) * size, t.data_ptr()] for i, (_, t, *_) in enumerate(ready)],
            [[size, h.payload_len] for *_, h in ready],
        )
        for i, ((request, tensor, raw, header), code) in enumerate(zip(ready, codes, strict=True)):
            if code != size + header.payload_len:
                _give_back(request, tensor)
                self._outcomes.unread(request, code)
            elif self._header(headers, len(batch) + i) != raw:
                _give_back(request, tensor)
                self._outcomes.corrupt(request, CorruptObject("the object changed between its two reads"))
            else:
                self._deliver(request, tensor, header, started)

    def _deliver(self, request: Request, tensor: torch.Tensor, header: ObjectHeader, started: float) -> None:
        """Verify what ``tensor`` received against ``header`` and hand it over."""
        try:
            verify_payload(header, tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
        except CorruptObject as exc:
            _give_back(request, tensor)
            self._outcomes.corrupt(request, exc)
            return
        self.usual = (header.shape, header.dtype, header.payload_len)
        if not self._outcomes.hit(request, tensor, header.payload_len, started):
            _give_back(request, tensor)  # expired: the caller has its miss; the client is done with the memory


def _sizes(store: Any, names: list[str]) -> dict[str, int]:
    """The size of each object the master lists (header included); those it does not are left out."""
    sizes = {}
    for name, replicas in store.batch_get_replica_desc(names).items():
        if replicas and replicas[0].is_memory_replica():
            sizes[name] = int(replicas[0].get_memory_descriptor().buffer_descriptor.size)
    return sizes


def _give_back(request: Request, tensor: torch.Tensor) -> None:
    if request.free is not None:
        request.free(tensor)
