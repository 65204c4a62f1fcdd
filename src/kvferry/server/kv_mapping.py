"""Map a client's registered KV tensors into the server process: CPU shared memory, CUDA IPC, and driver-mapped
CUDA allocations passed by file descriptor (`kvferry.server.fd_inbox`, `kvferry.cuda.vmm`).

The client sends plain descriptions (shared-memory descriptors or IPC handles, offsets, shapes, strides, dtypes); this
module checks each one against the storage it names before building a view, because `Tensor.set_` itself
does not bounds-check and a wrong stride would let the server read or write another process's memory.
Dropping every reference to a `MappedKV` (see `close`) unmaps its storages.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from pydantic import ValidationError

from kvferry.cuda.driver import CudaError, primary_context
from kvferry.cuda.vmm import ImportedAllocation, as_byte_tensor
from kvferry.protocol.fd_passing import close_all
from kvferry.protocol.messages import ErrorCode, ProtocolError
from kvferry.protocol.shared_memory import is_shared_memory
from kvferry.server.fd_inbox import FdInbox
from kvferry.server.requests import CudaIpcStorage, CudaVmmStorage, RegisterArgs, ShmStorage, TensorView

# torch's fd strategy creates "/dev/shm/torch_<pid>_<random>_<counter>" (at::NewProcessWideShmHandle) and
# unlinks it at once, so the client's descriptor reads as that name plus " (deleted)". Accepting nothing else
# keeps a client from making the server map any other file it can name through /proc.
_MAX_TENSORS = 65536
_MAX_DEPTH = 4
_MAX_DIMS = 8
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")
}


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class _Region:
    """Bytes [base, base + nbytes) of `storage` are the client's storage."""

    storage: torch.UntypedStorage
    base: int
    nbytes: int


@dataclass
class MappedKV:
    """A registration's KV as tensors of this process, nested like the client's (lists in place of tuples)."""

    paged: Any
    device: torch.device
    num_tensors: int
    mapped_bytes: int
    _regions: list[_Region] = field(repr=False)

    def close(self) -> None:
        """Drop this object's references; a mapping goes once no running transfer holds its tensors."""
        self.paged = None
        self._regions.clear()


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """A client's CPU shared memory mapped here: its bytes start at `address`; the mapping ends at `mapped_end`."""

    storage: torch.UntypedStorage
    address: int
    nbytes: int
    mapped_end: int


def map_shared(desc: ShmStorage, where: str) -> SharedRegion:
    """Map one client shared-memory storage on its own (not KV: the done flags of a GPU registration)."""
    region = _map_shm(desc, where)
    base = region.storage.data_ptr()
    return SharedRegion(region.storage, base + region.base, region.nbytes, base + region.storage.nbytes())


def map_kv(args: RegisterArgs, fd_inbox: FdInbox | None = None) -> MappedKV:
    """Map every storage of a REGISTER_KV_CACHE request and rebuild the nested KV tensors over them. Descriptors
    the request's storages name are taken from `fd_inbox` and closed here, whatever the outcome."""
    deposits = _take_deposits(args.storages, fd_inbox)
    try:
        regions = [_map_storage(desc, f"storages[{i}]", deposits) for i, desc in enumerate(args.storages)]
    finally:
        for fds in deposits.values():
            close_all(fds)
    devices = {r.storage.device for r in regions}
    if len(devices) != 1:
        raise _bad(f"'storages' must all live on one device, got {sorted(map(str, devices))}")
    count = [0]
    paged = _build(args.kv, regions, "kv", 0, count)
    return MappedKV(paged, devices.pop(), count[0], sum(r.nbytes for r in regions), regions)


def _build(node: Any, regions: list[_Region], where: str, depth: int, count: list[int]) -> Any:
    if isinstance(node, list):
        if depth >= _MAX_DEPTH or not node:
            raise _bad(f"'{where}' must be a non-empty list nested at most {_MAX_DEPTH} deep")
        return [_build(child, regions, f"{where}[{i}]", depth + 1, count) for i, child in enumerate(node)]
    if not isinstance(node, dict):
        raise _bad(f"'{where}' must be a tensor view map or a list of them, got {type(node).__name__}")
    count[0] += 1
    if count[0] > _MAX_TENSORS:
        raise _bad(f"'kv' holds more than {_MAX_TENSORS} tensors")
    try:
        view = TensorView.model_validate(node)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise _bad(f"'{where}.{'.'.join(map(str, err['loc']))}': {err['msg']}") from None
    return _view(view, regions, where)


def _view(view: TensorView, regions: list[_Region], where: str) -> torch.Tensor:
    dtype = DTYPES.get(view.dtype)
    if dtype is None:
        raise _bad(f"'{where}.dtype'={view.dtype!r} is not one of {sorted(DTYPES)}")
    if view.storage >= len(regions):
        raise _bad(f"'{where}.storage'={view.storage} is outside the {len(regions)} registered storages")
    if len(view.shape) != len(view.stride) or not 1 <= len(view.shape) <= _MAX_DIMS:
        raise _bad(f"'{where}': shape {view.shape} and stride {view.stride} must have the same 1..{_MAX_DIMS} dims")
    if 0 in view.shape:
        raise _bad(f"'{where}.shape'={view.shape} has an empty dimension")
    region = regions[view.storage]
    elem = dtype.itemsize
    last = view.offset + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride, strict=True))
    if (last + 1) * elem > region.nbytes:
        raise _bad(
            f"'{where}': offset {view.offset} + extent of shape {view.shape} x stride {view.stride} "
            f"reaches byte {(last + 1) * elem}, past the {region.nbytes}-byte storage {view.storage}"
        )
    if region.base % elem:
        raise _bad(f"'storages[{view.storage}].offset_bytes'={region.base} is not a multiple of {elem} ({dtype})")
    tensor = torch.empty(0, dtype=dtype, device=region.storage.device)
    return tensor.set_(region.storage, region.base // elem + view.offset, view.shape, view.stride)


def _take_deposits(
    storages: list[ShmStorage | CudaIpcStorage | CudaVmmStorage], inbox: FdInbox | None
) -> dict[bytes, list[int]]:
    """The descriptors of every deposit the storages name, each taken once (a deposit serves one registration)."""
    deposits: dict[bytes, list[int]] = {}
    try:
        for i, desc in enumerate(storages):
            if not isinstance(desc, CudaVmmStorage) or desc.token in deposits:
                continue
            if inbox is None:
                raise _bad(f"'storages[{i}]' names passed descriptors, but this server has no --ipc socket for them")
            try:
                deposits[desc.token] = inbox.take(desc.token)
            except KeyError:
                raise _bad(f"'storages[{i}].token': no such deposit of descriptors (expired or taken)") from None
    except BaseException:
        for fds in deposits.values():
            close_all(fds)
        raise
    return deposits


def _map_storage(
    desc: ShmStorage | CudaIpcStorage | CudaVmmStorage, where: str, deposits: dict[bytes, list[int]]
) -> _Region:
    if isinstance(desc, ShmStorage):
        return _map_shm(desc, where)
    if isinstance(desc, CudaVmmStorage):
        return _Region(_map_cuda_vmm(desc, deposits[desc.token], where), 0, desc.nbytes)
    return _Region(_map_cuda_ipc(desc, where), 0, desc.nbytes)


def _map_cuda_vmm(desc: CudaVmmStorage, fds: list[int], where: str) -> torch.UntypedStorage:
    """Import descriptor `fd_index` of the deposit and map the whole allocation on its device."""
    if desc.fd_index >= len(fds):
        raise _bad(f"'{where}.fd_index'={desc.fd_index} is outside the deposit's {len(fds)} descriptors")
    if not torch.cuda.is_available():
        raise _bad(f"'{where}' is a CUDA allocation but this server sees no CUDA device")
    device = _device_by_uuid(desc.device_uuid, where)
    try:
        allocation = ImportedAllocation(fds[desc.fd_index], desc.nbytes, device, primary_context(device))
    except CudaError as exc:
        raise _bad(f"'{where}': cannot map the passed CUDA allocation ({exc})") from None
    return as_byte_tensor(allocation).untyped_storage()


def _map_shm(desc: ShmStorage, where: str) -> _Region:
    path = f"/proc/{desc.pid}/fd/{desc.fd}"
    _check_shared_memory(path, where)  # before opening: never open a device or a pipe a client points at
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _bad(f"'{where}': cannot open {path} ({exc.strerror}); is the client on this host?") from None
    try:
        # Checked again on this process's own descriptor: the client cannot swap the file before the map.
        own = f"/proc/self/fd/{fd}"
        _check_shared_memory(own, where)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _bad(f"'{where}': {path} is not a regular shared-memory file")
        file_size = info.st_size
        end = desc.offset_bytes + desc.nbytes
        if desc.nbytes == 0 or end > file_size:
            raise _bad(
                f"'{where}': bytes [{desc.offset_bytes}, {end}) must be non-empty and inside the {file_size}-byte "
                "shared memory"
            )
        # MAP_SHARED up to `end` (never past the file's end: that would grow it): the mapping, not the
        # descriptor, keeps the memory alive from here.
        # torch types _StorageBase.from_file as returning any storage; UntypedStorage's returns an UntypedStorage.
        storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(own, True, end))
    finally:
        os.close(fd)
    return _Region(storage, desc.offset_bytes, desc.nbytes)


def _check_shared_memory(path: str, where: str) -> None:
    try:
        target = os.readlink(path)
    except OSError as exc:
        raise _bad(f"'{where}': cannot read {path} ({exc.strerror}); is the client on this host?") from None
    if not is_shared_memory(target):
        raise _bad(f"'{where}': {path} is {target!r}, not shared memory (a memfd or a file in /dev/shm)")


def _map_cuda_ipc(desc: CudaIpcStorage, where: str) -> torch.UntypedStorage:
    if not torch.cuda.is_available():
        raise _bad(f"'{where}' is a CUDA IPC handle but this server sees no CUDA device")
    device = _device_by_uuid(desc.device_uuid, where)
    try:
        return torch.UntypedStorage._new_shared_cuda(
            device,
            desc.handle,
            desc.nbytes,
            desc.offset_bytes,
            desc.ref_counter_handle,
            desc.ref_counter_offset,
            desc.event_handle,
            desc.event_sync_required,
        )
    except RuntimeError as exc:
        raise _bad(f"'{where}': cannot open the CUDA IPC handle ({exc})") from None


def _device_by_uuid(uuid: str, where: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise _bad(f"'{where}.device_uuid'={uuid!r} is not a GPU this server sees (CUDA_VISIBLE_DEVICES?)")
