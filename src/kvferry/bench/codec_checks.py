"""What `kvferry bench codec` checks of every call it times: a store's objects, and the engine's KV after a retrieve,
against the torch backend's store and retrieve of the same bytes, byte for byte.

Before each timed call the memory it writes is filled with random bytes (outside the timed region: bytes the call
does not write then show, where zeros could pass), and after it that memory must equal the torch backend's result,
computed once: a store's objects from the same blocks, or the engine's tensors after a retrieve of the same objects
into the same random bytes (so a write outside the request's blocks shows too). A mismatch is a `BenchError`.
Device-agnostic: on the CPU the torch backend can stand for the kernel (tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from kvferry import Direction
from kvferry.bench.harness import BenchError
from kvferry.formats import EngineKVFormat, KVGeometry
from kvferry.transfer import transfer

Objects = torch.Tensor | list[torch.Tensor]  # one tensor of whole objects, or a list of them (as `transfer` takes)


class CallCheck(ABC):
    """The checks around the timed calls of one case: `setup` (untimed, before each call) checks the call before it
    and poisons; `last` checks the final call."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.calls = 0

    def setup(self) -> None:
        if self.calls:
            self._check(f"{self.what} #{self.calls}")
        self.calls += 1
        self._poison()

    def last(self) -> None:
        self._check(f"{self.what} #{self.calls}")

    @abstractmethod
    def _poison(self) -> None:
        """Fill what the call writes with random bytes."""

    @abstractmethod
    def _check(self, what: str) -> None:
        """BenchError unless what the call wrote equals the torch backend's result."""


class StoreCheck(CallCheck):
    """A store of blocks `ids` of `paged` into `objects` (one tensor of objects, or a list of them; geometry `geom`:
    the codec's or the plain one). The reference and the comparison live on the engine's device: the objects are
    copied there to be compared (a DMA, which leaves the host memory as clean as the poisoning does)."""

    def __init__(
        self,
        what: str,
        fmt: EngineKVFormat,
        paged: Any,
        geom: KVGeometry,
        objects: Objects,
        ids: torch.Tensor,
    ) -> None:
        super().__init__(what)
        self.got = (
            [objects.view(torch.uint8)] if isinstance(objects, torch.Tensor) else [o.view(torch.uint8) for o in objects]
        )
        first = objects if isinstance(objects, torch.Tensor) else objects[0]
        reference = torch.empty((len(self.got), *first.shape), dtype=first.dtype, device=geom.device)
        transfer(
            paged,
            reference[0] if isinstance(objects, torch.Tensor) else list(reference),
            ids,
            Direction.D2H,
            fmt,
            geometry=geom,
            backend="torch",
        )
        self.want = reference.view(torch.uint8)
        self.geom = geom
        # Made on the engine's device and copied in by DMA: host memory the CPU has just written is dirty in its
        # caches, and a store's DMA into it then ran slower than into pool memory the CPU has not touched (a
        # one-chunk store measured ~0.6 of the memcpy instead of ~0.85 on the H200).
        self._random = random_like(torch.empty_like(self.want))

    def _poison(self) -> None:
        for got, values in zip(self.got, self._random, strict=True):
            got.copy_(values)
        if self._random.is_cuda:
            torch.cuda.synchronize(self._random.device)

    def _check(self, what: str) -> None:
        got = torch.empty_like(self.want)
        for into, objects in zip(got, self.got, strict=True):
            into.copy_(objects)
        if not torch.equal(got, self.want):
            raise BenchError(f"{what}: its objects differ from the torch backend's: {object_mismatch(self, got)}")


class RetrieveCheck(CallCheck):
    """A retrieve of `objects` into blocks `ids` of `paged`; every byte of `paged`'s storages is compared (its
    other blocks hold the same random bytes in both)."""

    def __init__(
        self,
        what: str,
        fmt: EngineKVFormat,
        paged: Any,
        geom: KVGeometry,
        objects: Objects,
        ids: torch.Tensor,
    ) -> None:
        super().__init__(what)
        self.storages = storages_of(paged)
        self._poison()
        on_device = (
            objects.to(geom.device) if isinstance(objects, torch.Tensor) else [o.to(geom.device) for o in objects]
        )
        transfer(paged, on_device, ids, Direction.H2D, fmt, geometry=geom, backend="torch")
        self.want = [s.clone() for s in self.storages]

    def _poison(self) -> None:
        """The same random bytes each time, made anew in place (a model's KV is GiBs: no second copy of it kept)."""
        for seed, storage in enumerate(self.storages):
            fill_random(storage, seed)
        if self.storages[0].is_cuda:
            torch.cuda.synchronize(self.storages[0].device)

    def _check(self, what: str) -> None:
        if all(torch.equal(got, want) for got, want in zip(self.storages, self.want, strict=True)):
            return
        wrong = sum(int((got != want).sum()) for got, want in zip(self.storages, self.want, strict=True))
        total = sum(s.numel() for s in self.storages)
        raise BenchError(f"{what}: {wrong} of {total} bytes of the engine's KV differ from the torch backend's")


def storages_of(paged: Any) -> list[torch.Tensor]:
    """Every distinct storage under the engine's tensors (nested lists of them), whole, as flat bytes."""
    found: dict[int, torch.Tensor] = {}
    stack = [paged]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in found:
                found[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=item.device).set_(storage)
        else:
            stack.extend(item)
    return list(found.values())


def random_like(flat: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Random bytes of `flat`'s shape, on its device (made there: a GiB of them in milliseconds on a GPU)."""
    return fill_random(torch.empty(flat.shape, dtype=torch.uint8, device=flat.device), seed)


def fill_random(flat: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """`flat` (bytes) filled with random bytes, the same for the same seed, made on its device; returned."""
    if flat.is_cuda:
        generator = torch.Generator(flat.device).manual_seed(seed)
        return torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=flat.device, generator=generator, out=flat)
    raw = torch.frombuffer(bytearray(np.random.default_rng(seed).bytes(flat.numel())), dtype=torch.uint8)
    return flat.copy_(raw.view(flat.shape))


def object_mismatch(check: StoreCheck, got: torch.Tensor) -> str:
    """How a store's objects (`got`, as `check.want` lies) differ from the torch backend's: counts (an fp8 object's
    value bytes and scale bytes apart), and the first few as (index, the reference's e4m3 value, the kernel's)."""
    bad = got != check.want
    codec = check.geom.codec
    if codec is None:
        return f"{int(bad.sum())} of {bad.numel()} bytes"
    width = codec.width
    values, scales = bad[..., :width], bad[..., width:]
    e4m3 = torch.float8_e4m3fn
    few = [
        (tuple(i), check.want[tuple(i)].view(e4m3).item(), got[tuple(i)].view(e4m3).item())
        for i in values.nonzero()[:4].tolist()
    ]
    return f"{int(values.sum())} value bytes, {int(scales.sum())} scale bytes; first values: {few}"
