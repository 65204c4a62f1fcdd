"""HostPool against a simple model: live allocations with their bytes, everything else derived from them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvferry.memory import HostPool, PoolFullError

DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.float64, torch.complex128]
shapes = st.lists(st.integers(1, 300), min_size=0, max_size=3).map(tuple)


class HostPoolMachine(RuleBasedStateMachine):
    """Allocations succeed iff a free gap fits them, never overlap, keep their data; accounting is exact."""

    @initialize(alignment=st.sampled_from([64, 512, 4096]), units=st.integers(1, 48))
    def create(self, alignment: int, units: int) -> None:
        self.alignment = alignment
        self.pool = HostPool(units * alignment, alignment=alignment)
        self.live: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, the bytes written into it)
        self.freed: list[torch.Tensor] = []
        self.generator = torch.Generator().manual_seed(units)

    def gaps(self) -> list[int]:
        gaps = []
        cursor = 0
        for tensor, _ in sorted(self.live, key=lambda item: self.pool.offset_of(item[0])):
            offset = self.pool.offset_of(tensor)
            assert offset % self.alignment == 0 and offset >= cursor, "misaligned or overlapping allocation"
            if offset > cursor:
                gaps.append(offset - cursor)
            cursor = offset + self.reserved(tensor)
        if cursor < self.pool.capacity_bytes:
            gaps.append(self.pool.capacity_bytes - cursor)
        return gaps

    def reserved(self, tensor: torch.Tensor) -> int:
        return -(-tensor.numel() * tensor.element_size() // self.alignment) * self.alignment

    def record(self, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        raw = tensor.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=self.generator))
        self.live.append((tensor, raw.clone()))

    def expected_reserved(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        return -(-nbytes // self.alignment) * self.alignment

    @rule(shape=shapes, dtype=st.sampled_from(DTYPES))
    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        fits = self.expected_reserved(shape, dtype) <= max(self.gaps(), default=0)
        if fits:
            self.record(self.pool.alloc(shape, dtype), shape, dtype)
        else:
            with pytest.raises(PoolFullError):
                self.pool.alloc(shape, dtype)

    @rule(shape=shapes, dtype=st.sampled_from(DTYPES))
    def try_alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        fits = self.expected_reserved(shape, dtype) <= max(self.gaps(), default=0)
        tensor = self.pool.try_alloc(shape, dtype)
        assert (tensor is not None) == fits
        if tensor is not None:
            self.record(tensor, shape, dtype)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        tensor, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.pool.free(tensor)
        self.freed.append(tensor)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_again_is_rejected(self, data: st.DataObject) -> None:
        tensor = data.draw(st.sampled_from(self.freed))
        if any(live.data_ptr() == tensor.data_ptr() for live, _ in self.live):
            return  # its bytes were handed out again: that allocation owns the pointer now
        with pytest.raises(ValueError, match="not a live allocation"):
            self.pool.free(tensor)

    @invariant()
    def accounting_is_exact(self) -> None:
        gaps = self.gaps()
        assert self.pool.used_bytes == sum(self.reserved(t) for t, _ in self.live)
        assert self.pool.requested_bytes == sum(t.numel() * t.element_size() for t, _ in self.live)
        assert self.pool.free_bytes == sum(gaps) == self.pool.capacity_bytes - self.pool.used_bytes
        assert self.pool.largest_free_bytes == max(gaps, default=0)
        assert self.pool.num_free_extents == len(gaps) <= len(self.live) + 1
        assert self.pool.num_allocations == len(self.live)

    @invariant()
    def data_is_intact(self) -> None:
        for tensor, expected in self.live:
            assert torch.equal(tensor.view(-1).view(torch.uint8), expected)


HostPoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_host_pool_machine = HostPoolMachine.TestCase
