"""vLLM's own CPU offload path on the same KV, for `kvferry bench vllm-gpu`: one batched driver DMA of its pages.

vLLM 0.32's OffloadingConnector (``vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker`` and
``vllm.v1.kv_offload.cpu.gpu_worker``) moves blocks between the GPU KV and pinned host memory one page per copy: a
layer's block (``page_size_bytes``, K and V together: 64 KiB for llama3-8b's 16-token bf16 FlashAttention blocks), or,
in a layout whose layers interleave within a block (BLHNC), the whole block of every layer as one page. Pages of
28 KiB and more go to ``swap_blocks_batch``: the driver's ``cuMemcpyBatchAsync``, one descriptor a page. Here the
descriptor arrays (numpy uint64 addresses and sizes) are built once ahead, as a compiled caller would keep them, so
a timed call is the one driver call and the DMA to its end (a synchronize): vLLM building them per transfer is not
counted. A store copies the source blocks' pages to a pinned host buffer, a load copies them from it into the
destination blocks, checked like kvferry's loads (`kvferry.bench.block_check`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvferry.bench.block_check import BlockCheck
from kvferry.bench.harness import BenchError
from kvferry.connector.engine_kv import EngineKV
from kvferry.cuda.driver import driver


def pages(kv: EngineKV, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(device addresses, sizes) of the pages of the scheduler's ``block_ids``, in the order vLLM lists them (layer by
    layer, each layer's blocks in the order given; a block at a time where layers interleave within a block)."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    layer = kv.layers[0]
    if not all(t.shape == layer.shape and t.stride() == layer.stride() for t in kv.layers):
        raise BenchError(f"vLLM's {kv.order} layer views differ in shape: no pages to copy")
    kernel_bytes = layer[0].numel() * layer.element_size()
    page = kernel_bytes * kv.split  # a scheduler block's bytes in one layer
    stride = layer.stride(0) * layer.element_size() * kv.split  # from one scheduler block to the next
    if stride == page and _dense(layer[0]):
        addresses = np.concatenate([np.uint64(t.data_ptr()) + ids * np.uint64(page) for t in kv.layers])
        return addresses, np.full(len(addresses), page, dtype=np.uint64)
    first = min(t.data_ptr() for t in kv.layers)
    if kv.split != 1 or stride != page * len(kv.layers) or max(t.data_ptr() for t in kv.layers) - first >= stride:
        raise BenchError(f"vLLM's {kv.order} blocks are neither a dense page per layer nor every layer's together")
    return np.uint64(first) + ids * np.uint64(stride), np.full(
        len(ids), stride, dtype=np.uint64
    )  # a block of every layer


def _dense(block: torch.Tensor) -> bool:
    """Whether a block's elements fill exactly as many consecutive elements as it has (in any axis order)."""
    return 1 + sum((size - 1) * step for size, step in zip(block.shape, block.stride(), strict=True)) == block.numel()


class PageDMA:
    """vLLM's page copies between ``src``/``dst`` and one pinned host buffer, checked with ``check`` (the connector
    path's: the same blocks); ``label`` names the KV in errors."""

    name = "vLLM page DMA"

    def __init__(self, kv: EngineKV, src: Sequence[int], dst: Sequence[int], check: BlockCheck, label: str) -> None:
        self.label = label
        self._driver = driver()
        if not self._driver.has_batch:
            raise BenchError("this CUDA driver has no cuMemcpyBatchAsync (CUDA 12.8+), vLLM's page DMA")
        src_pages, sizes = pages(kv, src)
        dst_pages, dst_sizes = pages(kv, dst)
        if not np.array_equal(sizes, dst_sizes):
            raise BenchError("the source and destination blocks' pages differ in size")
        self.pages = len(sizes)
        self.nbytes = int(sizes.sum())
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        host_pages = np.uint64(self.host.data_ptr()) + np.cumsum(sizes) - sizes  # the pages back to back
        host_at, src_at, dst_at, sizes_at = (
            np.ascontiguousarray(a, dtype=np.uint64) for a in (host_pages, src_pages, dst_pages, sizes)
        )
        self._store = (host_at, src_at, sizes_at)
        self._load = (dst_at, host_at, sizes_at)
        self._side = torch.cuda.Stream()  # of its own, as vLLM's: the driver refuses a batch on the legacy stream
        self._stream = self._side.cuda_stream
        self.check = check

    def store(self) -> None:
        self._copy(*self._store)

    def before_load(self) -> None:
        self.check.poison()
        torch.cuda.synchronize()

    def load(self) -> None:
        self._copy(*self._load)

    def check_load(self) -> None:
        self.check.verify(f"{self.label}: a load by vLLM's page DMA")

    def _copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        self._driver.copy_pages(dsts, srcs, sizes, self._stream)
        torch.cuda.synchronize()
