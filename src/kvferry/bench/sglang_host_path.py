"""A prefix of SGLang host-pool pages stored through kvferry's HiCache storage backend and loaded into other pages,
checked, as `kvferry bench sglang-host` times it.

The pool is SGLang's MHA host pool in its default ``page_first`` layout (``[2, tokens, layers, heads, head dim]``),
built here without SGLang: in plain memory (SGLang's default allocator) or, for ``shm``, in a memfd mapped shared
(what SGLang's ``"allocator": "shm"`` does), which a server maps as it is. The backend's own page store
(`kvferry.integrations.sglang.page_store`) moves the pages, as SGLang's ``batch_set_v1`` / ``batch_get_v1`` calls
it. Each round stores the source pages under new keys (new bytes in them), then loads them into the destination
pages (poisoned first); the check, outside the timed calls, wants each destination page equal to its source and
every other byte of the pool unchanged.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

from kvferry.bench.harness import BenchError
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.host_pages import HostPages
from kvferry.integrations.sglang.page_store import PageKeySpace, open_page_store

POISON = 0xA5


class HostPath:
    """``pages`` pages of a ``layers`` x ``heads`` x ``head_dim`` bf16 host pool, stored from scattered pages and
    loaded into others; ``shared``: the pool in a shared memfd mapping."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        page_size: int,
        pages: int,
        shared: bool,
    ) -> None:
        total = 2 * pages + 1  # page 0 left alone: a byte written there is outside every page the bench moves
        shape = (2, total * page_size, layers, heads, head_dim)
        self._mapping: tuple[int, mmap.mmap] | None = None
        if shared:
            buffer, fd, mapping = _shared_buffer(shape)
            self._mapping = (fd, mapping)
        else:
            buffer = torch.empty(shape, dtype=torch.bfloat16)
        buffer.view(torch.uint8).fill_(1)  # every page touched before the timing
        self.host = HostPages(buffer.unflatten(1, (total, page_size)), "page_first", False, page_size)
        self._bytes = self.host.pages.view(torch.uint8)  # [2, pages, page, layers, heads, head bytes]
        order = (torch.randperm(total - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        self.src, self.dst = torch.tensor(order[:pages]), torch.tensor(order[pages : 2 * pages])
        self._kept = torch.ones(total, dtype=torch.bool)
        self._kept[self.dst] = False
        self.nbytes = pages * self.host.page(0).numel() * buffer.element_size()
        self.name = f"{layers}L-{heads}x{head_dim}-page{page_size}"
        self.store_ = open_page_store(settings, self.host, PageKeySpace(f"bench/{self.name}", 1, 0), name="bench")
        self._generator = torch.Generator().manual_seed(7)
        self._round = 0
        self.keys: list[str] = []
        self._before = torch.empty(0)

    @property
    def direct(self) -> bool:
        """Whether pages move straight between the pool and the cache (no staging buffer)."""
        return self.store_.direct is not None

    def next_round(self) -> None:
        """New keys for the prefix and new bytes in its source pages."""
        self._round += 1
        self.keys = [f"{self._round:032x}{i:032x}" for i in range(len(self.src))]
        shape = self._bytes.index_select(1, self.src).shape
        self._bytes.index_copy_(1, self.src, torch.randint(0, 256, shape, generator=self._generator, dtype=torch.uint8))

    def store(self) -> None:
        stored = self.store_.store(self.keys, self.src)
        if not all(stored):
            raise BenchError(f"{self.name}: {stored.count(False)} of {len(stored)} pages were not stored")

    def before_load(self) -> None:
        """The destination pages poisoned, the pool kept to compare, the prefix found (SGLang's ``batch_exists``)."""
        self._bytes.index_fill_(1, self.dst, POISON)
        self._before = self._bytes.clone()
        found = self.store_.exists(self.keys)
        if found != len(self.keys):
            raise BenchError(f"{self.name}: {found} of {len(self.keys)} pages found after they were stored")

    def load(self) -> None:
        loaded = self.store_.load(self.keys, self.dst)
        if not all(loaded):
            raise BenchError(f"{self.name}: {loaded.count(False)} of {len(loaded)} pages were not loaded")

    def check_load(self) -> None:
        """Every destination page holds its source page's bytes; every other byte is unchanged."""
        if not torch.equal(self._bytes.index_select(1, self.dst), self._bytes.index_select(1, self.src)):
            raise BenchError(f"{self.name}: a destination page does not hold its source's bytes")
        if not torch.equal(self._bytes[:, self._kept], self._before[:, self._kept]):
            raise BenchError(f"{self.name}: the load wrote outside its destination pages")

    def close(self) -> None:
        self.store_.close()
        del self.host, self._bytes, self._before
        if self._mapping is not None:
            fd, mapping = self._mapping
            with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with it
                mapping.close()
            os.close(fd)


def _shared_buffer(shape: tuple[int, ...]) -> tuple[torch.Tensor, int, mmap.mmap]:
    """A bf16 tensor of ``shape`` over a memfd mapped shared, as SGLang's ``shm`` allocator makes its host pool; its
    descriptor (open: the server maps the memory through it) and mapping, for the caller to close."""
    nbytes = 2 * int(torch.Size(shape).numel())
    fd = os.memfd_create("kvferry_bench_host_pool", os.MFD_CLOEXEC)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
    return torch.frombuffer(mapping, dtype=torch.bfloat16, count=nbytes // 2).view(shape), fd, mapping
