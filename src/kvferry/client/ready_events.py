"""How a GPU transfer tells the server when the client's work on the blocks is queued: CUDA IPC events opened once,
at registration.

The server must not read blocks before the engine's work that writes them (a STORE after the forward pass), nor
write blocks before the work queued on them has run (a RETRIEVE into blocks a finished request just gave back,
whose kernels may still be queued). The client records an event on its current stream right before each STORE or
RETRIEVE and the server's copy waits for it on the GPU. Making an interprocess event, exporting its handle and
opening it in the server costs far more than the record itself, so a registration comes with a ring of events the
server opens once; a transfer names the slot it recorded. A slot is reused only after the server answered the
transfer that used it (re-recording it earlier could move the wait to another stream). With every slot in use a
transfer sends a fresh event of its own. The record is the driver's (`kvferry.cuda.driver`, on the raw handles):
torch's `Event.record` on `current_stream` cost a one-chunk STORE ~20 us of the client's time before it was sent
(H200 host). A transfer sent inside an `ordered_after` block is ordered after that block's event instead of the
current stream, as a transfer in process is: its slot is recorded on a stream of the registration's that waits for
the event.
"""

from __future__ import annotations

import threading

import torch

from kvferry.cuda.driver import driver, primary_context
from kvferry.transfer import ordering_event

SLOTS = 16


class ReadyEvents:
    """The interprocess events of one CUDA registration and which of them a transfer in flight holds."""

    def __init__(self, device: torch.device, slots: int = SLOTS) -> None:
        self.device = device
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        with torch.cuda.device(device):  # torch creates an event lazily, on the current device: the KV's, now
            self._handles = [bytes(e.ipc_handle()) for e in self.events]
        self._raw = [e.cuda_event for e in self.events]
        self._context = primary_context(device)
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self._ordered: torch.cuda.Stream | None = None  # where a slot waits for an `ordered_after` event

    def handles(self) -> list[bytes]:
        return list(self._handles)

    def record(self) -> int | None:
        """Record a free slot's event where this thread's transfers are ordered (`stream`); its index, or None
        when every slot is held by a transfer still in flight."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        d = driver()
        try:
            with d.current(self._context):
                d.record(self._raw[slot], self.stream())
        except BaseException:
            self.release(slot)
            raise
        return slot

    def record_fresh(self) -> torch.cuda.Event:
        """A new interprocess event recorded where this thread's transfers are ordered (every slot in use)."""
        event = torch.cuda.Event(interprocess=True)
        with torch.cuda.device(self.device):
            event.record(torch.cuda.ExternalStream(self.stream(), self.device))
        return event

    def stream(self) -> int:
        """The raw stream where this thread's transfers are ordered: its current stream on the KV's device, or,
        inside an `ordered_after` block, one of this registration's made to wait for that block's event now."""
        after = ordering_event()
        if after is None:
            return torch._C._cuda_getCurrentRawStream(self.device.index)
        if self._ordered is None:
            self._ordered = torch.cuda.Stream(self.device)
        d, stream = driver(), self._ordered.cuda_stream
        with d.current(self._context):
            d.wait(stream, after, 0)
        return stream

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
