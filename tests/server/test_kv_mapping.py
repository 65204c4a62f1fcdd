"""Registration descriptors: export on the client, map on the server, and every bound checked first."""

from __future__ import annotations

import copy
import mmap
import os
from typing import Any

import pytest
import torch

from kvferry.client.kv_export import export_kv
from kvferry.client.shared_files import shared_file
from kvferry.protocol.messages import ProtocolError
from kvferry.server.kv_mapping import map_kv
from kvferry.server.requests import RegisterArgs
from tests.server.serverkit import shm_mappings, shm_name


def register_args(storages: list[dict[str, Any]], kv: Any) -> RegisterArgs:
    return RegisterArgs.model_validate({"format": 1, "namespace": {"model": "m"}, "storages": storages, "kv": kv})


def exported(paged: Any) -> tuple[list[dict[str, Any]], Any]:
    storages, kv = export_kv(paged)
    return copy.deepcopy(storages), copy.deepcopy(kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8])
def test_round_trip_keeps_nesting_views_and_bytes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (2, 3, 4, 5, 6), generator=gen, dtype=torch.uint8)
    buffer = raw.view(dtype) if dtype.itemsize == 1 else torch.randn(2, 3, 4, 5, 6, generator=gen).to(dtype)
    paged = [[buffer[0, i] for i in range(3)], (buffer[1, 0], buffer[1, 1].transpose(0, 2))]  # a strided view too
    storages, kv = exported(paged)
    assert len(storages) == 1  # every view shares the one storage
    mapped = map_kv(register_args(storages, kv))
    assert mapped.num_tensors == 5 and mapped.mapped_bytes == buffer.nbytes
    flat_in = [*paged[0], *paged[1]]
    flat_out = [*mapped.paged[0], *mapped.paged[1]]
    for a, b in zip(flat_in, flat_out, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    name = shm_name(buffer)
    assert not os.path.exists("/dev/shm" + name)  # unlinked from the start: nothing in /dev/shm can leak
    assert shm_mappings(name) == 2
    mapped.close()
    del flat_out, b  # (the loop variable holds the last view)
    assert shm_mappings(name) == 1  # the server side's mapping went with its last reference


def test_separate_allocations_are_separate_storages() -> None:
    paged = [torch.randn(4, 8), torch.randn(4, 8)]
    storages, kv = exported(paged)
    assert [v["storage"] for v in kv] == [0, 1] and len({s["fd"] for s in storages}) == 2
    mapped = map_kv(register_args(storages, kv))
    assert all(torch.equal(a, b) for a, b in zip(paged, mapped.paged, strict=True))


def memfd_tensor(nbytes: int, offset: int = 0) -> tuple[torch.Tensor, int, mmap.mmap]:
    """Host memory as SGLang's ``shm`` allocator makes it: a memfd mapped shared, a tensor over the mapping from
    ``offset``; the descriptor and the mapping (the caller closes both)."""
    fd = os.memfd_create("sglang_host_pool_test", os.MFD_CLOEXEC)
    size = -(-(offset + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset), fd, mm


@pytest.mark.parametrize("offset", [0, 4096 + 64])
def test_memory_shared_through_a_memfd_is_mapped_as_it_is(offset: int) -> None:
    """A tensor over a shared memfd mapping is passed by its own descriptor and offset, with no copy: the server's
    view and the engine's are one memory (a write through either shows in the other)."""
    buffer, fd, mm = memfd_tensor(3 * 4096, offset)
    try:
        buffer.copy_(torch.randint(0, 256, buffer.shape, generator=torch.Generator().manual_seed(3), dtype=torch.uint8))
        address = buffer.data_ptr()
        paged = [buffer[:4096].view(torch.float32), buffer[4096:].view(2, -1)]
        storages, kv = exported(paged)
        assert buffer.data_ptr() == address  # not moved into a file of torch's
        assert storages == [{"kind": "shm_fd", "pid": os.getpid(), "fd": fd, "offset_bytes": offset,
                             "nbytes": 3 * 4096}]  # fmt: skip
        mapped = map_kv(register_args(storages, kv))
        assert torch.equal(mapped.paged[1].view(torch.uint8).flatten(), buffer[4096:])
        mapped.paged[0].view(torch.uint8).fill_(0xA5)  # the server writes: the engine sees it
        assert bool((buffer[:4096] == 0xA5).all()) and not bool((buffer[4096:] == 0xA5).all())
        mapped.close()
    finally:
        del buffer
        mm.close()
        os.close(fd)


def test_memory_not_shared_through_a_file_is_moved_into_torchs() -> None:
    """A private mapping of a memfd (or plain memory) is not shared as it is: torch moves it into its own file."""
    fd = os.memfd_create("private", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE)
    try:
        assert shared_file(torch.frombuffer(mm, dtype=torch.uint8).data_ptr(), 4096) is None
        plain = torch.zeros(4096, dtype=torch.uint8)
        assert shared_file(plain.data_ptr(), 4096) is None
        (storage,), _ = exported(plain)
        assert storage["fd"] != fd and shm_name(plain)  # torch's unlinked /dev/shm file
    finally:
        mm.close()
        os.close(fd)


def test_export_rejects_what_cannot_be_shared() -> None:
    with pytest.raises(ValueError, match=r"paged\[1\] is an empty list"):
        export_kv([torch.randn(2), []])
    with pytest.raises(TypeError, match=r"paged\[0\] must be a tensor"):
        export_kv(["x"])
    with pytest.raises(ValueError, match="is on meta"):
        export_kv(torch.empty(4, device="meta"))


def corrupt(change) -> str:
    """The error message map_kv gives for a valid export of one tensor after `change(storage, view)`."""
    tensor = torch.randn(8, 16)
    storages, kv = exported(tensor)
    change(storages[0], kv)
    with pytest.raises(ProtocolError) as err:
        map_kv(register_args(storages, kv))
    return err.value.message


def test_out_of_bounds_views_are_refused() -> None:
    assert "past the 512-byte storage" in corrupt(lambda s, v: v.update(shape=[9, 16]))
    assert "past the 512-byte storage" in corrupt(lambda s, v: v.update(offset=1))
    assert "past the 512-byte storage" in corrupt(lambda s, v: v.update(stride=[17, 1]))
    assert "has an empty dimension" in corrupt(lambda s, v: v.update(shape=[0, 16]))
    assert "same 1..8 dims" in corrupt(lambda s, v: v.update(stride=[16]))


def test_bad_storages_are_refused() -> None:
    with open(__file__) as other_file:  # a descriptor of this process that is not shared memory
        assert "not shared memory (a memfd or a file in /dev/shm)" in corrupt(
            lambda s, v: s.update(fd=other_file.fileno())
        )
    assert "cannot read /proc/" in corrupt(lambda s, v: s.update(fd=1_000_000))
    assert "cannot read /proc/" in corrupt(lambda s, v: s.update(pid=2**22 + 1))
    assert "must be non-empty and inside" in corrupt(lambda s, v: s.update(nbytes=s["nbytes"] + 4096))
    assert "'kv.storage'=3 is outside the 1 registered storages" in corrupt(lambda s, v: v.update(storage=3))
    assert "not one of" in corrupt(lambda s, v: v.update(dtype="complex64"))
    misaligned = lambda s, v: (s.update(offset_bytes=2, nbytes=s["nbytes"] - 4), v.update(shape=[4, 16]))  # noqa: E731
    assert "not a multiple of 4" in corrupt(misaligned)


def test_bad_nesting_is_refused() -> None:
    tensor = torch.randn(8)
    storages, kv = exported(tensor)
    for bad, fragment in [([], "non-empty list"), ([[[[[kv]]]]], "at most 4 deep"), ([kv, 3], "kv[1]' must be")]:
        with pytest.raises(ProtocolError, match=fragment.replace("[", r"\[")):
            map_kv(register_args(storages, bad))
    with pytest.raises(ProtocolError, match=r"'kv\.shape'"):
        map_kv(register_args(storages, {**kv, "shape": "big"}))


def test_cuda_handles_are_refused_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    storage = {
        "kind": "cuda_ipc",
        "device_uuid": "GPU-0",
        "handle": os.urandom(64),
        "nbytes": 64,
        "offset_bytes": 0,
        "ref_counter_handle": b"x",
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": False,
    }
    view = {"storage": 0, "offset": 0, "shape": [4], "stride": [1], "dtype": "float32"}
    with pytest.raises(ProtocolError, match="this server sees no CUDA device"):
        map_kv(register_args([storage], view))
