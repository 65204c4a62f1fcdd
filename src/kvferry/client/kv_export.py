"""Describe an engine's KV tensors so the server can map the same memory (the client half of registration).

CPU tensors are moved into shared memory *in place* (`tensor.share_memory_()` with torch's file-descriptor
strategy); every tensor viewing the storage, the engine's included, keeps working. Memory shared through a file
already (`shared_files`: SGLang's ``shm`` host pool) is passed as it is, without a copy. GPU tensors are exported by
CUDA IPC handle. Only plain msgpack fields leave the process: pids, fds, handles, offsets, shapes, strides,
dtype names.

Why file descriptors: torch's fd strategy unlinks the shared-memory file the moment it is created and keeps only
an open descriptor, so the memory can never outlive its last user. The server opens ``/proc/<pid>/fd/<fd>``
(the same host, the same user: what shared memory needs anyway) and maps it; once the engine and the server
have both exited or unmapped -- however they exited, SIGKILL included -- the kernel frees it. The file_system
strategy leaves a named file in /dev/shm that only torch's shm manager daemon removes, and a Ctrl-C that takes
the daemon down with the engine leaves the whole KV cache there.

GPU memory that the driver's VMM calls mapped (vLLM 0.34's extensible KV cache) has no CUDA IPC handle: each
physical allocation under the tensors is exported as a POSIX file descriptor (`kvferry.cuda.vmm`), which the
client passes over the server's descriptor socket (`kvferry.protocol.fd_passing`) before it registers; the tensors
are then views at their offsets in the allocations.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from kvferry.client.shared_files import SharedMappings
from kvferry.cuda.driver import driver, primary_context
from kvferry.cuda.vmm import allocation_range, export_allocation, is_legacy_ipc_capable


def export_kv(paged: Any, fds: list[int] | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Return (storages, kv): one entry per distinct storage, and the tensors as views of them.

    `paged` is a tensor or lists/tuples of tensors nested like the engine's format. Driver-mapped GPU memory is
    exported as descriptors appended to `fds` (the caller passes them to the server, then closes them; a storage's
    `fd_index` is its descriptor's place there, its `token` the deposit's, set by the caller); without `fds` such
    memory is refused.
    """
    storages: list[dict[str, Any]] = []
    index_of: dict[tuple[str, int], int] = {}
    shared = functools.cache(SharedMappings)  # /proc/self/maps read once, at the first CPU tensor

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor):
            if node.device.type != "cuda":
                return _view(node, where, storages, index_of, shared)
            try:  # torch's own sharing first: it also shares its allocator's driver-mapped (expandable) segments
                return _view(node, where, storages, index_of, shared)
            except RuntimeError:  # memory torch's allocator did not hand out (vLLM 0.34's extensible KV cache)
                with driver().current(primary_context(node.device)):  # the driver's calls need its context
                    if is_legacy_ipc_capable(node.data_ptr()):
                        raise
                    return _vmm_view(node, where, storages, index_of, fds)
        if isinstance(node, list | tuple):
            if not node:
                raise ValueError(f"{where} is an empty {type(node).__name__}; expected tensors")
            return [walk(child, f"{where}[{i}]") for i, child in enumerate(node)]
        raise TypeError(f"{where} must be a tensor or a list/tuple of tensors, got {type(node).__name__}")

    kv = walk(paged, "paged")
    return storages, kv


def _view(
    tensor: torch.Tensor,
    where: str,
    storages: list[dict[str, Any]],
    index_of: dict[tuple[str, int], int],
    shared: Callable[[], SharedMappings],
) -> dict[str, Any]:
    if tensor.layout != torch.strided or tensor.is_nested:
        raise TypeError(f"{where} must be a dense strided tensor, got layout {tensor.layout}")
    storage = tensor.untyped_storage()
    if tensor.device.type == "cpu":
        desc = _share_cpu(storage, shared())  # may move the storage: take data_ptr after
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


def _vmm_view(
    tensor: torch.Tensor,
    where: str,
    storages: list[dict[str, Any]],
    index_of: dict[tuple[str, int], int],
    fds: list[int] | None,
) -> dict[str, Any]:
    """`tensor` as a view of the driver-mapped allocation under its first byte (the caller made its device's context
    current)."""
    if fds is None:
        raise ValueError(f"{where} is driver-mapped (VMM) GPU memory, which only a client that passes descriptors "
                         "can share")  # fmt: skip
    address = tensor.data_ptr()
    base, nbytes = allocation_range(address)
    key = (str(tensor.device), base)
    if key not in index_of:
        exported = export_allocation(address)
        index_of[key] = len(storages)
        fds.append(exported.fd)
        storages.append(
            {
                "kind": "cuda_vmm_fd",
                "device_uuid": str(torch.cuda.get_device_properties(tensor.device).uuid),
                "token": b"",  # the deposit's, once the caller has passed `fds`
                "fd_index": len(fds) - 1,
                "nbytes": exported.nbytes,
            }
        )
    offset_bytes = address - base
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    if offset_bytes + extent * tensor.element_size() > nbytes:
        raise ValueError(f"{where} spans more than the one {nbytes}-byte allocation at its start: the server maps "
                         "each allocation on its own")  # fmt: skip
    if offset_bytes % tensor.element_size():
        raise ValueError(f"{where} starts {offset_bytes} bytes into its allocation, not on a {tensor.dtype} element")
    return {
        "storage": index_of[key],
        "offset": offset_bytes // tensor.element_size(),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "dtype": str(tensor.dtype).removeprefix("torch."),
    }


def _share_cpu(storage: torch.UntypedStorage, mappings: SharedMappings) -> dict[str, Any]:
    # Memory shared through a file already (a memfd or /dev/shm mapping a descriptor holds open) is mapped by the
    # server as it is. Other memory torch moves into an unlinked shared-memory file once (a copy, then every view
    # of the storage points there); later calls return the same descriptor, which torch keeps open as long as the
    # storage lives.
    shared = mappings.of(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None
    if shared is not None:
        return {"kind": "shm_fd", "pid": os.getpid(), "fd": shared.fd, "offset_bytes": shared.offset_bytes,
                "nbytes": storage.nbytes()}  # fmt: skip
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
