"""`kvferry bench gpu-transfer`, `cache-gpu`, `codec`, `vllm-gpu` and `sglang-gpu`: a clear refusal without CUDA; on a
GPU, end to end in small configurations, and `vllm-gpu` failing on a transfer made wrong on purpose."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.bench import sglang_gpu_bench, vllm_gpu_bench
from kvferry.bench.gpu_transfer_bench import planned_steps
from kvferry.bench.vllm_connector_path import ConnectorPath
from kvferry.bench.vllm_gpu_steps import STEPS, summary
from kvferry.bench.vllm_page_dma import PageDMA
from kvferry.bench.vllm_views import BENCH_CASES
from kvferry.cli.main import main
from kvferry.connector.plan import LoadSpec, StepPlan
from tests.cli.benchkit import run_bench

SEPARATE_RUNS_SPREAD = 0.1  # of one request's wall time, between medians of separate runs of it
# What a GPU span that took in the sleep queued ahead of its request would add at least: half of SLEEP_CYCLES at the
# highest clock of an H100/H200 (1.98 GHz: 2 ms). A short request's span may read above its wall time by more than
# the spread (the CPU runs it cold after the sleep: a 3 MiB store's 181 us against a 123 us wall, H100).
SLEEP_US_AT_LEAST = 1000.0
# Each bench holds a model-sized KV and its checks' clones (GiBs): they run one after another on one worker, so
# that `.ci/gpu-tests`' workers do not take the GPU's memory all at once (8 GiB short, seen with 14 workers).
pytestmark = pytest.mark.xdist_group("gpu-benches")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
@pytest.mark.parametrize(
    "args", [["gpu-transfer"], ["cache-gpu"], ["codec"], ["server", "--device", "cuda"], ["vllm-gpu"], ["sglang-gpu"]]
)
def test_without_cuda_exit_2_saying_so(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert f"kvferry bench {args[0]}: error:" in err and "needs a CUDA device" in err


def test_vllm_gpu_refuses_no_timed_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vllm-gpu", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_gpu_transfer_refuses_unknown_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gpu-transfer", "--sections", "bulk,warp"]) == 2
    assert "--sections" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_transfer_calls_and_bidir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    doc, progress = run_bench(monkeypatch, tmp_path, "gpu-transfer", "--sections", "calls,bidir", "--reps", "2")
    assert progress.totals == [planned_steps(["calls", "bidir"])]
    rows = doc["results"]["rows"]
    assert {r["section"] for r in rows} == {"calls", "bidir"}
    assert all(r["ratio"] > 0 and r["gbps"] > 0 for r in rows)
    assert doc["results"]["checked_rows"] == 3  # the 16 chunks' two rows and bidir: each one's last transfer
    calls = doc["results"]["calls"]
    assert len(calls) == 16 and doc["machine"]["device"] != "cpu"
    for c in calls:  # each request's GPU time is part of its wall time; the profiler saw its work inside the call
        assert c["enqueue_us"] > 0
        if "one chunk" in c["what"] or c["direction"] == "D2H" or c["what"].endswith("memcpy"):
            # medians of separate runs (gpu_timeline.gpu_wait_us), the GPU's after a cold start: it may read above
            # the wall's, but not by the ~2 ms sleep queued ahead of the request
            assert 0 < c["gpu_us"] < c["wall_us"] * (1 + SEPARATE_RUNS_SPREAD) + SLEEP_US_AT_LEAST
        else:  # a staged retrieve's first DMAs are not ordered after the caller's stream: no GPU time of its own
            assert c["gpu_us"] is None
        assert 0 < c["first_op_us"] < c["gpu_end_us"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cache_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    doc, _ = run_bench(monkeypatch, tmp_path, "cache-gpu")
    rows = doc["results"]["rows"]
    assert [(r["model"], r["op"]) for r in rows] == [
        (m, op) for m in ("llama3-8b", "qwen2.5-0.5b") for op in ("store", "retrieve")
    ]
    assert all(r["ratio"] > 0 for r in rows)
    assert doc["results"]["breakdown"]["alternated_with_memcpy"]["ratio"] > 0


# vLLM's pages of each case's 16-chunk prefix (256 blocks of 16 tokens, or 64 of 64): a (layer, block) page each,
# or a block of every layer where layers interleave (BLHNC): (pages, KiB each)
VLLM_PAGES = {"LBHNC": (256 * 32, 64), "LBNHC": (256 * 32, 64), "BLHNC": (256, 32 * 64), "MLA": (64 * 61, 72)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllm_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every mode (embedded, server over TCP and over its Unix socket), every case; each figure from its own samples,
    every load checked, vLLM's page DMA beside."""
    doc, progress = run_bench(monkeypatch, tmp_path, "vllm-gpu", "--repeats", "2", "--no-gemm")
    rows = doc["results"]["rows"]
    assert [(r["mode"], r["case"]) for r in rows] == [(m, c.name) for m in vllm_gpu_bench.MODES for c in BENCH_CASES]
    assert progress.done == [f"{r['mode']}: {r['case']}" for r in rows]
    for r in rows:
        assert r["checked_rounds"] == 3
        pages, kib = VLLM_PAGES["MLA" if "FLASHMLA" in r["case"] else r["case"].split("-")[1]]
        assert (r["vllm_dma_pages"], r["vllm_dma_page_kib"]) == (pages, kib)
        assert r["mib"] == pytest.approx(pages * kib / 1024)
        # No faster than a plain copy of the same bytes by much: the GPU tests' other workers share the card and the
        # host, so two rounds' medians only catch gross errors here: a call timed before its bytes moved (~0.1 ms
        # against the memcpy's ~10 ms: a ratio near 100). The figures' own checks are the CPU tests' (wrong samples,
        # wrong transfers fed to the bench); a memcpy slowed by another worker gave 1.503 here once.
        for path in ("", "vllm_dma_"):
            for op, memcpy in (("store", "d2h"), ("load", "h2d")):
                assert r[f"{path}{op}_ratio"] == pytest.approx(r[f"{memcpy}_memcpy_us"] / r[f"{path}{op}_us"])
                assert 0 < r[f"{path}{op}_ratio"] < 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sglang_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every mode, both recorded model-sized SGLang pools; each load checked, the ratios from their own samples."""
    doc, progress = run_bench(monkeypatch, tmp_path, "sglang-gpu", "--repeats", "2")
    rows = doc["results"]["rows"]
    assert [r["mode"] for r in rows] == [m for m in sglang_gpu_bench.MODES for _ in range(2)]
    assert progress.done == [f"{r['mode']}: {r['pool']}" for r in rows]
    for r in rows:
        assert r["checked_rounds"] == 3 and r["mib"] == pytest.approx(512 if r["pool"].startswith("mha") else 274.5)
        for op, memcpy in (("store", "d2h"), ("load", "h2d")):
            assert r[f"{op}_ratio"] == pytest.approx(r[f"{memcpy}_memcpy_us"] / r[f"{op}_us"])
            assert 0 < r[f"{op}_ratio"] < 3  # gross errors only: the GPU tests' workers share the card (see above)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllm_gpu_over_driver_mapped_kv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--vmm: the KV as vLLM 0.34's extensible cache allocates it, the server mapping it by file descriptor."""
    doc, _ = run_bench(monkeypatch, tmp_path, "vllm-gpu", "--repeats", "2", "--no-gemm", "--vmm")
    assert doc["config"]["vmm"] is True
    rows = doc["results"]["rows"]
    modes = ("embedded", "server ipc", "server direct")  # descriptors pass over the Unix socket only
    assert [(r["mode"], r["case"]) for r in rows] == [(m, c.name) for m in modes for c in BENCH_CASES]
    for r in rows:
        assert r["checked_rounds"] == 3
        assert 0 < r["store_ratio"] < 3 and 0 < r["load_ratio"] < 3  # as in test_vllm_gpu: gross errors only


def _load_into_rotated_blocks(path: ConnectorPath) -> None:
    path.worker.start_loads(StepPlan(loads=[LoadSpec("l", path.tokens, path.dst[1:] + path.dst[:1], 0)]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("target", "wrong", "error"),
    [
        (ConnectorPath, _load_into_rotated_blocks, "a load through the connector: layer 0: block"),
        (ConnectorPath, lambda path: None, "a load: moved 0 tokens, not the 4096 asked for"),
        (PageDMA, lambda dma: None, "a load by vLLM's page DMA: layer 0: block"),
    ],
)
def test_vllm_gpu_a_wrong_transfer_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], target: type, wrong: Any, error: str
) -> None:
    monkeypatch.setattr(target, "load", wrong)
    assert main(["bench", "vllm-gpu", "--repeats", "1", "--no-server", "--no-gemm"]) == 1
    err = capsys.readouterr().err
    assert "kvferry bench vllm-gpu: " in err and error in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllm_gpu_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = ("--repeats", "1", "--no-server", "--no-gemm", "--steps")
    doc, progress = run_bench(monkeypatch, tmp_path, "vllm-gpu", *args)
    assert "embedded: model steps with and without stores" in progress.done  # after the transfer cases
    stall = doc["results"]["steps"]["embedded"]
    assert stall["steps"] == STEPS and stall["store_mib"] > 0
    assert stall["step_ms"] > 0 and stall["step_with_stores_ms"] > 0 and stall["step_ratio"] > 0
    assert 0 < stall["start_stores_cpu_us"] <= stall["start_stores_cpu_max_us"]


def test_step_summary_medians_and_ratio() -> None:
    s = summary([0.012, 0.011, 0.013], [0.010, 0.009, 0.011], [40e-6, 20e-6, 30e-6], 512 << 20)
    assert s["steps"] == 3 and s["store_mib"] == 512
    assert (s["step_ms"], s["step_with_stores_ms"]) == pytest.approx((10.0, 12.0))
    assert s["step_ratio"] == pytest.approx(1.2)
    assert (s["start_stores_cpu_us"], s["start_stores_cpu_max_us"]) == pytest.approx((30.0, 40.0))


class _FakeSetup:
    """Stands in for a GPU Setup: the same attributes, transfers that do nothing."""

    def __init__(self, model: str, fmt: object, n_chunks: int, **kwargs: object) -> None:
        self.nbytes = n_chunks << 20
        self.paged = self.objects = self.ids = self.fmt = self.geom = None

    def run(self, *args: object) -> None:
        pass

    def start(self, *args: object) -> None:
        pass

    def runner(self, *args: object) -> Callable[[], None]:
        return lambda: None

    def check(self, *args: object) -> _FakeCheck:
        return _FakeCheck()


class _FakeCheck:
    """Stands in for a check of a GPU transfer: counts its calls."""

    setups = lasts = 0

    def setup(self) -> None:
        _FakeCheck.setups += 1

    def last(self) -> None:
        _FakeCheck.lasts += 1


def test_gpu_transfer_control_flow_with_the_gpu_faked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every section's rows, tables and JSON, and a progress bar that ends full, with every GPU operation replaced by
    a no-op (the measurements themselves run only on a GPU: the gpu-marked tests above)."""
    import kvferry
    from kvferry.bench import gpu_gemm, gpu_transfer_bench

    class Handle:
        def wait(self) -> None:
            pass

    monkeypatch.setattr(gpu_transfer_bench, "require_cuda", lambda what: None)
    monkeypatch.setattr(gpu_transfer_bench, "Setup", _FakeSetup)
    monkeypatch.setattr(gpu_transfer_bench, "paired_ms", lambda fn, ceiling, reps, checks: (2.0, 1.0))
    monkeypatch.setattr(gpu_transfer_bench, "memcpy", lambda nbytes, to_host: lambda: None)
    monkeypatch.setattr(gpu_transfer_bench, "memcpy_start", lambda nbytes, to_host: lambda: Handle())
    monkeypatch.setattr(gpu_transfer_bench, "by_hand", lambda s: lambda: None)
    monkeypatch.setattr(kvferry, "transfer_async", lambda *args, **kwargs: Handle())
    times = {"enqueue_us": 30.0, "wall_us": 100.0, "gpu_us": 60.0, "cpu_bound_us": 40.0}
    costs = {**times, "first_op_us": None, "gpu_end_us": None}  # as without CUPTI's records
    monkeypatch.setattr(gpu_transfer_bench, "call_costs", lambda enqueue, ordered=True: costs)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "no GPU (faked)")
    monkeypatch.setattr(gpu_gemm, "gemm_tflops", lambda during=None, seconds=1.0: (100.0, 50.0))
    for module in (gpu_transfer_bench, gpu_gemm):
        monkeypatch.setattr(module, "TransferEngine", lambda *args, **kwargs: None)
        monkeypatch.setattr(module, "PinnedCopy", lambda nbytes: None)
    monkeypatch.setattr(_FakeCheck, "setups", 0)
    monkeypatch.setattr(_FakeCheck, "lasts", 0)
    doc, progress = run_bench(monkeypatch, tmp_path, "gpu-transfer", "--reps", "1")
    sections = gpu_transfer_bench.SECTIONS
    assert progress.totals == [planned_steps(list(sections))]
    rows = doc["results"]["rows"]
    assert {r["section"] for r in rows} == {
        "bulk", "formats", "formats-run", "one-chunk", "calls", "bidir", "gemm", "crossover"
    }  # fmt: skip
    assert all(r["ratio"] == 0.5 for r in rows if r["section"] != "gemm")
    assert sum(r["section"] == "gemm" for r in rows) == gpu_gemm.STEPS - 1
    by_hand = [r for r in rows if r["what"].endswith("torch by hand")]
    assert len(by_hand) == 4  # llama3-8b and qwen2.5-0.5b in bulk and one-chunk
    assert doc["results"]["checked_rows"] == sum(r["section"] != "gemm" for r in rows) - len(by_hand)
    assert _FakeCheck.setups == _FakeCheck.lasts == 2 * len(gpu_gemm.CONFIGS)  # each engine's loop beside the GEMMs
    calls = doc["results"]["calls"]
    assert [(c["what"], c["direction"]) for c in calls] == [
        (f"{what}{ceiling}", d)
        for what in ("llama3-8b one chunk", "qwen2.5-0.5b one chunk", "qwen2.5-0.5b 16 scattered chunks",
                     "qwen2.5-0.5b 32 chunks as one tensor")
        for d in ("D2H", "H2D")
        for ceiling in ("", ": memcpy")
    ]  # fmt: skip
    assert doc["machine"]["device"] == "no GPU (faked)"
    out = capsys.readouterr().out
    assert "serial gather+DMA (1 slot)" in out and "GEMM TFLOP/s" in out and "GPU waited us" in out
    assert f"checked: the last timed transfer of {doc['results']['checked_rows']} of these rows" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_codec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = ("--chunks", "1", "--repeats", "2", "--gemm-seconds", "0.2")
    doc, progress = run_bench(monkeypatch, tmp_path, "codec", *args)
    assert progress.done == ["llama3-8b: 1 chunks", "deepseek-v3-mla: 1 chunks", *(f"GEMM beside {c} transfers"
                             for c in ("fp8", "bf16"))]  # fmt: skip
    rows = doc["results"]["rows"]
    assert [(r["model"], r["codec"], r["direction"]) for r in rows] == [
        (m, c, d) for m in ("llama3-8b", "deepseek-v3-mla") for c in ("bf16", "fp8") for d in ("D2H", "H2D")
    ]
    assert all(r["us"] > 0 and r["link"] > 0 for r in rows)
    assert [r["vs_torch"] for r in rows] == ["equal, 2 calls"] * 8  # every timed call checked
    # The GEMM runs 0.2 s alone and 0.2 s beside, on a GPU the other test workers share: a ratio, not a figure
    # (one such run kept 1.59, the GEMM alone slowed by a neighbour).
    assert all(0 < g["gemm_kept"] < 4 for g in doc["results"]["gemm"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("direction", "op"), [("D2H", "store"), ("H2D", "retrieve")])
def test_codec_fails_a_transfer_that_moves_the_wrong_blocks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], direction: str, op: str
) -> None:
    """The bench's store or retrieve fed the right blocks in the wrong order: its objects (a store) or the KV it
    wrote (a retrieve) differ from the torch backend's, and the run fails (exit 1) naming the call."""
    from kvferry.bench import codec_bench

    real = codec_bench.transfer_async

    def reversed_blocks(paged, objs, ids, d, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real(paged, objs, ids.flip(0) if d.name == direction else ids, d, *args, **kwargs)

    monkeypatch.setattr(codec_bench, "transfer_async", reversed_blocks)
    args = ["bench", "codec", "--models", "llama3-8b", "--chunks", "1", "--repeats", "2", "--no-gemm"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"llama3-8b, 1 chunks, bf16 {op} #1" in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("direction", "error"),
    [
        ("D2H", "crossover qwen 1 chunks D2H staged #1: its objects differ from the torch backend's"),
        ("H2D", "crossover qwen 1 chunks H2D staged #1: "),
    ],
)
def test_gpu_transfer_fails_a_transfer_that_moves_the_wrong_blocks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], direction: str, error: str
) -> None:
    """The bench's transfers in one direction fed the right blocks in the wrong order: the last timed one of the
    first such row differs from the torch backend's, and the run fails (exit 1) naming the row."""
    import kvferry

    real = kvferry.transfer_async

    def reversed_blocks(paged, objects, ids, d, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real(paged, objects, ids.flip(0) if d.name == direction else ids, d, *args, **kwargs)

    monkeypatch.setattr(kvferry, "transfer_async", reversed_blocks)
    assert main(["bench", "gpu-transfer", "--sections", "crossover", "--reps", "1"]) == 1
    err = capsys.readouterr().err
    assert "kvferry bench gpu-transfer: " in err and error in err, err
    if direction == "H2D":
        assert "bytes of the engine's KV differ from the torch backend's" in err, err


def _retrieve_short_by_one(real: Any) -> Any:
    return lambda self, *args, **kwargs: real(self, *args, **kwargs) - 1


def _retrieve_into_the_blocks_reversed(real: Any) -> Any:
    return lambda self, tokens, paged, block_ids, *args, **kwargs: real(
        self, tokens, paged, block_ids[::-1], *args, **kwargs
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("wrong", "error"),
    [
        (_retrieve_short_by_one, "llama3-8b: retrieve #0: moved 255 tokens, not the 256 asked for"),
        (_retrieve_into_the_blocks_reversed, "llama3-8b: retrieve #59 into the blocks it was stored from, reversed: "),
    ],
    ids=["short", "misplaced"],
)
def test_cache_gpu_fails_a_wrong_retrieve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], wrong: Any, error: str
) -> None:
    from kvferry.cache import CacheEngine

    monkeypatch.setattr(CacheEngine, "retrieve", wrong(CacheEngine.retrieve))
    assert main(["bench", "cache-gpu"]) == 1
    err = capsys.readouterr().err
    assert "kvferry bench cache-gpu: " in err and error in err, err
