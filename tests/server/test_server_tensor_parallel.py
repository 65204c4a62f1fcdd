"""A tensor-parallel engine through `kvferry server`: each rank registers its slice of the KV heads; objects hold
every head, so the ranks' lookups agree and engines of another parallelism reuse what they stored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvferry.client import KvferryClient, ServerError
from tests.server.serverkit import (
    FMT_REAL,
    REAL_BS,
    REAL_CHUNK,
    REAL_HS,
    REAL_NB,
    REAL_NH,
    REAL_NL,
    REAL_NS,
    ServerProcess,
    blocks,
)

TOKENS = list(range(500, 500 + 2 * REAL_CHUNK + 7))  # two full chunks and a tail
IDS = [9, 3, 40, 7, 22, 15, 60, 1, 33]  # the blocks of TOKENS (ceil(len / BS))
OTHER_IDS = [50, 51, 52, 53, 54, 55, 56, 57, 58]
HIT = 2 * REAL_CHUNK
N = HIT // REAL_BS  # blocks holding the hit


def full_kv(seed: int, device: str = "cpu") -> torch.Tensor:
    """[NL, 2, NB, BS, NH, HS]: one engine's whole KV (vLLM's flash-attention layout, layer outermost)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(REAL_NL, 2, REAL_NB, REAL_BS, REAL_NH, REAL_HS, generator=gen).to(torch.bfloat16)
    return kv.to(device)


def layers(buffer: torch.Tensor) -> list[torch.Tensor]:
    return list(buffer.unbind(0))


def rank_slice(buffer: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank` of 2 holds half the heads: its own tensors, not views of the whole."""
    per = REAL_NH // 2
    return buffer[..., rank * per : (rank + 1) * per, :].clone()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.05")
    yield process
    assert process.stop() == 0


def register_ranks(clients: list[KvferryClient], buffers: list[torch.Tensor]) -> list[int]:
    return [
        client.register_kv_cache(
            layers(buffer), FMT_REAL, namespace={**REAL_NS, "world_size": 2, "rank": rank}, heads=(rank, REAL_NH)
        )
        for rank, (client, buffer) in enumerate(zip(clients, buffers, strict=True))
    ]


def ranks_then_whole(server: ServerProcess, device: str, tokens: list[int]) -> None:
    """Rank 0 stores (no hit for anyone yet), rank 1 stores (a hit for both), a TP=1 engine reads it all."""
    whole = full_kv(seed=1, device=device)
    shards = [rank_slice(whole, rank) for rank in range(2)]
    with KvferryClient(server.endpoint) as r0, KvferryClient(server.endpoint) as r1:
        regs = register_ranks([r0, r1], shards)
        assert r0.store(regs[0], tokens, IDS) == HIT
        assert [c.lookup(tokens, registration=g).tokens for c, g in ((r0, regs[0]), (r1, regs[1]))] == [0, 0]
        assert r1.store(regs[1], tokens, IDS) == HIT
        assert [c.lookup(tokens, registration=g).tokens for c, g in ((r0, regs[0]), (r1, regs[1]))] == [HIT, HIT]

        with KvferryClient(server.endpoint) as tp1:
            target = torch.full_like(whole, -3.5)
            reg = tp1.register_kv_cache(layers(target), FMT_REAL, namespace=REAL_NS)
            assert tp1.lookup(tokens, registration=reg).tokens == HIT
            assert tp1.retrieve(reg, tokens, OTHER_IDS) == HIT
    got, want = (blocks(layers(kv.cpu()), ids) for kv, ids in ((target, OTHER_IDS), (whole, IDS)))
    assert torch.equal(got[:, :, :N], want[:, :, :N])
    assert bool((got[:, :, N:] == -3.5).all())  # the tail chunk is not cached


def test_ranks_store_slices_and_a_whole_engine_reads_them(server: ServerProcess) -> None:
    ranks_then_whole(server, "cpu", TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_ranks_store_slices_through_cuda_ipc(server: ServerProcess) -> None:
    ranks_then_whole(server, "cuda", [t + 20_000 for t in TOKENS])


def test_a_whole_engine_stores_and_each_rank_reads_its_heads(server: ServerProcess) -> None:
    whole = full_kv(seed=2)
    tokens = [t + 10_000 for t in TOKENS]
    with KvferryClient(server.endpoint) as tp1:
        reg = tp1.register_kv_cache(layers(whole), FMT_REAL, namespace=REAL_NS)
        assert tp1.store(reg, tokens, IDS) == HIT
    targets = [torch.full_like(rank_slice(whole, rank), -3.5) for rank in range(2)]
    with KvferryClient(server.endpoint) as r0, KvferryClient(server.endpoint) as r1:
        regs = register_ranks([r0, r1], targets)
        for rank, client in enumerate((r0, r1)):
            assert client.lookup(tokens, registration=regs[rank]).tokens == HIT
            assert client.retrieve(regs[rank], tokens, OTHER_IDS) == HIT
    for rank, target in enumerate(targets):
        want = blocks(layers(rank_slice(whole, rank)), IDS[:N])
        assert torch.equal(blocks(layers(target), OTHER_IDS[:N]), want)


def test_a_tail_is_assembled_from_rank_slices_and_hit_in_whole_blocks(server: ServerProcess) -> None:
    """Tails (kvferry.cache.tails) over the wire: each rank stores its heads of the last partial chunk, a lookup
    counts it in whole blocks of the size it names, and an engine of another parallelism loads it."""
    whole = full_kv(seed=4)
    tokens = list(range(30_000, 30_000 + 2 * REAL_CHUNK + 39))  # two chunks and a tail of two whole blocks
    ids, other_ids = [*IDS, 70], [*OTHER_IDS, 59]
    hit = 2 * REAL_CHUNK + 2 * REAL_BS
    longer = tokens + list(range(100))  # the next turn goes on from all of it
    with KvferryClient(server.endpoint) as r0, KvferryClient(server.endpoint) as r1:
        regs = register_ranks([r0, r1], [rank_slice(whole, rank) for rank in range(2)])
        assert r0.store(regs[0], tokens, ids, tail=True) == hit
        assert r1.store(regs[1], tokens, ids, tail=True) == hit
        assert r0.lookup(longer, registration=regs[0], block_size=REAL_BS).tokens == hit
        assert r1.lookup(longer, registration=regs[1], block_size=3 * REAL_BS).tokens == 2 * REAL_CHUNK
    with KvferryClient(server.endpoint) as tp1:
        target = torch.full_like(whole, -3.5)
        reg = tp1.register_kv_cache(layers(target), FMT_REAL, namespace=REAL_NS)
        assert tp1.lookup(longer, registration=reg, block_size=REAL_BS).tokens == hit
        assert tp1.retrieve(reg, tokens[:hit], other_ids) == hit
    got, want = blocks(layers(target), other_ids), blocks(layers(whole), ids)
    assert torch.equal(got, want)


def test_a_slice_that_does_not_fit_is_refused(server: ServerProcess) -> None:
    with KvferryClient(server.endpoint) as client, pytest.raises(ServerError, match=r"BAD_ARGUMENT.*do not fit"):
        client.register_kv_cache(layers(full_kv(seed=3)), FMT_REAL, namespace=REAL_NS, heads=(1, REAL_NH))
