"""The vLLM connector's worker side on a GPU, over KV in the views vLLM 0.32 builds (replayed from the fixtures
that tests/integrations/test_vllm_gpu_layouts.py checks against vLLM), in process and through a server.

Run on a CUDA machine (no vLLM needed): `PYTHONPATH=src python3 -m pytest -m gpu tests/integrations`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from kvferry.bench.vllm_views import BENCH_CASES, case_of, load_fixtures
from kvferry.client import KvferryClient
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.settings import ConnectorSettings
from tests.integrations.page_view_roundtrip import (
    check_roundtrip,
    embedded_settings,
    gathered,
    kernel_index,
    two_workers,
)
from tests.ports import port_for_a_restart
from tests.server.serverkit import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FIXTURES = [f for f in load_fixtures() if case_of(f) not in BENCH_CASES]
SINGLE = [f for f in FIXTURES if case_of(f).tp[1] == 1]
TP = [f for f in FIXTURES if case_of(f).tp[1] == 2]
BASE = next(f for f in SINGLE if case_of(f).layout == "LBHNC" and case_of(f).backend == "FLASH_ATTN")


def ids(fixture: dict) -> str:
    return case_of(fixture).name


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, ServerProcess]]:
    """One server per chunk size the cases use (two scheduler blocks)."""
    chunks = sorted({2 * case_of(f).block_size for f in FIXTURES})
    procs = {c: ServerProcess("--chunk-size", str(c), "--l1-size-gb", "0.25") for c in chunks}
    yield procs
    for proc in procs.values():
        assert proc.stop() == 0, "".join(proc.log)


@pytest.fixture(scope="module")
def shared_servers() -> Iterator[dict[int, ServerProcess]]:
    """The same with their pools shared (``--shared-pool``), on a Unix socket: for direct loads."""
    chunks = sorted({2 * case_of(f).block_size for f in FIXTURES})
    flags = ("--shared-pool", "--l1-size-gb", "0.25")
    procs = {c: ServerProcess(*flags, "--chunk-size", str(c), ipc=True) for c in chunks}
    yield procs
    for proc in procs.values():
        assert proc.stop() == 0, "".join(proc.log)


def server_settings(servers: dict[int, ServerProcess], fixture: dict) -> ConnectorSettings:
    return ConnectorSettings(mode="server", server_url=servers[2 * case_of(fixture).block_size].endpoint)


def direct_settings(shared_servers: dict[int, ServerProcess], fixture: dict, salt: str) -> ConnectorSettings:
    server = shared_servers[2 * case_of(fixture).block_size]
    return ConnectorSettings(mode="server", server_url=server.ipc_endpoint, direct_loads=True, salt=salt)


def located_chunks(server: ServerProcess) -> int:
    with KvferryClient(server.endpoint) as client:
        return int(client.stats()["cache"]["located_chunks"])


@pytest.mark.parametrize("fixture", SINGLE, ids=ids)
def test_embedded_store_then_load_is_bit_exact(fixture: dict) -> None:
    check_roundtrip(fixture, "cuda")


@pytest.mark.parametrize("fixture", SINGLE, ids=ids)
def test_through_the_server_by_cuda_ipc_is_bit_exact(servers: dict[int, ServerProcess], fixture: dict) -> None:
    check_roundtrip(fixture, "cuda", server_settings(servers, fixture))


@pytest.mark.parametrize("fixture", SINGLE, ids=ids)
def test_direct_loads_out_of_the_shared_pool_are_bit_exact(
    shared_servers: dict[int, ServerProcess], fixture: dict
) -> None:
    server = shared_servers[2 * case_of(fixture).block_size]
    before = located_chunks(server)
    check_roundtrip(fixture, "cuda", direct_settings(shared_servers, fixture, salt=case_of(fixture).name))
    assert located_chunks(server) == before + 3  # copied in this process, by DMA from the registered pool


_ENGINE = """
import sys
from kvferry.bench.vllm_views import case_of, load_fixtures
from kvferry.connector.settings import ConnectorSettings
from tests.integrations.test_vllm_gpu_connector import BASE
from tests.integrations.page_view_roundtrip import check_roundtrip
check_roundtrip(BASE, "cuda", ConnectorSettings(mode="server", server_url=sys.argv[1], salt=sys.argv[2]))
"""


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_an_engine_process_moves_kv_through_the_server(servers: dict[int, ServerProcess], alloc_conf: str) -> None:
    """An engine in a process of its own, also with torch's expandable segments (their CUDA IPC works)."""
    url = server_settings(servers, BASE).server_url
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    cmd = [sys.executable, "-c", _ENGINE, url, f"exit-{alloc_conf}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_a_store_reads_the_blocks_only_after_the_forward_pass_on_vllms_stream(
    servers: dict[int, ServerProcess], mode: str
) -> None:
    """vLLM writes the blocks on its stream and asks for the store at once: the copy must wait for that write on the
    GPU (never the CPU), or the object would hold what the blocks held before."""
    case = case_of(BASE)
    settings = embedded_settings(case) if mode == "embedded" else server_settings(servers, BASE)
    (kv_a, worker_a), (kv_b, worker_b), owned = two_workers(case, BASE, "cuda", settings)
    bs, src, dst = case.block_size, [2, 6, 3, 9], [7, 0, 11, 4]
    tokens = [random.Random(mode).randrange(50_000) for _ in range(4 * bs)]
    vllm_stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(vllm_stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the "forward pass" writes
            index = torch.as_tensor(src, device="cuda")
            for layer in kv_a.layers:
                layer.index_copy_(0, index, torch.randn_like(layer[src]) if layer.is_floating_point() else
                                  torch.randint_like(layer[src], 0, 255))  # fmt: skip
            called = time.perf_counter()
            worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, 0)]))
            returned = time.perf_counter() - called
        expected = gathered(kv_a, src)  # read after the write (ordered on this stream)
        worker_a.preempted(["a"])
        assert returned < 0.05, f"the store's call took {returned:.3f} s: it waited for vLLM's stream on the CPU"
        worker_b.start_loads(StepPlan(loads=[LoadSpec("b", tokens, dst, 0)]))
        torch.cuda.synchronize()
        for got, want in zip(gathered(kv_b, dst), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        for thing in owned:
            thing.close()


def test_a_hit_stays_locked_until_loaded_and_an_evicted_one_is_recomputed() -> None:
    case = case_of(BASE)
    (_, worker_a), (_, worker_b), owned = two_workers(case, BASE, "cuda", embedded_settings(case))
    backend = owned[-1]
    bs = case.block_size
    tokens = list(range(900, 900 + 4 * bs))
    try:
        worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, [1, 2, 3, 4], 0)]))
        worker_a.preempted(["a"])
        hit = backend.lookup(tokens)
        assert hit.tokens == 4 * bs and backend.engine.stats()["locks"] == 1
        backend.engine.clear()  # eviction between the lookup and the load: the lock went with the objects
        worker_b.start_loads(StepPlan(loads=[LoadSpec("b", tokens, [5, 6, 7, 8], bs)]))
        assert worker_b.take_load_errors() == {6, 7, 8}  # vLLM recomputes exactly those blocks
        backend.free_lock(hit.lock)
        assert backend.engine.stats()["locks"] == 0
    finally:
        for thing in owned:
            thing.close()


def test_the_worker_registers_again_with_a_restarted_server() -> None:
    case = case_of(BASE)
    port = port_for_a_restart()
    flags = ("--port", str(port), "--chunk-size", str(2 * case.block_size), "--l1-size-gb", "0.1")
    first = ServerProcess(*flags)
    settings = ConnectorSettings(mode="server", server_url=f"tcp://127.0.0.1:{port}", timeout_s=5.0)
    (kv_a, worker_a), (kv_b, worker_b), owned = two_workers(case, BASE, "cuda", settings)
    link = owned[2].link
    bs = case.block_size
    tokens = list(range(500, 500 + 4 * bs))
    try:
        assert first.stop() == 0
        second = ServerProcess(*flags)
        try:
            # The link learns of the restart from its next call (the store is then skipped, a later miss), and
            # registers the KV again in the background.
            deadline = time.monotonic() + 60
            while not worker_a.counters.tokens_stored and time.monotonic() < deadline:
                worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, [1, 2, 3, 4], 0)]))
                worker_a.preempted(["a"])
                time.sleep(0.2)
            assert worker_a.counters.tokens_stored == 4 * bs
            assert link.generation >= 2  # registered again with the new server
            errors = {-1}
            while errors and time.monotonic() < deadline:
                worker_b.start_loads(StepPlan(loads=[LoadSpec("b", tokens, [8, 9, 10, 11], 0)]))
                errors = worker_b.take_load_errors()
                time.sleep(0.2)
            assert errors == set()
            for got, want in zip(gathered(kv_b, [8, 9, 10, 11]), gathered(kv_a, [1, 2, 3, 4]), strict=True):
                assert torch.equal(got, want)
        finally:
            for thing in owned:
                thing.close()
            assert second.stop() == 0
    finally:
        if first.proc.poll() is None:
            first.stop()


def test_a_first_store_in_process_neither_compiles_nor_waits_for_vllms_stream() -> None:
    """In process the worker builds its KV's copy plan and compiles its kernels when it is made, as a server does at
    a registration: the first store after a forward (~1 s of GPU sleep queued on vLLM's stream here) is enqueued at
    once, rather than compiling, or uploading the plan's tables behind the model's step; and it stores that step's
    KV (written after the sleep)."""
    case = case_of(BASE)
    (kv_a, worker_a), (kv_b, worker_b), owned = two_workers(case, BASE, "cuda", embedded_settings(case))
    bs, src, dst = case.block_size, [2, 6, 3, 9], [7, 0, 11, 4]
    tokens = [random.Random("first store").randrange(50_000) for _ in range(4 * bs)]
    try:
        index = kernel_index(kv_a, src)  # made here: a pageable copy on vLLM's stream would wait for the sleep
        step_kv = [
            torch.randint_like(layer[index].view(torch.uint8), 0, 255).view(layer.dtype) for layer in kv_a.layers
        ]
        vllm_stream = torch.cuda.Stream()
        vllm_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(vllm_stream):
            torch.cuda._sleep(2_000_000_000)
            for layer, written in zip(kv_a.layers, step_kv, strict=True):  # the step's KV, written after the sleep
                layer.index_copy_(0, index, written)
            called = time.perf_counter()
            worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, 0)]))
            returned = time.perf_counter() - called
        assert returned < 0.2, f"the first store's call took {returned:.3f} s"
        worker_a.preempted(["a"])
        assert worker_a.counters.tokens_stored == 4 * bs
        worker_b.start_loads(StepPlan(loads=[LoadSpec("b", tokens, dst, 0)]))
        assert worker_b.take_load_errors() == set()
        for got, want in zip(gathered(kv_b, dst), gathered(kv_a, src), strict=True):
            assert torch.equal(got, want)
    finally:
        for thing in owned:
            thing.close()


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("mode", ["embedded", "server", "direct"])
def test_a_load_writes_the_blocks_only_after_what_vllms_stream_queued_before_it(
    servers: dict[int, ServerProcess], shared_servers: dict[int, ServerProcess], mode: str, background: bool
) -> None:
    """vLLM hands a load blocks a finished request just gave back, whose kernels may still be queued on its stream
    (here ~0.1 s of GPU sleep, then a write of those blocks): the load's copy must wait for them on the GPU (never
    the CPU), or they would overwrite the loaded KV. A foreground load runs on vLLM's thread (embedded: the transfer
    records vLLM's stream itself; server: the RETRIEVE carries an event recorded there), a background one through
    the backend's future (embedded: the cache engine's retrieve ordered after an event on vLLM's stream, staged or
    not; server: the same RETRIEVE; direct: the copy out of the server's shared pool, enqueued on vLLM's thread)."""
    case = case_of(BASE)
    settings = {
        "embedded": lambda: embedded_settings(case),
        "server": lambda: server_settings(servers, BASE),
        "direct": lambda: direct_settings(shared_servers, BASE, salt=f"order-{background}"),
    }[mode]()
    (kv_a, worker_a), (kv_b, worker_b), owned = two_workers(case, BASE, "cuda", settings)
    bs, src, dst = case.block_size, [2, 6, 3, 9], [7, 0, 11, 4]
    tokens = [random.Random(f"load-{mode}-{background}").randrange(50_000) for _ in range(4 * bs)]
    try:
        worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, 0)]))
        worker_a.preempted(["a"])
        assert worker_a.counters.tokens_stored == 4 * bs
        expected = gathered(kv_a, src)
        vllm_stream = torch.cuda.Stream()
        with torch.cuda.stream(vllm_stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the freed request's last write
            index = kernel_index(kv_b, dst)
            for layer in kv_b.layers:
                layer.index_copy_(0, index, torch.randn_like(layer[index]) if layer.is_floating_point() else
                                  torch.randint_like(layer[index], 0, 255))  # fmt: skip
            load = LoadSpec("b", tokens, dst, 0, in_background=background)
            worker_b.start_loads(StepPlan(loads=[load]))
        deadline = time.monotonic() + 30
        while background and "b" not in worker_b.finished_loading() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert worker_b.take_load_errors() == set() and worker_b.counters.tokens_loaded == 4 * bs
        torch.cuda.synchronize()  # the write has run by now, whenever it ran
        for got, want in zip(gathered(kv_b, dst), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        for thing in owned:
            thing.close()
