"""Benchmarks check what they time: fed a wrong transfer (a retrieve that returns fewer tokens, writes nothing, or
writes its bytes into the wrong blocks), `kvferry bench server` and `server-engines` fail (exit 1, BenchError)."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest
import torch

from kvferry.bench.harness import BenchError
from kvferry.bench.server_transfers import KVBlocks, check_tokens
from kvferry.cache import CacheEngine
from kvferry.cli.main import main
from kvferry.client import KvferryClient

TINY = ("--requests", "5", "--transfers", "1", "--pool-gb", "0.25")


def short_by_one(real: Any) -> Any:
    """A retrieve that moves everything and reports a token fewer."""
    return lambda self, *args, **kwargs: real(self, *args, **kwargs) - 1


def writes_nothing(real: Any) -> Any:
    """A retrieve that claims every token and copies none (what a timed miss looks like if only timed)."""
    return lambda self, registration, tokens, block_ids, **kwargs: len(tokens)


def into_the_wrong_blocks(real: Any) -> Any:
    """A retrieve that copies the right KV, block order reversed: the count is right, the bytes are not."""
    return lambda self, tokens, paged, block_ids, *args, **kwargs: real(
        self, tokens, paged, list(reversed(block_ids)), *args, **kwargs
    )


@pytest.mark.parametrize(
    ("owner", "wrong", "error"),
    [
        (KvferryClient, short_by_one, "server: retrieve_1chunk #0 returned 255 tokens, not the 256 stored"),
        (KvferryClient, writes_nothing, "server: retrieve_1chunk #0 left"),
        (CacheEngine, into_the_wrong_blocks, "embedded engine: retrieve_1chunk #0 left"),
    ],
    ids=["server-short", "server-unwritten", "embedded-misplaced"],
)
def test_bench_server_fails_a_wrong_retrieve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], owner: type, wrong: Any, error: str
) -> None:
    monkeypatch.setattr(owner, "retrieve", wrong(owner.retrieve))
    assert main(["bench", "server", *TINY]) == 1
    err = capsys.readouterr().err
    assert error in err, err


def test_an_engine_of_bench_server_engines_reports_a_retrieve_that_wrote_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One engine's rounds, run here (the bench spawns them) against a real server: the retrieve that copied
    nothing is its error, which the bench raises as a BenchError (`_run_engines`)."""
    from kvferry.bench.server_engines_bench import CHUNK, EngineSpec, engine_main
    from kvferry.bench.server_process import ServerProcess

    monkeypatch.setattr(KvferryClient, "retrieve", writes_nothing(KvferryClient.retrieve))
    server = ServerProcess(pool_gb=0.25, chunk_size=CHUNK)
    try:
        results: queue.Queue[dict[str, Any]] = queue.Queue()
        go = threading.Event()
        go.set()
        spec = EngineSpec(server.endpoint, "qwen2.5-0.5b", "cpu", rounds=2, think_s=0.0)
        engine_main(0, spec, threading.Barrier(1), go, results)
    finally:
        server.stop()
    report = results.get(timeout=1)
    assert "error" in report and "round 0's retrieve left" in report["error"], report


def test_kv_blocks_poison_with_random_bytes_and_check_every_byte() -> None:
    kv = [torch.randn(2, 12, 4, 2, 8).to(torch.bfloat16) for _ in range(3)]
    blocks = KVBlocks(kv, seed=5)
    ids = [7, 2, 9]
    stored = blocks.read(ids)
    untouched = blocks.read([0, 1, 3])
    blocks.poison(ids)
    after = blocks.read(ids)
    assert (after != stored).float().mean() > 0.9  # random bytes: nearly every byte differs, none left as zeros
    assert (after == 0).float().mean() < 0.05
    assert torch.equal(blocks.read([0, 1, 3]), untouched)
    with pytest.raises(BenchError, match=r"retrieve #3 left \d+ of 2304 bytes of its blocks other than the KV"):
        blocks.check("retrieve #3", ids, stored)
    for layer, k in zip(kv, range(3), strict=True):
        layer[:, ids] = stored[k].view(torch.bfloat16)
    blocks.check("retrieve #4", ids, stored)  # the bytes back: passes
    kv[1][0, 9, 3, 1, 7] += 1  # one value off
    with pytest.raises(BenchError, match=r"left [12] of 2304 bytes"):
        blocks.check("retrieve #5", ids, stored)
    check_tokens("a retrieve", 256, 256)
    with pytest.raises(BenchError, match="returned 0 tokens, not the 256 stored"):
        check_tokens("a retrieve", 0, 256)


@pytest.mark.parametrize("codec", ["fp8", "none"])
def test_codec_checks_pass_the_torch_backend_and_fail_a_wrong_store_or_retrieve(codec: str) -> None:
    """`kvferry bench codec`'s checks (GPU only: the bench itself is tested in test_bench_gpu.py) with the torch
    backend standing for the kernel on the CPU: its own calls pass; the right blocks in the wrong order, or a call
    that writes nothing, fail by name."""
    from dataclasses import replace

    from kvferry import Direction
    from kvferry.bench.codec_checks import RetrieveCheck, StoreCheck
    from kvferry.formats import EngineKVFormat, describe, with_codec
    from kvferry.formats.synthetic import MODELS, make_paged
    from kvferry.transfer import transfer

    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, replace(MODELS["llama3-8b"], nl=2), 32, 16, generator=torch.Generator().manual_seed(3))
    plain = describe(fmt, paged)
    geom = with_codec(plain, "fp8") if codec == "fp8" else plain
    ids = torch.randperm(32, generator=torch.Generator().manual_seed(4))[:16]  # one 256-token chunk
    objs = torch.empty((1, *geom.object_shape(256)), dtype=geom.object_dtype)

    def store(block_ids: torch.Tensor) -> None:
        transfer(paged, objs, block_ids, Direction.D2H, fmt, geometry=geom, backend="torch")

    def retrieve(block_ids: torch.Tensor) -> None:
        transfer(paged, objs, block_ids, Direction.H2D, fmt, geometry=geom, backend="torch")

    def run(check: Any, calls: list[Any]) -> None:
        for call in calls:
            check.setup()
            call()
        check.last()

    run(StoreCheck("store", fmt, paged, geom, objs, ids), [lambda: store(ids)] * 2)
    with pytest.raises(BenchError, match="store #2: its objects differ from the torch backend's: "):
        run(StoreCheck("store", fmt, paged, geom, objs, ids), [lambda: store(ids), lambda: store(ids.flip(0))])
    with pytest.raises(BenchError, match="store #1: its objects differ"):
        run(StoreCheck("store", fmt, paged, geom, objs, ids), [lambda: None])

    store(ids)
    run(RetrieveCheck("retrieve", fmt, paged, geom, objs, ids), [lambda: retrieve(ids)] * 2)
    total = sum(t.numel() * t.element_size() for t in paged)
    with pytest.raises(BenchError, match=rf"retrieve #1: \d+ of {total} bytes of the engine's KV differ"):
        run(RetrieveCheck("retrieve", fmt, paged, geom, objs, ids), [lambda: retrieve(ids.flip(0))])
    with pytest.raises(BenchError, match="retrieve #2: "):
        run(RetrieveCheck("retrieve", fmt, paged, geom, objs, ids), [lambda: retrieve(ids), lambda: None])


@pytest.mark.parametrize("as_list", [True, False], ids=["scattered objects", "one tensor"])
def test_gpu_transfer_checks_fail_reversed_or_unwritten_blocks(as_list: bool) -> None:
    """`kvferry bench gpu-transfer`'s checks (`codec_checks` on its objects: a list of them, or one tensor) with the
    torch backend standing for the engine on the CPU: the right transfer passes; the blocks reversed, or the first
    block left unwritten, fail by name."""
    from dataclasses import replace

    from kvferry import Direction
    from kvferry.bench.codec_checks import RetrieveCheck, StoreCheck
    from kvferry.formats import EngineKVFormat, describe
    from kvferry.formats.synthetic import MODELS, make_paged
    from kvferry.transfer import transfer

    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, replace(MODELS["qwen2.5-0.5b"], nl=2), 64, 16, generator=torch.Generator().manual_seed(5))
    geom = describe(fmt, paged)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(6))[:32]  # two 256-token chunks
    block = torch.empty((2, *geom.object_shape(256)), dtype=geom.dtype)
    objs: Any = list(block) if as_list else block

    def move(direction: Direction, block_ids: torch.Tensor, skip: int = 0) -> Any:
        return lambda: transfer(paged, objs, block_ids, direction, fmt, geometry=geom, backend="torch",
                                skip_prefix_blocks=skip)  # fmt: skip

    def run(check: Any, call: Any) -> None:
        check.setup()
        call()
        check.last()

    for d, make, error in (
        (Direction.D2H, StoreCheck, "store #1: its objects differ from the torch backend's: "),
        (Direction.H2D, RetrieveCheck, r"retrieve #1: \d+ of \d+ bytes of the engine's KV differ"),
    ):
        op = error.split(" ")[0]
        run(make(op, fmt, paged, geom, objs, ids), move(d, ids))
        with pytest.raises(BenchError, match=error):
            run(make(op, fmt, paged, geom, objs, ids), move(d, ids.flip(0)))
        with pytest.raises(BenchError, match=error):
            run(make(op, fmt, paged, geom, objs, ids), move(d, ids, skip=1))


def test_chunk_check_fails_a_retrieve_into_the_wrong_or_unwritten_blocks() -> None:
    """`kvferry bench cache-gpu`'s check of its last retrieve, with the torch backend standing for the cache on the
    CPU: the chunk back in the blocks asked for passes; in the wrong order, or its first block unwritten, fails."""
    from dataclasses import replace

    from kvferry import Direction
    from kvferry.bench.block_check import ChunkCheck
    from kvferry.formats import EngineKVFormat, describe
    from kvferry.formats.synthetic import MODELS, make_paged
    from kvferry.transfer import transfer

    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, replace(MODELS["llama3-8b"], nl=2), 32, 16, generator=torch.Generator().manual_seed(7))
    geom = describe(fmt, paged)
    ids = torch.randperm(32, generator=torch.Generator().manual_seed(8))[:16].tolist()
    backwards = ids[::-1]
    chunk = torch.empty((1, *geom.object_shape(256)), dtype=geom.dtype)
    check = ChunkCheck(fmt, paged, geom, seed=9)

    def round_trip(into: list[int], skip: int = 0) -> None:
        check.remember(ids)
        transfer(paged, chunk, ids, Direction.D2H, fmt, geometry=geom, backend="torch")  # the store
        check.poison(backwards)
        transfer(paged, chunk, into, Direction.H2D, fmt, geometry=geom, backend="torch", skip_prefix_blocks=skip)
        check.verify("retrieve #59", backwards)

    round_trip(backwards)
    with pytest.raises(BenchError, match=r"retrieve #59: \d+ of \d+ bytes of its blocks differ from the blocks"):
        round_trip(ids)
    with pytest.raises(BenchError, match="retrieve #59: "):
        round_trip(backwards, skip=1)


def test_gpu_transfer_rows_check_their_last_timed_transfer() -> None:
    """`paired_ms` poisons before the last timed call of the row and checks it after the loop: a wrong last call
    fails, a wrong earlier one is outside the stated sample."""
    from dataclasses import replace

    from kvferry import Direction
    from kvferry.bench.codec_checks import StoreCheck
    from kvferry.bench.gpu_transfer_bench import paired_ms
    from kvferry.formats import EngineKVFormat, describe
    from kvferry.formats.synthetic import MODELS, make_paged
    from kvferry.transfer import transfer

    fmt = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = make_paged(fmt, replace(MODELS["qwen2.5-0.5b"], nl=2), 32, 16, generator=torch.Generator().manual_seed(1))
    geom = describe(fmt, paged)
    ids = torch.randperm(32, generator=torch.Generator().manual_seed(2))[:16]
    objs = [torch.empty(geom.object_shape(256), dtype=geom.dtype)]

    def stores(wrong_call: int) -> Any:
        calls = iter(range(100))
        return lambda: transfer(paged, objs, ids.flip(0) if next(calls) == wrong_call else ids, Direction.D2H, fmt,
                                geometry=geom, backend="torch")  # fmt: skip

    def row(fn: Any) -> None:
        paired_ms(fn, lambda: None, 3, [StoreCheck("a row", fmt, paged, geom, objs, ids)])

    row(stores(wrong_call=2))  # the warm-up call and 3 timed ones: the second timed one is not checked
    with pytest.raises(BenchError, match="a row #1: its objects differ from the torch backend's"):
        row(stores(wrong_call=3))


def test_bench_server_events_fail_a_stream_that_carried_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A subscriber that received no stored chunk (here: one that follows a stream nobody publishes on) fails the
    run: a comparison with events off would measure nothing."""
    from kvferry.bench import event_follower

    class Elsewhere(event_follower.EventFollower):
        def __init__(self, endpoint: str, replay_endpoint: str) -> None:
            super().__init__("tcp://127.0.0.1:9", "tcp://127.0.0.1:9")  # discard port: nothing answers

    monkeypatch.setattr("kvferry.bench.server_bench.EventFollower", Elsewhere)
    assert main(["bench", "server", *TINY, "--events"]) == 1
    assert "the subscriber received no stored chunk" in capsys.readouterr().err
