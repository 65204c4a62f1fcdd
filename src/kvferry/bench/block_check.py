"""Whether a timed transfer between an engine's KV blocks and somewhere else moved the right bytes, on any device.

A benchmark stores from a set of source blocks and loads into a set of destination blocks. Before each round the
source blocks get new random bytes (`BlockCheck.refresh_source`: a store must copy this round's bytes, and a load
that hands back an earlier round's shows); before each load the destination blocks get random bytes too
(`poison`: never zeros, which a copy that did not happen could leave looking right) and the whole KV buffer is
snapshotted. After the load (`verify`), outside its timed region: every destination block holds, in every layer,
the bytes of the source block at its position, and every other byte of the buffer is what the snapshot holds.
Any difference raises `BenchError`, naming the first layer and block it found.

`ChunkCheck` checks a chunk stored from some blocks of an engine's KV and retrieved into blocks of the same KV
(the same ones reordered, say) through the torch backend, for any format: the source blocks' bytes read before the
store, the destination blocks filled with random bytes before the retrieve, and read back after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvferry import Direction
from kvferry.bench.codec_checks import fill_random
from kvferry.bench.harness import BenchError
from kvferry.formats import EngineKVFormat, KVGeometry
from kvferry.transfer import transfer


class BlockCheck:
    """``raw``: the buffer the ``layers`` views lie in (vLLM's one KV allocation), ``src`` and ``dst``: the layers'
    block indices (dim 0) a store reads and a load writes, position for position; ``seed`` seeds the random bytes."""

    def __init__(
        self, raw: torch.Tensor, layers: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int], seed: int = 0
    ) -> None:
        if len(src) != len(dst) or set(src) & set(dst):
            raise BenchError(f"source blocks {list(src)} and destination blocks {list(dst)} must pair up, disjoint")
        self.device = raw.device
        self._raw = raw.view(torch.uint8)
        self._layers = [layer.view(torch.uint8) for layer in layers]  # bytes: random fills may be NaNs as floats
        self._snapshot = torch.empty_like(self._raw)
        self._snapshot_layers = [self._on_snapshot(layer) for layer in self._layers]
        self.src = torch.as_tensor(list(src), dtype=torch.int64, device=self.device)
        self.dst = torch.as_tensor(list(dst), dtype=torch.int64, device=self.device)
        self._random = torch.Generator(device=self.device)
        self._random.manual_seed(seed)

    def _on_snapshot(self, layer: torch.Tensor) -> torch.Tensor:
        """The same view of the snapshot as ``layer`` is of the buffer."""
        return self._snapshot.as_strided(layer.shape, layer.stride(), layer.storage_offset())

    def _fill(self, blocks: torch.Tensor) -> None:
        for layer in self._layers:
            shape = (len(blocks), *layer.shape[1:])
            noise = torch.randint(0, 256, shape, dtype=torch.uint8, device=self.device, generator=self._random)
            layer.index_copy_(0, blocks, noise)

    def refresh_source(self) -> None:
        """New random bytes in every layer's source blocks (what the next store must copy)."""
        self._fill(self.src)

    def poison(self) -> None:
        """Random bytes in every layer's destination blocks, then a snapshot of the whole buffer."""
        self._fill(self.dst)
        self._snapshot.copy_(self._raw)

    def verify(self, what: str) -> None:
        """The destination blocks hold the source blocks' bytes and nothing else changed since `poison`."""
        for i, layer in enumerate(self._layers):
            stored, loaded = layer.index_select(0, self.src), layer.index_select(0, self.dst)
            if not torch.equal(stored, loaded):
                wrong = (stored != loaded).flatten(1).any(1)
                at = int(wrong.nonzero()[0])
                raise BenchError(
                    f"{what}: layer {i}: block {int(self.dst[at])} does not hold the bytes of block "
                    f"{int(self.src[at])} it was stored from ({int(wrong.sum())} of {len(wrong)} blocks wrong)"
                )
        for layer, kept in zip(self._layers, self._snapshot_layers, strict=True):
            kept.index_copy_(0, self.dst, layer.index_select(0, self.dst))  # the bytes the load was to write
        if not torch.equal(self._snapshot, self._raw):
            changed = self._snapshot != self._raw
            raise BenchError(
                f"{what}: {int(changed.sum())} bytes outside the destination blocks changed (the first at byte "
                f"{int(changed.nonzero()[0])} of the KV buffer)"
            )


def check_count(what: str, got: int, want: int) -> None:
    """A transfer that reports moving fewer (or more) tokens than asked is a failure, not a fast sample."""
    if got != want:
        raise BenchError(f"{what}: moved {got} tokens, not the {want} asked for")


class ChunkCheck:
    """One chunk of `tokens` tokens of `paged` (format `fmt`, plain geometry `geom`): `remember(src)` before its
    store, `poison(dst)` before its retrieve, `verify(what, dst)` after it (each untimed; on the engine's device)."""

    def __init__(self, fmt: EngineKVFormat, paged: Any, geom: KVGeometry, tokens: int = 256, seed: int = 0) -> None:
        self._fmt, self._paged, self._geom, self._tokens = fmt, paged, geom, tokens
        shape = (1, *geom.object_shape(tokens))
        self._stored = torch.empty(shape, dtype=geom.dtype, device=geom.device)
        self._read = torch.empty_like(self._stored)
        self._random = torch.empty_like(self._stored)
        fill_random(self._random.view(torch.uint8).view(-1), seed)

    def _move(self, chunk: torch.Tensor, blocks: Sequence[int], direction: Direction) -> None:
        transfer(self._paged, chunk, blocks, direction, self._fmt, self._tokens, geometry=self._geom, backend="torch")
        if chunk.is_cuda:
            torch.cuda.synchronize(chunk.device)

    def remember(self, src: Sequence[int]) -> None:
        """The bytes of blocks `src`, in order: what the store that follows must keep."""
        self._move(self._stored, src, Direction.D2H)

    def poison(self, dst: Sequence[int]) -> None:
        """Random bytes (never zeros) in blocks `dst`: a retrieve that leaves one unwritten then shows."""
        self._move(self._random, dst, Direction.H2D)

    def verify(self, what: str, dst: Sequence[int]) -> None:
        """Blocks `dst` hold, in order, the bytes `remember` read."""
        self._move(self._read, dst, Direction.D2H)
        got, want = self._read.view(torch.uint8), self._stored.view(torch.uint8)
        if not torch.equal(got, want):
            raise BenchError(
                f"{what}: {int((got != want).sum())} of {want.numel()} bytes of its blocks differ from the blocks "
                "the chunk was stored from"
            )
