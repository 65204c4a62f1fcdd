"""GPU transfers through the server answered at enqueue, their end written by the GPU into a done flag.

Llama-3-8B-shaped KV (32 MiB a chunk), so that a 16-chunk copy (~10 ms) outlasts the answer (~1 ms) by far.
Run on a CUDA machine: `PYTHONPATH=src python3 -m pytest -m gpu tests/server/test_server_done_flags_gpu.py`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvferry.client import KvferryClient, ServerUnavailable
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.protocol.messages import Op
from tests.server.serverkit import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
CHUNK, BS, NB = 256, 16, 640
PER_CHUNK = CHUNK // BS
# GPU work queued before a transfer: ~0.5 s on the H200, far longer than an answer but on a host the GPU tests' other
# workers keep busy (at ~0.1 s one answer in six came after its copy there; at 0.5 s, one in six in one run of nine).
SLEEP_CYCLES = 1_000_000_000
NS = {"model": "tests/done-flags"}
CONCLUSIVE, MAX_TRIES = 6, 16  # answers that must come while the work queued before them runs; transfers at most


def gpu_seconds(work: Callable[[], None]) -> float:
    """How long ``work`` runs on the GPU (alone: the stream waits for nothing else first)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--chunk-size", str(CHUNK), "--l1-size-gb", "2", ipc=True)
    yield proc
    assert proc.stop() == 0, "".join(proc.log)


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request: pytest.FixtureRequest, server: ServerProcess) -> str:
    """Over ZMQ (TCP) and over the server's Unix socket (no ZMQ)."""
    return server.endpoint if request.param == "tcp" else str(server.ipc_endpoint)


@pytest.fixture(scope="module")
def kv() -> list[torch.Tensor]:
    return make_paged(FMT, MODELS["llama3-8b"], NB, BS, dtype=torch.bfloat16, device="cuda")


def blocks(kv: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([layer[:, ids] for layer in kv])


def _apart(endpoint: str) -> int:
    """Tokens of each transport's run of a test apart (one server: a prefix stored by the other is no new store)."""
    return 2 * 10**8 if endpoint.startswith("ipc") else 0


def tokens_at(base: int, chunks: int) -> list[int]:
    return list(range(base, base + chunks * CHUNK))


def raw_transfer(client: KvferryClient, op: Op, reg: int, tokens: list[int], ids: list[int]) -> tuple[dict, int, int]:
    """Send a transfer naming a done flag; its answer, slot and number (the caller waits for the flag)."""
    from kvferry.client.done_flags import take_slot
    from kvferry.client.request_args import transfer_args

    args = transfer_args(reg, tokens, ids, 0)
    slot = take_slot(client._gpu[reg].flags, args)
    assert slot is not None
    result = client._call(lambda: client._transfers.submit(op, reg, args))
    return result, slot, args["done_seq"]


def test_a_transfer_is_answered_before_its_copy_ends_and_the_flag_shows_the_end(
    endpoint: str, kv: list[torch.Tensor]
) -> None:
    """Each transfer follows GPU work queued on this process's stream (a sleep, and before a RETRIEVE a write of the
    blocks it loads into), which its copy waits for on the GPU: an answer that came back while that work was still
    running came before the copy (and its flag is not set then: a set one means the copy did not wait), and the flag
    shows the end of a copy that came after that work (the blocks hold the retrieved bytes).

    An answer that took longer than the queued work tells nothing of the order (the GPU tests' other workers can
    starve this host for longer than any sleep): such a try is repeated, and CONCLUSIVE tries must be answered in
    time out of MAX_TRIES."""
    src, dst = list(range(0, 16 * PER_CHUNK)), list(range(16 * PER_CHUNK, 32 * PER_CHUNK))
    for layer in kv:
        layer[:, src] = torch.randn_like(layer[:, src])
    expected = blocks(kv, src)
    sleep_s = gpu_seconds(lambda: torch.cuda._sleep(SLEEP_CYCLES))
    with KvferryClient(endpoint, timeout_s=60) as client:
        reg = client.register_kv_cache(kv, FMT, block_size=BS, namespace=NS)
        flags = client._gpu[reg].flags
        # A first transfer of a registration builds the server's copy plan (and may compile its kernels): untimed
        # here, or it could outlast the GPU work queued before it and leave the test only the copy's ~10 ms.
        warm = tokens_at(9 * 10**6 + _apart(endpoint), 16)
        assert client.store(tokens=warm, registration=reg, block_ids=src) == 16 * CHUNK
        assert client.retrieve(reg, warm, dst) == 16 * CHUNK

        def transfer(op: Op, tokens: list[int], ids: list[int], queued_at: float) -> bool:
            """Send it, check its answer, wait for its flag; whether it was answered while the work before it ran."""
            result, slot, seq = raw_transfer(client, op, reg, tokens, ids)
            in_time = time.monotonic() - queued_at < sleep_s / 2  # half: the GPU's clock may vary between sleeps
            assert result == {"tokens": 16 * CHUNK, "signalled": True}
            assert not (in_time and flags.is_set(slot, seq)), f"{op.value}'s copy did not wait for the work before it"
            flags.wait(slot, seq, time.monotonic() + 30, client._transfers.check_up)
            flags.release(slot)
            return in_time

        in_time = 0
        for attempt in range(MAX_TRIES // 2):
            tokens = tokens_at(10**6 * (attempt + 1) + _apart(endpoint), 16)
            queued_at = time.monotonic()
            torch.cuda._sleep(SLEEP_CYCLES)
            in_time += transfer(Op.STORE, tokens, src, queued_at)
            assert client.lookup(tokens, registration=reg).tokens == 16 * CHUNK  # its chunks are hits at once
            queued_at = time.monotonic()
            torch.cuda._sleep(SLEEP_CYCLES)
            for layer in kv:  # lands after the copy unless the copy waits for it: then these bytes would show
                layer[:, dst] = torch.randn_like(layer[:, dst])
            in_time += transfer(Op.RETRIEVE, tokens, dst, queued_at)
            assert torch.equal(blocks(kv, dst), expected)  # read right after the flag: every byte is there
            if in_time >= CONCLUSIVE:
                break
        assert in_time >= CONCLUSIVE, f"{in_time} of {2 * (attempt + 1)} answers came within {sleep_s / 2:.2f} s"


def test_plain_and_async_calls_through_flags_are_bit_exact(endpoint: str, kv: list[torch.Tensor]) -> None:
    with KvferryClient(endpoint, timeout_s=60) as client:
        reg = client.register_kv_cache(kv, FMT, block_size=BS, namespace=NS)
        written = []
        for i in range(12):
            ids = list(range(i * 2 * PER_CHUNK, (i + 1) * 2 * PER_CHUNK))
            for layer in kv:  # on this stream right before the store: the server's copy waits for it
                layer[:, ids] = torch.randn_like(layer[:, ids])
            tokens = tokens_at(5 * 10**7 + i * 10**4 + _apart(endpoint), 2)
            written.append((tokens, blocks(kv, ids)))
            if i % 2:
                assert client.store(tokens=tokens, registration=reg, block_ids=ids) == 2 * CHUNK
            else:
                assert client.store_async(reg, tokens, ids).result(timeout=60) == 2 * CHUNK
        target = list(range(24 * PER_CHUNK, 26 * PER_CHUNK))
        for i, (tokens, expected) in enumerate(written):
            for layer in kv:  # on this stream right before the retrieve: its copy lands after it
                layer[:, target] = torch.randn_like(layer[:, target])
            if i % 2:
                assert client.retrieve(reg, tokens, target) == 2 * CHUNK
            else:
                assert client.retrieve_async(reg, tokens, target).result(timeout=60) == 2 * CHUNK
            assert torch.equal(blocks(kv, target), expected)
        assert sorted(client._gpu[reg].flags._free) == list(range(64))  # every slot back


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_server_killed_mid_copy_ends_the_wait_with_every_byte_or_none_later(
    transport: str, kv: list[torch.Tensor]
) -> None:
    """Trusting the flag when the server dies with a copy running: the driver may drop the queued work or carry it
    out as the process is torn down (both seen on the H200). The client's wait ends either way: with the flag (the
    copy complete: the write is ordered after it) or with ServerUnavailable once the copy can no longer end (after
    `LOST_DRAIN_S`), after which nothing writes the engine's blocks any more."""
    proc = ServerProcess("--chunk-size", str(CHUNK), "--l1-size-gb", "2", "--heartbeat-timeout", "5",
                         ipc=transport == "ipc")  # fmt: skip
    src, dst = list(range(0, 16 * PER_CHUNK)), list(range(16 * PER_CHUNK, 32 * PER_CHUNK))  # 512 MiB: ~10 ms
    for layer in kv:
        layer[:, src] = torch.randn_like(layer[:, src])
        layer[:, dst] = 0
    expected = blocks(kv, src)
    with KvferryClient(proc.endpoint if transport == "tcp" else str(proc.ipc_endpoint), timeout_s=20) as client:
        reg = client.register_kv_cache(kv, FMT, block_size=BS, namespace=NS)
        tokens = tokens_at(9 * 10**7 + _apart(transport), 16)
        assert client.store(reg, tokens, src) == 16 * CHUNK
        result, slot, seq = raw_transfer(client, Op.RETRIEVE, reg, tokens, dst)
        assert result["signalled"]
        flags = client._gpu[reg].flags
        assert not flags.is_set(slot, seq), "the copy ended before its answer arrived: nothing to kill mid-copy"
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(timeout=30)
        started = time.monotonic()
        try:
            flags.wait(slot, seq, time.monotonic() + 15, client._transfers.check_up)
        except ServerUnavailable:
            assert time.monotonic() - started < 12
            after_failure = blocks(kv, dst)
            time.sleep(0.5)
            assert not flags.is_set(slot, seq)
            assert torch.equal(blocks(kv, dst), after_failure)  # no late write into blocks the engine got back
            print(f"killed mid-copy ({transport}): the copy was dropped")  # for the log (with -s)
        else:
            assert torch.equal(blocks(kv, dst), expected)  # shown: every byte is there
            print(f"killed mid-copy ({transport}): the copy ended")
