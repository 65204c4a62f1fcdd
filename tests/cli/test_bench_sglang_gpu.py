"""`kvferry bench sglang-gpu` without a GPU: its whole run over the small recorded SGLang pools on the CPU, in process
and through servers, through the linker's real store; and its checks, fed loads that land in the wrong pages, write
outside them, or miss."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.bench import sglang_gpu_bench
from kvferry.bench.server_process import ServerProcess
from kvferry.bench.sglang_linker_path import LinkerPath
from kvferry.bench.sglang_pools import load_fixtures
from kvferry.cli.main import main
from kvferry.integrations.sglang.page_store import KEY_TOKENS
from tests.cli.benchkit import run_bench


class NoCopy:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, to_host: bool) -> None:
        pass

    def start(self, to_host: bool) -> None:
        pass


def host_span(call: Callable[[], object]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


@pytest.fixture
def on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_gpu_bench, "require_cuda", lambda what: None)
    monkeypatch.setattr(sglang_gpu_bench, "DEVICE", "cpu")
    monkeypatch.setattr(sglang_gpu_bench, "CASES_TAG", "")  # the small recorded pools the linker takes (pages >= 8)
    small = [f for f in load_fixtures() if f["case"]["page_size"] >= KEY_TOKENS]
    monkeypatch.setattr(sglang_gpu_bench, "load_fixtures", lambda: small)
    monkeypatch.setattr(sglang_gpu_bench, "PAGES", 3)
    monkeypatch.setattr(sglang_gpu_bench, "POOL_GB", 0.02)
    monkeypatch.setattr(sglang_gpu_bench, "PinnedCopy", NoCopy)
    monkeypatch.setattr(sglang_gpu_bench, "gpu_span", host_span)  # the loads' span, by the host's clock
    monkeypatch.setattr(sglang_gpu_bench, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "no GPU (faked)")


@pytest.mark.usefixtures("on_the_cpu")
def test_sglang_gpu_runs_every_pool_and_mode_with_the_gpu_faked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    polls: list[int] = []

    class Server(ServerProcess):  # each server the bench starts, with how long it polls after a request
        def __init__(self, pool_gb: float, busy_poll_us: int = 0, **kwargs: Any) -> None:
            polls.append(busy_poll_us)
            super().__init__(pool_gb, busy_poll_us, **kwargs)

    monkeypatch.setattr(sglang_gpu_bench, "ServerProcess", Server)
    doc, progress = run_bench(monkeypatch, tmp_path, "sglang-gpu", "--repeats", "1", "--busy-poll-us", "500")
    assert doc["config"]["busy_poll_us"] == 500 and polls == [500] * 4  # two server modes, two pools
    rows = doc["results"]["rows"]
    pools = ["mha-3L-2x8-page16-bfloat16", "mla-3L-24+8-page16-bfloat16"]
    assert [(r["mode"], r["pool"]) for r in rows] == [(m, p) for m in sglang_gpu_bench.MODES for p in pools]
    assert progress.done == [f"{m}: {p}" for m in sglang_gpu_bench.MODES for p in pools]
    assert all(r["checked_rounds"] == 2 and r["load_us"] > 0 and r["store_us"] > 0 for r in rows)
    assert "mla-3L-24+8-page16-bfloat16" in capsys.readouterr().out


@pytest.mark.usefixtures("on_the_cpu")
def test_sglang_gpu_in_groups_of_layers_says_when_the_first_layers_landed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc, _ = run_bench(monkeypatch, tmp_path, "sglang-gpu", "--repeats", "2", "--no-server", "--layer-groups", "3")
    assert doc["config"]["layer_groups"] == 3
    rows = doc["results"]["rows"]
    assert len(rows) == 2 and all(0 < r["first_layers_us"] <= r["load_us"] for r in rows)
    assert "first layers us" in capsys.readouterr().out


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("wrong", ["pages swapped", "a byte beside", "nothing stored", "a load that failed"])
def test_sglang_gpu_fails_on_a_wrong_transfer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], wrong: str
) -> None:
    load, store = LinkerPath.load, LinkerPath.store

    def swapped(self: LinkerPath) -> None:
        self.dst = self.dst[::-1]
        try:
            load(self)
        finally:
            self.dst = self.dst[::-1]

    def beside(self: LinkerPath) -> None:
        load(self)
        self.buffers[-1].view(torch.uint8)[0, 0, 0] ^= 1  # slot 0: the padding page, never a destination

    def failed(self: LinkerPath) -> None:
        backend = self.store_.pools["kv"].backends[0]
        gone: Future[int] = Future()
        gone.set_exception(RuntimeError("2 pages were not in kvferry's cache any more"))
        backend.retrieve_pages_async = lambda tokens, blocks: gone  # type: ignore[method-assign]
        try:
            load(self)
        finally:
            del backend.retrieve_pages_async

    def nothing(self: LinkerPath) -> None:
        self.keys = [k[::-1] for k in self.keys]
        try:
            store(self)
        finally:
            self.keys = [k[::-1] for k in self.keys]

    if wrong == "nothing stored":
        monkeypatch.setattr(LinkerPath, "store", nothing)
    else:
        wrong_load = {"pages swapped": swapped, "a byte beside": beside, "a load that failed": failed}[wrong]
        monkeypatch.setattr(LinkerPath, "load", wrong_load)
    assert main(["bench", "sglang-gpu", "--repeats", "1", "--no-server"]) == 1
    said = {
        "pages swapped": "a destination page does not hold its source's bytes",
        "a byte beside": "the load wrote outside its destination pages",
        "nothing stored": "pages found after they were stored",
        "a load that failed": "a load failed (the layer counter's finish)",
    }
    assert said[wrong] in capsys.readouterr().err
