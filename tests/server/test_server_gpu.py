"""GPU KV registered by CUDA IPC: the server copies straight out of and into another process's GPU memory.

Run on a CUDA machine: `PYTHONPATH=src python3 -m pytest -m gpu tests/server`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvferry.client import KvferryClient
from tests.server.serverkit import FMT_REAL, REAL_BS, REAL_CHUNK, REAL_NB, REAL_NS, ServerProcess, blocks, real_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.25", "--heartbeat-timeout", "10")
    yield proc
    assert proc.stop() == 0, "".join(proc.log)


def gpu_kv(seed: int) -> list[torch.Tensor]:
    return [layer.cuda() for layer in real_kv(seed)]


def test_cuda_ipc_store_and_retrieve_bit_exact(server: ServerProcess) -> None:
    kv = gpu_kv(seed=21)
    tokens = list(range(7000, 7000 + 3 * REAL_CHUNK))
    source_ids = [3, 77, 12, 40, 9, 81, 2, 66, 50, 31, 18, 90]
    target_ids = list(range(60, 72))
    with KvferryClient(server.endpoint) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        assert client.stats()["server"]["open_registrations"] == 1
        # Written on this process's stream right before the STORE: the server must wait for it (ready_event).
        for layer in kv:
            layer[:, source_ids] = torch.randn_like(layer[:, source_ids])
        assert client.store(reg, tokens, source_ids) == 3 * REAL_CHUNK
        expected = blocks(kv, source_ids).clone()
        assert client.lookup(tokens, registration=reg).tokens == 3 * REAL_CHUNK
        before = blocks(kv, target_ids[:4]).clone()
        assert client.retrieve(reg, tokens, target_ids, skip_prefix_tokens=REAL_CHUNK) == 2 * REAL_CHUNK
        # The reply means the copy is complete: this process reads the blocks without further sync.
        assert torch.equal(blocks(kv, target_ids[4:]), expected[:, :, 4:])
        assert torch.equal(blocks(kv, target_ids[:4]), before)  # skipped prefix untouched
        client.end_session()
        assert client.stats()["server"]["open_registrations"] == 0  # the IPC mapping is closed


def test_two_gpu_sessions_share_through_the_server(server: ServerProcess) -> None:
    tokens = list(range(9000, 9000 + 2 * REAL_CHUNK))
    ids = list(range(8))
    writer_kv, reader_kv = gpu_kv(seed=22), gpu_kv(seed=23)
    with KvferryClient(server.endpoint) as writer, KvferryClient(server.endpoint) as reader:
        w = writer.register_kv_cache(writer_kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        r = reader.register_kv_cache(reader_kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        assert writer.store(w, tokens, ids) == len(tokens)
        assert reader.retrieve(r, tokens, [i + 20 for i in ids]) == len(tokens)
    assert torch.equal(blocks(reader_kv, [i + 20 for i in ids]), blocks(writer_kv, ids))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kv_moves_between_engines_on_two_gpus_through_one_server(server: ServerProcess) -> None:
    """Engines on two GPUs share one server: KV stored from GPU 0 comes back bit-exact into GPU 1's blocks, and the
    other way round. Each registration's copies run on its own device's engine, ordered after its own client's
    events; the objects in between are host memory."""
    tokens = [list(range(start, start + 2 * REAL_CHUNK)) for start in (11000, 12000)]
    ids, elsewhere = list(range(8)), [i + 30 for i in range(8)]
    kv = [gpu_kv(seed=24), [layer.to("cuda:1") for layer in real_kv(seed=25)]]
    with KvferryClient(server.endpoint) as first, KvferryClient(server.endpoint) as second:
        clients = [first, second]
        regs = [
            c.register_kv_cache(k, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
            for c, k in zip(clients, kv, strict=True)
        ]
        for source, target in ((0, 1), (1, 0)):
            assert clients[source].store(regs[source], tokens[source], ids) == 2 * REAL_CHUNK
            assert clients[target].retrieve(regs[target], tokens[source], elsewhere) == 2 * REAL_CHUNK
            assert torch.equal(blocks(kv[target], elsewhere).cpu(), blocks(kv[source], ids).cpu())


def test_stores_in_flight_beyond_the_ready_event_ring(server: ServerProcess) -> None:
    """More STOREs in flight than the registration has IPC events: the ring's slots are reused only after their
    STORE was answered, and the ones beyond it send an event of their own. Each STORE follows a write of its own
    blocks on this process's stream, which the server's copy must wait for."""
    from kvferry.client.ready_events import SLOTS

    kv = gpu_kv(seed=24)
    per_chunk = REAL_CHUNK // REAL_BS
    n = SLOTS + 4
    assert (n + 1) * per_chunk <= REAL_NB  # every store its own blocks, and room to retrieve into
    with KvferryClient(server.endpoint) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        futures, written = [], []
        for i in range(n):
            tokens = list(range(20_000 + i * REAL_CHUNK, 20_000 + (i + 1) * REAL_CHUNK))
            ids = list(range(i * per_chunk, (i + 1) * per_chunk))
            for layer in kv:
                layer[:, ids] = torch.randn_like(layer[:, ids])
            written.append((tokens, blocks(kv, ids).clone()))
            futures.append(client.store_async(reg, tokens, ids))
        assert [f.result(timeout=60) for f in futures] == [REAL_CHUNK] * n
        target = list(range(n * per_chunk, (n + 1) * per_chunk))
        for tokens, expected in written:
            assert client.retrieve(reg, tokens, target) == REAL_CHUNK
            assert torch.equal(blocks(kv, target), expected)


@pytest.mark.parametrize("ready", ["ring", "own"])
@pytest.mark.parametrize("call", ["retrieve", "retrieve_async"])
def test_a_retrieve_writes_the_blocks_only_after_the_work_queued_on_the_callers_stream(
    server: ServerProcess, call: str, ready: str
) -> None:
    """An engine loads into blocks whose last user's kernels are still queued on its stream (here ~0.1 s of GPU
    sleep, then a write of those blocks): the server's copy waits for them on the GPU, so once the call returns the
    blocks hold the retrieved bytes, never the late write's. `ready`: the RETRIEVE names a slot of the ring, or
    (every slot held) sends an event of its own."""
    kv = gpu_kv(seed=26)
    per_chunk = REAL_CHUNK // REAL_BS
    base = 30_000 + 1_000 * ["retrieve", "retrieve_async"].index(call) + 500 * (ready == "own")  # a new prefix each
    tokens = list(range(base, base + 2 * REAL_CHUNK))
    src, dst = list(range(2 * per_chunk)), list(range(2 * per_chunk, 4 * per_chunk))
    with KvferryClient(server.endpoint) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, block_size=REAL_BS, namespace=REAL_NS)
        assert client.store(reg, tokens, src) == 2 * REAL_CHUNK
        expected = blocks(kv, src).clone()
        ring = client._gpu[reg].ready
        held = [ring.record() for _ in ring.events] if ready == "own" else []
        assert None not in held
        engine_stream = torch.cuda.Stream()
        with torch.cuda.stream(engine_stream):
            torch.cuda._sleep(200_000_000)
            for layer in kv:
                layer[:, dst] = torch.randn_like(layer[:, dst])
            if call == "retrieve":
                got = client.retrieve(reg, tokens, dst)
            else:
                got = client.retrieve_async(reg, tokens, dst).result(timeout=30)
        for slot in held:
            ring.release(slot)
        assert got == 2 * REAL_CHUNK
        torch.cuda.synchronize()  # the write has run by now, whenever it ran
        assert torch.equal(blocks(kv, dst), expected)
