"""GPU KV in driver-mapped memory, allocated as vLLM 0.34's extensible KV cache allocates it for a connector that
declares EXPORTS_FD (`kvferry.cuda.vmm_alloc`: one reserved range, a cuMemCreate'd allocation with the POSIX-fd
handle type per layer segment, cuMemMap + cuMemSetAccess), shared with a `kvferry server` by file descriptor.

Run on a CUDA machine: `PYTHONPATH=src python3 -m pytest -m gpu tests/server/test_server_vmm_gpu.py`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvferry.client import KvferryClient
from kvferry.cuda.driver import CudaError, primary_context
from kvferry.cuda.vmm import ImportedAllocation, as_byte_tensor, export_allocation, is_legacy_ipc_capable
from kvferry.cuda.vmm_alloc import DriverMappedSegments
from kvferry.protocol.fd_passing import close_all
from tests.server.serverkit import (
    FMT_REAL,
    REAL_BS,
    REAL_CHUNK,
    REAL_NS,
    ServerProcess,
    blocks,
    real_kv,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.25", "--heartbeat-timeout", "10", ipc=True)
    yield proc
    assert proc.stop() == 0, "".join(proc.log)


def vmm_kv(seed: int, handle_types: int | None = None) -> tuple[DriverMappedSegments, list[torch.Tensor]]:
    """`real_kv(seed)` copied into driver-mapped memory: each layer at the start of its own segment (allocation)."""
    source = real_kv(seed)
    layer_bytes = source[0].numel() * source[0].element_size()
    extra = {} if handle_types is None else {"handle_types": handle_types}
    segments = DriverMappedSegments([layer_bytes] * len(source), torch.cuda.current_device(), **extra)
    whole = segments.tensor()
    layers = [
        whole[offset : offset + layer_bytes].view(layer.dtype).view(layer.shape)
        for offset, layer in zip(segments.offsets, source, strict=True)
    ]
    for layer, values in zip(layers, source, strict=True):
        layer.copy_(values)
    torch.cuda.synchronize()
    return segments, layers


def test_an_allocation_exported_and_imported_is_the_same_memory() -> None:
    """The driver calls alone (one process): the import maps the pages the export names."""
    segments, layers = vmm_kv(seed=30)
    assert not is_legacy_ipc_capable(layers[1].data_ptr())
    exported = export_allocation(layers[1].data_ptr() + 4096)  # any address inside the allocation
    try:
        assert (exported.base, exported.nbytes) == (segments.address + segments.offsets[1], segments.sizes[1])
        device = torch.cuda.current_device()
        imported = ImportedAllocation(exported.fd, exported.nbytes, device, primary_context(device))
    finally:
        close_all([exported.fd])
    mirror = as_byte_tensor(imported)
    layer_bytes = layers[1].numel() * layers[1].element_size()
    assert torch.equal(mirror[:layer_bytes].view(torch.bfloat16).view(layers[1].shape), layers[1])
    mirror[:layer_bytes].view(torch.bfloat16).view(layers[1].shape)[:, 5].fill_(3.0)
    torch.cuda.synchronize()
    assert bool((layers[1][:, 5] == 3.0).all())
    del mirror
    imported.unmap()
    segments.free()


def test_driver_mapped_kv_stores_and_loads_bit_exact_through_the_server(server: ServerProcess) -> None:
    assert server.ipc_endpoint is not None
    segments, kv = vmm_kv(seed=31)
    tokens = list(range(7000, 7000 + 3 * REAL_CHUNK))
    source_ids = [3, 77, 12, 40, 9, 81, 2, 66, 50, 31, 18, 90]
    target_ids = list(range(60, 72))
    with KvferryClient(server.ipc_endpoint) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        for layer in kv:  # written on this process's stream right before the STORE: the server waits for it
            layer[:, source_ids] = torch.randn_like(layer[:, source_ids])
        assert client.store(reg, tokens, source_ids) == 3 * REAL_CHUNK
        expected = blocks(kv, source_ids).clone()
        before = blocks(kv, target_ids[:4]).clone()
        assert client.retrieve(reg, tokens, target_ids, skip_prefix_tokens=REAL_CHUNK) == 2 * REAL_CHUNK
        assert torch.equal(blocks(kv, target_ids[4:]), expected[:, :, 4:])
        assert torch.equal(blocks(kv, target_ids[:4]), before)
        # An engine with ordinary (cudaMalloc'd, legacy IPC) KV reads the same objects.
        plain = [layer.cuda() for layer in real_kv(seed=32)]
        other = client.register_kv_cache(plain, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        assert client.retrieve(other, tokens, target_ids) == 3 * REAL_CHUNK
        assert torch.equal(blocks(plain, target_ids), expected)
        client.end_session()
    torch.cuda.synchronize()
    segments.free()


def test_after_sleep_and_wake_loads_land_bit_exact_in_the_new_memory(server: ServerProcess) -> None:
    """vLLM's sleep: the registration dropped, the physical memory unmapped and released; wake: new allocations
    mapped at the same addresses and registered again (new descriptors)."""
    assert server.ipc_endpoint is not None
    segments, kv = vmm_kv(seed=33)
    tokens = list(range(20000, 20000 + 2 * REAL_CHUNK))
    ids = list(range(8))
    with KvferryClient(server.ipc_endpoint) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        assert client.store(reg, tokens, ids) == 2 * REAL_CHUNK
        expected = blocks(kv, ids).clone()
        client.unregister_kv_cache(reg)
        torch.cuda.synchronize()
        segments.release_physical()
        segments.commit()
        for layer in kv:  # the new memory's contents are undefined: make them random, never the old bytes
            layer.copy_(torch.randn_like(layer))
        assert not torch.equal(blocks(kv, ids), expected)
        reg = client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        assert client.stats()["server"]["open_registrations"] == 1
        targets = [i + 40 for i in ids]
        assert client.retrieve(reg, tokens, targets) == 2 * REAL_CHUNK
        assert torch.equal(blocks(kv, targets), expected)
        client.end_session()
    torch.cuda.synchronize()
    segments.free()


def test_driver_mapped_memory_without_the_descriptor_handle_type_is_refused_with_the_reason(
    server: ServerProcess,
) -> None:
    assert server.ipc_endpoint is not None
    segments, kv = vmm_kv(seed=34, handle_types=0)
    with (
        KvferryClient(server.ipc_endpoint) as client,
        pytest.raises(CudaError, match="without the POSIX file descriptor handle type"),
    ):
        client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
    segments.free()


def test_driver_mapped_memory_needs_the_server_s_unix_socket(server: ServerProcess) -> None:
    segments, kv = vmm_kv(seed=35)
    with KvferryClient(server.endpoint) as client, pytest.raises(ValueError, match="ipc://PATH"):  # tcp://
        client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
    segments.free()
