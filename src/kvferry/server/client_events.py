"""A CUDA registration's ready events: the client's interprocess events, opened once, that its STOREs record right
before they are sent (`kvferry.client.ready_events`), and the stream the server's copies of those STOREs wait on.

The wait is enqueued with the driver's `cuStreamWaitEvent`, which keeps the GIL (`kvferry.kernels.cuda_driver`),
on the raw handles read once here: torch's `Stream.wait_event` releases the GIL, and on the server's socket thread
each release may hand it to a worker for as long as that worker's Python runs (eight engines on one server, H200:
~5% of the socket thread's transfer starts waited there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.kernels.cuda_driver import driver, primary_context
from kvferry.server.protocol import ErrorCode, ProtocolError


@dataclass(frozen=True, eq=False)
class ClientEvents:
    """The opened events of one registration (kept: they own the handles) and their raw handles, the stream its
    stores wait on them on, and the device's context."""

    events: tuple[Any, ...]  # torch.cuda.Event
    stream: Any  # torch.cuda.Stream
    raw_events: tuple[int, ...]
    context: int

    def wait(self, slot: int) -> None:
        """Make `stream` wait, on the GPU, for the client's work recorded in event `slot` (no CPU thread waits)."""
        d = driver()
        with d.current(self.context):
            d.wait(self.stream.cuda_stream, self.raw_events[slot], 0)


def open_client_events(device: Any, handles: list[bytes]) -> ClientEvents | None:
    """Open the client's CUDA IPC events once (opening one per STORE cost more than the STORE's own bookkeeping);
    None when the client sent none."""
    if not handles:
        return None
    import torch

    if device.type != "cuda":
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'ready_events' are only meaningful for a CUDA registration")
    try:
        events = tuple(torch.cuda.Event.from_ipc_handle(device, handle) for handle in handles)
    except RuntimeError as exc:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'ready_events': cannot open a CUDA IPC event ({exc})") from None
    return ClientEvents(events, torch.cuda.Stream(device), tuple(e.cuda_event for e in events), primary_context(device))
