"""A CUDA registration's ready events: the client's interprocess events, opened once, that its STOREs and RETRIEVEs
record right before they are sent (`kvferry.client.ready_events`). A transfer's copies wait for its slot's event on
the GPU (`kvferry.transfer.ordered_after`, on the raw handles read once here): no stream of the server's is made
current or made to wait for it, which cost a STORE ~70-110 us of the socket thread's time on the H200 host. A
transfer sent while every slot was in use carries an event of its own, opened for it (`open_client_event`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.protocol.messages import ErrorCode, ProtocolError


@dataclass(frozen=True, eq=False)
class ClientEvents:
    """The opened events of one registration (kept: they own the handles) and their raw handles."""

    events: tuple[Any, ...]  # torch.cuda.Event
    raw_events: tuple[int, ...]


def open_client_events(device: Any, handles: list[bytes]) -> ClientEvents | None:
    """Open the client's CUDA IPC events once (opening one per STORE cost more than the STORE's own bookkeeping);
    None when the client sent none."""
    if not handles:
        return None
    if device.type != "cuda":
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'ready_events' are only meaningful for a CUDA registration")
    events = tuple(_opened(device, handle, "ready_events") for handle in handles)
    return ClientEvents(events, tuple(e.cuda_event for e in events))


def open_client_event(device: Any, handle: bytes) -> Any:
    """The `torch.cuda.Event` of one transfer's own ready event (`ready_event`)."""
    if device.type != "cuda":
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'ready_event' is only meaningful for a CUDA registration")
    return _opened(device, handle, "ready_event")


def _opened(device: Any, handle: bytes, field: str) -> Any:
    import torch

    try:
        return torch.cuda.Event.from_ipc_handle(device, handle)
    except RuntimeError as exc:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'{field}': cannot open a CUDA IPC event ({exc})") from None
