"""Describe an engine's KV tensors so the server can map the same memory (the client half of registration).

CPU tensors are moved into shared memory *in place* (`tensor.share_memory_()` with torch's file-descriptor
strategy); every tensor viewing the storage, the engine's included, keeps working. GPU tensors are exported by
CUDA IPC handle. Only plain msgpack fields leave the process: pids, fds, handles, offsets, shapes, strides,
dtype names.

Why file descriptors: torch's fd strategy unlinks the shared-memory file the moment it is created and keeps only
an open descriptor, so the memory can never outlive its last user. The server opens ``/proc/<pid>/fd/<fd>``
(the same host, the same user: what shared memory needs anyway) and maps it; once the engine and the server
have both exited or unmapped -- however they exited, SIGKILL included -- the kernel frees it. The file_system
strategy leaves a named file in /dev/shm that only torch's shm manager daemon removes, and a Ctrl-C that takes
the daemon down with the engine leaves the whole KV cache there. Passing the descriptor over a Unix socket
(SCM_RIGHTS) would also reach a server in another pid namespace, but needs a second channel beside ZMQ, which
cannot carry descriptors; a server in another container could not map the engine's /dev/shm either.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def export_kv(paged: Any) -> tuple[list[dict[str, Any]], Any]:
    """Return (storages, kv): one entry per distinct storage, and the tensors as views of them.

    `paged` is a tensor or lists/tuples of tensors nested like the engine's format.
    """
    storages: list[dict[str, Any]] = []
    index_of: dict[tuple[str, int], int] = {}

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor):
            return _view(node, where, storages, index_of)
        if isinstance(node, list | tuple):
            if not node:
                raise ValueError(f"{where} is an empty {type(node).__name__}; expected tensors")
            return [walk(child, f"{where}[{i}]") for i, child in enumerate(node)]
        raise TypeError(f"{where} must be a tensor or a list/tuple of tensors, got {type(node).__name__}")

    kv = walk(paged, "paged")
    return storages, kv


def _view(
    tensor: torch.Tensor, where: str, storages: list[dict[str, Any]], index_of: dict[tuple[str, int], int]
) -> dict[str, Any]:
    if tensor.layout != torch.strided or tensor.is_nested:
        raise TypeError(f"{where} must be a dense strided tensor, got layout {tensor.layout}")
    storage = tensor.untyped_storage()
    if tensor.device.type == "cpu":
        desc = _share_cpu(storage)  # may move the storage: take data_ptr after
    elif tensor.device.type == "cuda":
        desc = _share_cuda(storage)
    else:
        raise ValueError(f"{where} is on {tensor.device}; the server maps CPU (shared memory) or CUDA tensors")
    key = (str(tensor.device), storage.data_ptr())
    if key not in index_of:
        index_of[key] = len(storages)
        storages.append(desc)
    return {
        "storage": index_of[key],
        "offset": tensor.storage_offset(),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "dtype": str(tensor.dtype).removeprefix("torch."),
    }


def _share_cpu(storage: torch.UntypedStorage) -> dict[str, Any]:
    # Moves the bytes into an unlinked shared-memory file once (a copy, then every view of the storage points
    # there); later calls return the same descriptor, which torch keeps open as long as the storage lives.
    fd, nbytes = storage._share_fd_cpu_()
    return {"kind": "shm_fd", "pid": os.getpid(), "fd": fd, "offset_bytes": 0, "nbytes": nbytes}


def _share_cuda(storage: torch.UntypedStorage) -> dict[str, Any]:
    (
        device,
        handle,
        nbytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "kind": "cuda_ipc",
        "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "handle": bytes(handle),
        "nbytes": nbytes,
        "offset_bytes": offset_bytes,
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": None if event_handle is None else bytes(event_handle),
        "event_sync_required": bool(event_sync_required),
    }
