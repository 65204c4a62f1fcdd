"""One case of `kvferry bench gpu-transfer`: a model-shaped engine KV cache on the GPU, chunk objects in a pinned
`HostPool` (scattered, back to back, or one tensor) and random block ids; the checks of a transfer of its blocks
against the torch backend's (`kvferry.bench.codec_checks`); and the plain-torch baseline."""

from __future__ import annotations

from collections.abc import Callable

import torch

import kvferry
from kvferry import Direction
from kvferry.bench.codec_checks import CallCheck, RetrieveCheck, StoreCheck, fill_random
from kvferry.bench.gpu_timeline import Waitable
from kvferry.formats import EngineKVFormat, describe, layout_of
from kvferry.formats.synthetic import MODELS, ModelDims, make_paged
from kvferry.memory import HostPool
from kvferry.transfer.gpu_engine import TransferEngine

F = EngineKVFormat
SHAPES = {"llama3-8b": 16, "qwen2.5-0.5b": 16, "deepseek-v3-mla": 64}  # block size per model


class Setup:
    def __init__(
        self, model: str, fmt: F, n_chunks: int, chunk: int = 256, nb: int = 4096, gaps: bool = True, run: bool = False
    ) -> None:
        """`gaps`: objects scattered in the pool (a small hole after each); `run`: one tensor of all objects."""
        dims = MODELS[model]
        if layout_of(fmt).is_mla and not layout_of(fmt).nesting.count("NP"):
            dims = ModelDims(nl=dims.nl, nh=1, hs=sum(dims.plane_widths) or dims.hs)
        if not layout_of(fmt).is_mla and model == "deepseek-v3-mla":
            dims = MODELS["llama3-8b"]
        if fmt == F.NL_X_NB_BSV_BSS:
            dims = ModelDims(nl=61, nh=1, hs=132)
        bs = SHAPES[model]
        dtype = torch.uint8 if fmt == F.NL_X_NB_BSV_BSS else torch.bfloat16
        self.fmt, self.chunk, self.bs = fmt, chunk, bs
        self.paged = make_paged(fmt, dims, nb, bs, dtype, device="cuda")
        self.geom = describe(fmt, self.paged, block_size=bs)
        obj_bytes = self.geom.bytes_per_token * chunk
        self.pool = HostPool(1 << max(30, (obj_bytes * n_chunks * 2).bit_length()))
        listed: list[torch.Tensor] = []
        for _ in range(0 if run else n_chunks):
            listed.append(self.pool.alloc(self.geom.object_shape(chunk), dtype))
            if gaps:  # scattered in the pool: a small hole after each object
                self.pool.alloc((4096,), torch.uint8)
        self.objects = self.pool.alloc((n_chunks, *self.geom.object_shape(chunk)), dtype) if run else listed
        self.ids = torch.randperm(nb)[: n_chunks * chunk // bs]
        self.nbytes = obj_bytes * n_chunks

    def run(self, direction: Direction, engine: TransferEngine, mode: str | None = None) -> None:
        self.start(direction, engine, mode).wait()

    def start(self, direction: Direction, engine: TransferEngine, mode: str | None = None) -> Waitable:
        """The request enqueued: its handle."""
        return kvferry.transfer_async(
            self.paged,
            self.objects,
            self.ids,
            direction,
            self.fmt,
            self.chunk,
            geometry=self.geom,
            engine=engine,
            mode=mode,
        )

    def runner(self, direction: Direction, engine: TransferEngine, mode: str | None) -> Callable[[], None]:
        return lambda: self.run(direction, engine, mode)

    def check(self, direction: Direction, what: str) -> CallCheck:
        """The check of a transfer of this case in `direction`: a store's objects, or the whole KV after a retrieve,
        equal to the torch backend's. A retrieve's objects first get random bytes (never what an earlier store or a
        fresh pool left, which may be zeros), copied in by DMA from the GPU as a store's are poisoned: host memory
        the CPU has just written sits dirty in its caches, which slows the DMA that follows."""
        if direction is Direction.D2H:
            return StoreCheck(what, self.fmt, self.paged, self.geom, self.objects, self.ids)
        listed = [self.objects] if isinstance(self.objects, torch.Tensor) else self.objects
        for seed, obj in enumerate(listed, start=1000):  # seeds apart from those of the KV's random bytes
            raw = obj.view(torch.uint8)
            raw.copy_(fill_random(torch.empty_like(raw, device=self.geom.device), seed))
        torch.cuda.synchronize()
        return RetrieveCheck(what, self.fmt, self.paged, self.geom, self.objects, self.ids)


def by_hand(s: Setup) -> Callable[[], None]:
    """The plain-torch baseline ('torch by hand'): per layer kv[l][:, ids] into a GPU buffer, then one D2H copy."""
    ids = s.ids.cuda()
    buf = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)
    per_layer = s.nbytes // len(s.paged)

    def once() -> None:
        for i, t in enumerate(s.paged):
            buf[i * per_layer : (i + 1) * per_layer].view(t.dtype).view(-1).copy_(t[:, ids].reshape(-1))
        host.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()

    return once
