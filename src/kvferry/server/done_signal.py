"""Telling a GPU engine its transfer is done without a message: a word of shared memory the GPU writes.

A client registering GPU KV may also share a page of "done flags" (torch's fd shared memory, mapped here like CPU
KV). A STORE or RETRIEVE that names a slot and a sequence number is answered as soon as its copy is enqueued; behind
the copy, on a stream of its own, the server enqueues a 4-byte write of the sequence number into that slot
(`cuStreamWriteValue32` into the page, registered with the driver for device access). The client polls the word:
the KV is usable the moment the GPU has moved it, and the reply crosses the sockets while the bytes move.

Why a write in memory rather than a CUDA IPC event the client queries: a write the GPU never ran never shows. If
this process dies with the copy half done, its pending work is dropped, the word keeps its old value, and the
client sees the server go down instead of a "done" it cannot trust.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from kvferry.cuda.driver import HOST_REGISTER_DEVICEMAP, HOST_REGISTER_PORTABLE, driver
from kvferry.protocol.messages import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from kvferry.server.kv_mapping import SharedRegion
    from kvferry.transfer.handle import TransferHandle

WORD_BYTES = 4
MAX_SLOTS = 1024
_PAGE = 4096


class DoneFlags:
    """A client's done-flag words, registered for device writes, and the stream their writes are ordered on."""

    def __init__(self, region: SharedRegion, device: torch.device) -> None:
        if device.type != "cuda":
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'done_flags' are only meaningful for a CUDA registration")
        self.slots = min(region.nbytes // WORD_BYTES, MAX_SLOTS)
        if self.slots == 0:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'done_flags' holds {region.nbytes} bytes: no 4-byte word")
        self._region = region  # keeps the mapping alive
        host = region.address
        if host % WORD_BYTES:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'done_flags' must start on a 4-byte boundary")
        d = self._driver = driver()
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)  # makes the device's primary context current here
            self._context = d.current_context()
            # Whole pages: the driver registers pages, and a page is the least the client's shared memory holds.
            self._start = host - host % _PAGE
            length = -(-(host + self.slots * WORD_BYTES - self._start) // _PAGE) * _PAGE
            length = min(length, region.mapped_end - self._start)
            try:
                d.host_register(self._start, length, HOST_REGISTER_PORTABLE | HOST_REGISTER_DEVICEMAP)
            except RuntimeError as exc:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'done_flags': cannot register the page ({exc})") from None
            self._device_address = d.host_device_pointer(host)
        self._lock = threading.Lock()
        self._closed = False

    def check_slot(self, slot: int) -> None:
        if slot >= self.slots:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'done_slot'={slot}, but the registration has {self.slots}")

    def signal(self, handle: TransferHandle, slot: int, seq: int) -> None:
        """Enqueue the write of `seq` into word `slot`, to run once `handle`'s transfer has finished on the GPU."""
        d = self._driver
        with self._lock:
            if self._closed:
                raise RuntimeError("the registration's done flags are closed")
            handle.wait_on(self._stream)
            with d.current(self._context):
                d.write_value(self._stream.cuda_stream, self._device_address + slot * WORD_BYTES, seq, 0)

    def close(self) -> None:
        """Unregister the page once every write enqueued has run (a write into an unregistered page would fault)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            d = self._driver
            with d.current(self._context):
                self._stream.synchronize()
                d.host_unregister(self._start)
