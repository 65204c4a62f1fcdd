"""Test helpers for the cache: random paged KV tensors in any declared layout, per-block contents, random prompts
and block ids, and small engines over that KV.

Built from ``kvferry.formats``' layout declarations only, so the checks here do not depend on the transfer
code they test: a block's contents are everything in the engine's tensors that belongs to that block.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats.kinds import EngineKVFormat
from kvferry.formats.layouts import layout_of
from kvferry.memory import HostPool
from kvferry.tiers import Tier

# Small geometry: 2 layers, 2 kv heads of 8, 16-token blocks; chunks of 32 tokens (2 blocks).
NL, NH, HS, BS, CHUNK = 2, 2, 8, 16, 32
PER_CHUNK = CHUNK // BS
NB = 64  # engine blocks of the paged KV most tests make
OBJECT_BYTES = NL * 2 * NH * HS * CHUNK * 2  # a chunk object of fp16 KV: 4 KiB


def random_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` random token ids, the same for the same ``seed``."""
    return np.random.default_rng(seed).integers(0, 32_000, size=n).tolist()


def random_blocks(n: int, seed: int) -> list[int]:
    """``n`` distinct ids of the ``NB`` engine blocks, in random order."""
    return np.random.default_rng(seed).permutation(NB)[:n].tolist()


def cache_engine(
    objects: int = 64,
    fmt: EngineKVFormat = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
    paged: Any = None,
    block_size: int | None = None,
    tiers: list[Tier] | None = None,
    **cache: Any,
) -> CacheEngine:
    """An engine of ``CHUNK``-token chunks whose pool holds exactly ``objects`` chunk objects of fp16 ``fmt`` KV,
    over ``tiers``, in the key space of ``paged`` (default: a random one of ``NB`` blocks); ``cache``: settings."""
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, **cache}})
    engine = CacheEngine(config, pool=HostPool(objects * OBJECT_BYTES, pin=False), tiers=tiers)
    paged = paged if paged is not None else make_paged(fmt, NB)
    engine.namespace = engine.namespace_for("test-model", fmt, paged, block_size=block_size)
    return engine


def make_paged(fmt: EngineKVFormat, nb: int, *, dtype: torch.dtype = torch.float16, seed: int = 0) -> Any:
    """Random paged KV of ``nb`` blocks in layout ``fmt`` (nested lists/tuples as the layout declares)."""
    layout = layout_of(fmt)
    sizes = {"NL": NL, "TWO": 2, "NB": nb, "BS": BS, "NBBS": nb * BS, "NH": NH, "HS": HS, "CS": 2 * HS, "ONE": 1}
    shape = [sizes[axis] for axis in layout.axes]
    gen = torch.Generator().manual_seed(seed)

    def build(levels: tuple[str, ...]) -> Any:
        if not levels:
            return (torch.randn(shape, generator=gen) * 4).to(dtype)
        return [build(levels[1:]) for _ in range(sizes[levels[0]])]

    return build(layout.nesting)


def leaves(paged: Any) -> list[torch.Tensor]:
    if isinstance(paged, torch.Tensor):
        return [paged]
    return [t for item in paged for t in leaves(item)]


def block_contents(paged: Any, fmt: EngineKVFormat, block: int) -> torch.Tensor:
    """Everything stored for engine block ``block``, flattened (a copy)."""
    axes = layout_of(fmt).axes
    pieces = []
    for tensor in leaves(paged):
        if "NB" in axes:
            pieces.append(tensor.select(axes.index("NB"), block).reshape(-1))
        else:
            pieces.append(tensor.narrow(axes.index("NBBS"), block * BS, BS).reshape(-1))
    return torch.cat(pieces)


def assert_blocks_equal(src: Any, src_ids: list[int], dst: Any, dst_ids: list[int], fmt: EngineKVFormat) -> None:
    assert len(src_ids) == len(dst_ids)
    for i, (s, d) in enumerate(zip(src_ids, dst_ids, strict=True)):
        assert torch.equal(block_contents(src, fmt, s), block_contents(dst, fmt, d)), f"block {i}: {s}->{d} differs"


class AheadCopies:
    """Makes a CPU engine's stores take the GPU path's order (`ChunkWriter._ahead`): the copy is enqueued first and
    lands only when waited for, into objects poisoned at enqueue, so a chunk made readable before its copy has
    landed reads as poison. Counts the copies enqueued and waited for."""

    POISON = -7.25

    def __init__(self, monkeypatch: Any) -> None:
        from kvferry.cache import writer
        from kvferry.transfer import transfer
        from kvferry.transfer.request import check_pool_addresses

        self.enqueued = 0
        self.waited = 0
        owner = self

        class Later:
            def __init__(self, geom: Any, objects: list[torch.Tensor], ids: Any) -> None:
                self.args, self.done = (geom, objects, ids), False
                for obj in objects:
                    obj.fill_(AheadCopies.POISON)

            def wait(self) -> None:
                if not self.done:
                    geom, objects, ids = self.args
                    transfer(None, objects, ids, "D2H", geom.fmt, CHUNK, 0, geometry=geom)
                    self.done = True
                    owner.waited += 1

        def enqueue(geom: Any, addresses: list[int], ids: Any, direction: Any, chunk: int, skip: int) -> Any:
            checked = check_pool_addresses(geom, addresses, ids, direction, chunk, skip)  # what the GPU path refuses
            owner.enqueued += 1
            shape = geom.object_shape(chunk)
            return Later(geom, [_tensor_at(a, shape, geom.dtype) for a in addresses], list(checked.ids))

        monkeypatch.setattr(writer, "copies_in_background", lambda geom, pool: True)
        monkeypatch.setattr(writer, "transfer_pool_at_async", enqueue)


def _tensor_at(address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over host memory at ``address`` (what a GPU kernel would write through the address)."""
    nbytes = dtype.itemsize * math.prod(shape)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype).view(shape)
