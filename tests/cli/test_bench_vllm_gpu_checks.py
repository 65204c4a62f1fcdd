"""`kvferry bench vllm-gpu` without a GPU: its figures from fake timings (each sample under the name it was timed
as), and its checks of the bytes and tokens each load moved, on the CPU through the connector's real worker side and
with transfers made wrong on purpose; vLLM's page DMA's descriptors, simulated on the CPU."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.bench.block_check import BlockCheck
from kvferry.bench.harness import BenchError
from kvferry.bench.rounds import stray_ceilings
from kvferry.bench.samples import Samples
from kvferry.bench.vllm_connector_path import ConnectorPath, scattered_blocks
from kvferry.bench.vllm_gpu_bench import check_direct, measure
from kvferry.bench.vllm_page_dma import pages
from kvferry.bench.vllm_views import BENCH_CASES, case_of, load_fixtures, replay
from kvferry.connector.worker_side import WorkerSide
from tests.cli.benchkit import run_bench
from tests.integrations.page_view_roundtrip import embedded_settings, recognised

MS = 1e-3
SMALL = {
    case_of(f).name: f
    for f in load_fixtures()
    if case_of(f) not in BENCH_CASES and case_of(f).tp == (0, 1) and case_of(f).dtype == "bfloat16"
}
# vLLM's layouts the benchmark runs (and a kernel block smaller than the scheduler's), and MLA's latent
BENCH_LAYOUTS = [
    "FLASH_ATTN-LBHNC-bfloat16-L4H2D64-bs16",
    "FLASH_ATTN-LBNHC-bfloat16-L4H2D64-bs16",
    "FLASH_ATTN-BLHNC-bfloat16-L4H2D64-bs16",
    "FLASH_ATTN-LBHNC-bfloat16-L4H2D64-bs64k16",
    "FLASHMLA-LBHNC-bfloat16-L3H1D576-bs128",
]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakePath:
    """Stores and loads that take the given seconds of `clock` (the first round's store ``first_store_s``), counting
    the calls `measure` makes around them."""

    nbytes = 64 << 20

    def __init__(self, clock: Clock, store_s: float, load_s: float, first_store_s: float | None = None) -> None:
        self.clock, self.store_s, self.load_s = clock, store_s, load_s
        self.first_store_s = first_store_s
        self.calls: list[str] = []

    def next_round(self) -> None:
        self.calls.append("round")

    def store(self) -> None:
        first = self.first_store_s is not None and "store" not in self.calls
        self.clock.now += self.first_store_s if first and self.first_store_s else self.store_s
        self.calls.append("store")

    def before_load(self) -> None:
        self.calls.append("poison")

    def load(self) -> None:
        self.clock.now += self.load_s
        self.calls.append("load")

    def check_load(self) -> None:
        self.calls.append("check")


def fake_memcpy(clock: Clock, d2h_s: float, h2d_s: float) -> Callable[[bool], None]:
    def memcpy(to_host: bool) -> None:
        clock.now += d2h_s if to_host else h2d_s

    return memcpy


def test_each_ratio_is_its_own_memcpy_over_its_own_transfer() -> None:
    """Store 2x the D2H memcpy, load 4x the H2D one, vLLM's DMA 1.25x and 2x: exactly those ratios, the warm-up
    round's slow store left out of the medians (with it, the store's median would be of 2 and 100 ms)."""
    clock = Clock()
    connector = FakePath(clock, store_s=2 * MS, load_s=6 * MS, first_store_s=100 * MS)
    dma = FakePath(clock, store_s=1.25 * MS, load_s=3 * MS)
    r = measure(connector, fake_memcpy(clock, 1 * MS, 1.5 * MS), dma, repeats=1, clock=clock)
    assert (r["store_us"], r["load_us"]) == pytest.approx((2000, 6000))
    assert (r["d2h_memcpy_us"], r["h2d_memcpy_us"]) == pytest.approx((1000, 1500))
    assert (r["store_ratio"], r["load_ratio"]) == pytest.approx((0.5, 0.25))
    assert (r["vllm_dma_store_us"], r["vllm_dma_load_us"]) == pytest.approx((1250, 3000))
    assert (r["vllm_dma_store_ratio"], r["vllm_dma_load_ratio"]) == pytest.approx((0.8, 0.5))
    assert (r["store_gbps"], r["load_gbps"]) == pytest.approx(
        (FakePath.nbytes / 2e-3 / 1e9, FakePath.nbytes / 6e-3 / 1e9)
    )
    assert r["checked_rounds"] == 2 and r["mib"] == 64
    # every round, the warm-up too: a fresh prefix, then each load poisoned before and checked after
    assert connector.calls == ["round", "store", "poison", "load", "check"] * 2
    assert dma.calls == ["store", "poison", "load", "check"] * 2


def test_every_timed_call_starts_after_the_work_queued_before_it_settled() -> None:
    """A GPU bench's new source bytes and its poison and snapshot of the KV are queued work the timed store and load
    are ordered after: ``settle`` (a synchronize there) runs before each timed call, so none counts them as its own
    (a load that waited for the snapshot read 0.81 of the link where it ran at 0.89)."""
    clock = Clock()
    connector, dma = FakePath(clock, store_s=2 * MS, load_s=3 * MS), FakePath(clock, store_s=2 * MS, load_s=3 * MS)
    dma.calls = connector.calls
    memcpy = fake_memcpy(clock, 1 * MS, 1 * MS)
    measure(connector, lambda to_host: connector.calls.append("memcpy") or memcpy(to_host), dma, repeats=1,
            clock=clock, settle=lambda: connector.calls.append("settle"))  # fmt: skip
    connector_part = ["round", "settle", "store", "settle", "memcpy", "poison", "settle", "load", "check"]
    one_round = [*connector_part, "settle", "memcpy", "settle", "store", "poison", "settle", "load", "check"]
    assert connector.calls == one_round * 2


def test_a_load_timed_by_a_span_and_its_memcpy_too_and_nothing_else() -> None:
    """A load that ends on the caller's stream (SGLang's forward waits there) and the H2D memcpy are timed by the
    span (the GPU's clock: here a fake one that runs 0.5 ms behind the host's for the load), the store and the D2H
    memcpy by the host's clock as before; a span given without the memcpy it must time too is refused."""
    clock = Clock()
    connector = FakePath(clock, store_s=2 * MS, load_s=6 * MS)
    spanned: list[str] = []

    def span(call: Callable[[], None]) -> float:
        began = clock.now
        call()
        spanned.append("load" if call == connector.load else "memcpy")
        return clock.now - began - (0.5 * MS if spanned[-1] == "load" else 0)

    r = measure(connector, fake_memcpy(clock, 1 * MS, 9 * MS), None, repeats=1, clock=clock, span=span,
                h2d_enqueue=lambda: setattr(clock, "now", clock.now + 1.5 * MS))  # fmt: skip
    assert spanned == ["load", "memcpy"] * 2
    assert (r["store_us"], r["load_us"], r["d2h_memcpy_us"], r["h2d_memcpy_us"]) == pytest.approx(
        (2000, 5500, 1000, 1500)
    )
    with pytest.raises(ValueError, match="come together"):
        measure(connector, fake_memcpy(clock, 1 * MS, 1 * MS), None, repeats=1, clock=clock, span=span)


def test_a_bench_with_store_and_load_swapped_shows_as_swapped() -> None:
    """The figures follow the calls, not the order of the samples: a store that does a load's work shows the load's
    time under "store" and against the D2H memcpy (1/6, not 0.5), and the other way round (0.75, not 0.25)."""
    clock = Clock()
    swapped = FakePath(clock, store_s=6 * MS, load_s=2 * MS)
    r = measure(swapped, fake_memcpy(clock, 1 * MS, 1.5 * MS), None, repeats=3, clock=clock)
    assert (r["store_ratio"], r["load_ratio"]) == pytest.approx((1 / 6, 0.75))
    assert r["vllm_dma_store_ratio"] is None and r["vllm_dma_load_us"] is None


def test_a_row_whose_ceiling_strayed_from_the_runs_is_flagged() -> None:
    """A D2H memcpy 8% slow in one row (a server's copies beside it) makes that row's store ratio 1.08: flagged, the
    other rows and that row's load left alone; a row of half the bytes compared by rate, not by time."""
    clock = Clock()
    rows = []
    for case, (mib, d2h_ms) in enumerate([(64, 1.0), (64, 1.0), (64, 1.08), (32, 0.5)]):
        connector = FakePath(clock, store_s=MS * mib / 64, load_s=1.1 * MS * mib / 64)
        connector.nbytes = mib << 20
        r = measure(connector, fake_memcpy(clock, d2h_ms * MS, MS * mib / 64), None, repeats=1, clock=clock)
        rows.append({"mode": "m", "case": f"c{case}", **r})
    assert rows[2]["store_ratio"] == pytest.approx(1.08)
    lines = stray_ceilings(rows, lambda row: f"{row['mode']} {row['case']}")
    assert [row["strayed"] for row in rows] == [[], [], ["d2h"], []]
    assert len(lines) == 1 and lines[0].startswith("m c2: its D2H memcpy ran at") and "store ratio" in lines[0]


def test_samples_by_name() -> None:
    clock = Clock()
    samples = Samples(clock)

    def spend(seconds: float) -> Callable[[], str]:
        def fn() -> str:
            clock.now += seconds
            return f"spent {seconds}"

        return fn

    assert samples.timed("copy", spend(1.0)) == "spent 1.0"  # what the timed call returned
    samples.timed("transfer", spend(4.0))
    samples.timed("copy", spend(3.0))
    samples.timed("transfer", spend(2.0))
    assert samples.names == ["copy", "transfer"] and samples.count("copy") == 2
    assert samples.median("copy") == 2.0 and samples.ratio("copy", "transfer") == pytest.approx(2 / 3)
    samples.timed("copy", spend(1.0))
    with pytest.raises(BenchError, match="3 samples of 'copy' but 2 of 'transfer'"):
        samples.ratio("copy", "transfer")
    with pytest.raises(BenchError, match="no timing samples of 'load'"):
        samples.median("load")
    samples.clear()
    assert samples.names == []


# -- the checks, on the CPU ------------------------------------------------------------------------------------


class Faulty:
    """The worker's backend with one fault: ``fault(tokens, block_ids)`` runs around each store or load."""

    def __init__(self, real: Any, path: ConnectorPath, fault: str) -> None:
        self.real, self.path, self.fault = real, path, fault

    def store_async(self, tokens: list[int], block_ids: list[int], skip: int) -> Future[int]:
        if self.fault == "store skipped":
            return _done(len(tokens))  # says it stored them all
        if self.fault == "store from the wrong blocks":
            block_ids = block_ids[1:] + block_ids[:1]
        return self.real.store_async(tokens, block_ids, skip)

    def retrieve_async(self, tokens: list[int], block_ids: list[int], skip: int) -> Future[int]:
        layers = [layer.view(torch.uint8) for layer in self.path.kv.layers]
        last = int(list(self.path.kv.kernel_block_ids(block_ids))[-1])
        poisoned = layers[-1][last].clone()
        got = self.real.retrieve_async(tokens, block_ids, skip).result()
        if self.fault == "one block unwritten in the last layer":
            layers[-1][last].copy_(poisoned)
        elif self.fault == "a neighbour block written":
            spare = next(b for b in range(1, self.path.case.num_blocks) if b not in (*self.path.src, *block_ids))
            for kernel in self.path.kv.kernel_block_ids([spare]):
                layers[0][int(kernel)].copy_(layers[0][last])
        elif self.fault == "a short load":
            got -= self.path.case.block_size  # the bytes all there, the count one block short
        return _done(got)

    def retrieve(self, tokens: list[int], block_ids: list[int], skip: int) -> int:
        return self.retrieve_async(tokens, block_ids, skip).result()

    def close(self) -> None:
        self.real.close()


def _done(value: int) -> Future[int]:
    future: Future[int] = Future()
    future.set_result(value)
    return future


@pytest.fixture
def small_path(request: pytest.FixtureRequest) -> Iterator[ConnectorPath]:
    fixture = SMALL[request.param]
    case = case_of(fixture)
    chunks = 2 if case.num_blocks > 8 else 1  # two sets of 2 x chunks blocks, block 0 aside
    path = ConnectorPath(case, fixture, embedded_settings(case), device="cpu", chunk=2 * case.block_size, chunks=chunks)
    yield path
    path.close()


def no_memcpy(to_host: bool) -> None:
    pass


@pytest.mark.parametrize("small_path", BENCH_LAYOUTS, indirect=True)
def test_the_connector_path_passes_its_checks_on_the_cpu(small_path: ConnectorPath) -> None:
    r = measure(small_path, no_memcpy, None, repeats=2)
    assert r["checked_rounds"] == 3 and r["store_us"] > 0 and r["load_us"] > 0
    assert small_path.worker.counters.tokens_loaded == 3 * small_path.prefix_tokens


def test_the_benchmarks_blocks_are_scattered() -> None:
    """A model-sized case's 256-block sets: block ids out of order over the whole cache, never vLLM's block 0."""
    src, dst = scattered_blocks(560, 256, seed=0)
    assert len(src) == len(dst) == 256 and not set(src) & set(dst) and 0 not in {*src, *dst}
    assert max(src) - min(src) > 400 and sum(b == a + 1 for a, b in itertools.pairwise(src)) < 10
    with pytest.raises(BenchError, match="12 blocks cannot hold two sets of 6"):
        scattered_blocks(12, 6, seed=0)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("one block unwritten in the last layer", r"layer 3: block \d+ does not hold the bytes of block"),
        ("a neighbour block written", "bytes outside the destination blocks changed"),
        ("a short load", "a load: moved 48 tokens, not the 64 asked for"),
        ("store skipped", "a load: moved 0 tokens, not the 64"),
        ("store from the wrong blocks", r"layer 0: block \d+ does not hold the bytes of block \d+ it was stored from"),
    ],
)
@pytest.mark.parametrize("small_path", [BENCH_LAYOUTS[0]], indirect=True)
def test_a_wrong_transfer_fails_the_run(small_path: ConnectorPath, fault: str, error: str) -> None:
    small_path.worker = WorkerSide(Faulty(small_path.backend, small_path, fault), block_size=small_path.case.block_size)
    with pytest.raises(BenchError, match=error):
        measure(small_path, no_memcpy, None, repeats=2)


def test_a_load_of_an_earlier_rounds_bytes_fails() -> None:
    """Each round gives the source blocks new bytes: a load that hands back the last round's shows."""
    fixture = SMALL[BENCH_LAYOUTS[0]]
    raw, views = replay(fixture, "cpu")
    layers = [v.view(torch.uint8) for v in views.values()]
    check = BlockCheck(raw, list(views.values()), [1, 2], [3, 4])
    check.refresh_source()
    earlier = [layer[[1, 2]].clone() for layer in layers]
    check.refresh_source()
    check.poison()
    for layer, old in zip(layers, earlier, strict=True):
        layer[[3, 4]] = old
    with pytest.raises(BenchError, match="layer 0: block 3 does not hold the bytes of block 1"):
        check.verify("a stale load")


@pytest.mark.parametrize(
    "name", [*BENCH_LAYOUTS, "FLASH_ATTN-BHLNC-bfloat16-L4H2D64-bs16", "FLASHMLA-BLNHC-bfloat16-L3H1D576-bs64"]
)
def test_vllm_page_dma_descriptors_move_the_blocks(name: str) -> None:
    """vLLM's pages of the source blocks, copied one descriptor at a time to a host buffer and from it to the
    destination blocks' pages (the batched DMA, simulated): the destination blocks then hold the source's bytes and
    nothing else changed; without the last descriptor they do not."""
    fixture = SMALL[name]
    case = case_of(fixture)
    raw, views = replay(fixture, "cpu")
    kv = recognised(case, views)
    per = (case.num_blocks - 1) // 2
    src, dst = scattered_blocks(case.num_blocks, per, seed=1)
    check = BlockCheck(raw, kv.layers, *(list(kv.kernel_block_ids(ids)) for ids in (src, dst)))
    src_pages, sizes = pages(kv, src)
    dst_pages, _ = pages(kv, dst)
    block_bytes = sum(layer[0].numel() * layer.element_size() for layer in kv.layers) * kv.split
    assert int(sizes.sum()) == per * block_bytes
    memory = raw.view(torch.uint8).numpy()
    base = np.uint64(raw.data_ptr())

    def dma(descriptors: int) -> None:
        check.refresh_source()
        check.poison()
        host = [memory[int(a - base) : int(a - base + n)].copy() for a, n in zip(src_pages, sizes, strict=True)]
        for a, n, page in list(zip(dst_pages, sizes, host, strict=True))[:descriptors]:
            memory[int(a - base) : int(a - base + n)] = page

    dma(len(sizes))
    check.verify("the simulated page DMA")
    dma(len(sizes) - 1)
    with pytest.raises(BenchError, match="does not hold the bytes"):
        check.verify("the simulated page DMA, one page short")


def test_replay_lays_the_views_over_the_memory_it_is_given() -> None:
    """--vmm's way in: vLLM's buffer is the given (driver-mapped) memory, the recorded views over it."""
    fixture = load_fixtures()[0]
    given = torch.zeros(fixture["raw_bytes"] + 4096, dtype=torch.uint8)
    raw, views = replay(fixture, "cpu", allocate=lambda nbytes: given)
    assert raw.data_ptr() == given.data_ptr() and raw.numel() == fixture["raw_bytes"]
    assert all(view.untyped_storage().data_ptr() == given.data_ptr() for view in views.values())
    assert bool(given[: fixture["raw_bytes"]].any()) and not bool(given[fixture["raw_bytes"] :].any())


def test_vllm_page_dma_refuses_blocks_that_are_not_pages() -> None:
    """Heads outside blocks (LHBNC): a block is neither one run per layer nor every layer's together."""
    fixture = SMALL["FLASH_ATTN-LHBNC-bfloat16-L4H2D64-bs16"]
    kv = recognised(case_of(fixture), replay(fixture, "cpu")[1])
    with pytest.raises(BenchError, match="neither a dense page per layer nor every layer's together"):
        pages(kv, [1, 2])


def test_vllm_gpu_control_flow_with_the_gpu_faked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole run on small cases on the CPU (no memcpy, a driver without batched copies): its rows, JSON and
    table; the measurements themselves run only on a GPU (tests/cli/test_bench_gpu.py)."""
    from kvferry.bench import vllm_gpu_bench

    small = [case_of(SMALL[name]) for name in BENCH_LAYOUTS[:3]]
    monkeypatch.setattr(vllm_gpu_bench, "require_cuda", lambda what: None)
    monkeypatch.setattr(vllm_gpu_bench, "BENCH_CASES", small)
    monkeypatch.setattr(vllm_gpu_bench, "CHUNK", 32)
    monkeypatch.setattr(vllm_gpu_bench, "POOL_GB", 0.02)
    monkeypatch.setattr(vllm_gpu_bench, "ConnectorPath", partial(ConnectorPath, device="cpu", chunk=32, chunks=2))
    monkeypatch.setattr(vllm_gpu_bench, "PinnedCopy", lambda nbytes: no_memcpy)
    monkeypatch.setattr(vllm_gpu_bench, "synchronize", lambda: None)
    monkeypatch.setattr(vllm_gpu_bench, "driver", lambda: SimpleNamespace(has_batch=False))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "no GPU (faked)")
    doc, progress = run_bench(monkeypatch, tmp_path, "vllm-gpu", "--repeats", "1", "--no-server", "--no-gemm")
    rows = doc["results"]["rows"]
    assert [(r["mode"], r["case"]) for r in rows] == [("embedded", c.name) for c in small]
    assert progress.done == [f"embedded: {c.name}" for c in small]
    assert all(r["checked_rounds"] == 2 and r["vllm_dma_pages"] is None and r["load_us"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "vLLM page DMA: not run" in out and "FLASH_ATTN-BLHNC" in out


@pytest.mark.parametrize(
    ("cache", "fails"),
    [
        ({"located_chunks": 64, "retrieves": 0, "stores": 12, "adopted_stores": 8}, None),
        ({"located_chunks": 64, "retrieves": 1, "stores": 12, "adopted_stores": 8}, "loads"),  # a RETRIEVE
        ({"located_chunks": 0, "retrieves": 0, "stores": 12, "adopted_stores": 8}, "loads"),  # nothing located
        ({"located_chunks": 64, "retrieves": 0, "stores": 12, "adopted_stores": 7}, "stores"),  # one STORE more
        ({"located_chunks": 64, "retrieves": 0, "stores": 4, "adopted_stores": 0}, "stores"),  # none adopted
    ],
)
def test_the_direct_mode_fails_where_a_transfer_was_not_copied_here(cache: dict[str, int], fails: str | None) -> None:
    if fails:
        with pytest.raises(BenchError, match=f"the {fails} did not"):
            check_direct(cache, cases=4)
    else:
        check_direct(cache, cases=4)
