"""The timed STORE/RETRIEVE cases of `kvferry bench server`, and the checks that what they timed moved the KV.

A retrieve that misses, or moves fewer tokens or wrong bytes, returns sooner than one that moves everything: timed,
it would pass for a fast one. So every timed store and retrieve must return the tokens asked for, and every
retrieve's blocks are filled with random bytes before it (outside the timed region: bytes it does not write then
show, where zeros could pass for KV) and compared, byte for byte, with what was stored after it. A failed check is
a `BenchError`: the command exits 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvferry.bench.harness import BenchError, Steps
from kvferry.bench.timing import CopyCeiling, latency_summary

Mover = Callable[[list[int], list[int]], int]  # (tokens, block ids) -> the tokens moved


class KVBlocks:
    """An engine's KV (a `[2, NB, BS, NH, HS]` tensor per layer, `kvferry.bench.server_bench.FMT`) as a bench checks
    what its transfers moved: `poison` fills blocks with random bytes, `read` copies blocks' bytes, `check` compares
    blocks with such a copy."""

    def __init__(self, kv: Sequence[torch.Tensor], seed: int = 0) -> None:
        self.kv = list(kv)
        self._rng = np.random.default_rng(seed)
        self._poison: dict[int, torch.Tensor] = {}  # random values for that many blocks of every layer

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        """The bytes of blocks `ids` of every layer, copied."""
        return torch.stack([layer[:, list(ids)] for layer in self.kv]).view(torch.uint8)

    def poison(self, ids: Sequence[int]) -> None:
        """Fill blocks `ids` with random bytes, and wait for that (on the GPU: so that it is not part of the next
        timed request)."""
        ids = list(ids)
        source = self._poison.get(len(ids))
        if source is None:
            first = self.kv[0]
            shape = (len(self.kv), first.shape[0], len(ids), *first.shape[2:])
            nbytes = int(np.prod(shape)) * first.element_size()
            raw = torch.frombuffer(bytearray(self._rng.bytes(nbytes)), dtype=torch.uint8)
            source = self._poison[len(ids)] = raw.view(first.dtype).view(shape).to(first.device)
        for layer, values in zip(self.kv, source, strict=True):
            layer[:, ids] = values
        if source.is_cuda:
            torch.cuda.synchronize(source.device)

    def check(self, what: str, ids: Sequence[int], expected: torch.Tensor) -> None:
        """BenchError unless blocks `ids` hold `expected` (`read`'s copy of what was stored), byte for byte."""
        got = self.read(ids)
        if not torch.equal(got, expected):
            wrong = int((got != expected).sum())
            raise BenchError(f"{what} left {wrong} of {expected.numel()} bytes of its blocks other than the KV stored")


def check_tokens(what: str, got: int, expected: int) -> None:
    """BenchError unless a transfer returned the tokens it was asked for (a miss or a short copy otherwise)."""
    if got != expected:
        raise BenchError(f"{what} returned {got} tokens, not the {expected} stored: a miss or a short copy was timed")


def transfer_cases(
    store: Mover,
    retrieve: Mover,
    blocks: KVBlocks,
    tokens: Callable[[int], list[int]],
    transfers: int,
    steps: Steps,
    where: str,
    ceiling: Callable[[int, str], CopyCeiling],
    device: str,
    block_count: int,
    per_chunk: int,
) -> dict[str, Any]:
    """Time `store` of new prefixes, then `retrieve` of the last one, for one chunk and for 16, each request
    alternating with a plain copy of its bytes (`ceiling(chunks, direction)`): `ratio` is the copy's median time
    over the request's (client to reply). Every request is checked (see the module): its tokens, and a retrieve's
    bytes (its blocks poisoned before it, compared after it, both outside the timed region).

    A call is timed to its return and no further: both movers return once the bytes have moved (GPU KV: the
    server's done flag seen, or the in-process engine's wait), when the engine may read the KV or reuse its
    blocks. A `torch.cuda.synchronize()` after it would time something an engine does not do: with the server's
    process the last on the GPU, it waits for a switch back to the client's context (47-120 us on the H200 host,
    measured stage by stage). The copy it is compared with synchronizes: that is its end."""
    rng = np.random.default_rng(1)

    def case(
        n: int,
        call: Callable[[int], int],
        copy: CopyCeiling | None,
        before: Callable[[int], None],
        after: Callable[[int, int], None],
    ) -> dict[str, Any]:
        samples = []
        for i in range(n):
            before(i)
            start = time.perf_counter()
            moved = call(i)
            samples.append(time.perf_counter() - start)
            after(i, moved)
            if copy is not None:
                copy.time_once()
        summary = latency_summary(samples)
        if copy is not None:
            summary["ceiling_us"] = copy.best()[1] * 1e6
            summary["ratio"] = summary["ceiling_us"] / summary["p50_us"]
        return summary

    def one_size(chunks: int) -> dict[str, Any]:
        n = transfers if chunks == 1 else max(10, transfers // 10)
        ids = [rng.permutation(block_count)[: chunks * per_chunk].tolist() for _ in range(8)]  # scattered blocks
        prefixes = [tokens(chunks) for _ in range(n)]
        # One chunk's copy on the CPU runs from the caches when repeated (3 MiB): no ceiling for it there.
        copies = chunks > 1 or device == "cuda"
        name = f"{where}: store_{chunks}chunk"

        def stored(i: int, moved: int) -> None:
            check_tokens(f"{name} #{i}", moved, len(prefixes[i]))

        store_case = case(
            n,
            lambda i: store(prefixes[i], ids[i % 8]),
            ceiling(chunks, "d2h") if copies else None,
            lambda i: None,
            stored,
        )
        steps.done(name)
        expected = blocks.read(ids[(n - 1) % 8])  # what the last store read: every retrieve brings it back
        name = f"{where}: retrieve_{chunks}chunk"

        def retrieved(i: int, moved: int) -> None:
            check_tokens(f"{name} #{i}", moved, len(prefixes[-1]))
            blocks.check(f"{name} #{i}", ids[(i + 1) % 8], expected)

        retrieve_case = case(
            n,
            lambda i: retrieve(prefixes[-1], ids[(i + 1) % 8]),
            ceiling(chunks, "h2d") if copies else None,
            lambda i: blocks.poison(ids[(i + 1) % 8]),
            retrieved,
        )
        steps.done(name)
        return {f"store_{chunks}chunk": store_case, f"retrieve_{chunks}chunk": retrieve_case}

    return {**one_size(1), **one_size(16)}
