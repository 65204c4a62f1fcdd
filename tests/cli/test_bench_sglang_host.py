"""`kvferry bench sglang-host`: its whole run at a small shape, in process and through servers (the pool in plain
and in shared memory), through the HiCache backend's real page store; and its checks, fed loads that land in the
wrong pages, write outside them, or find nothing stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.bench import sglang_host_bench
from kvferry.bench.sglang_host_path import HostPath
from kvferry.cli.main import main
from tests.cli.benchkit import run_bench

SMALL = ["--pages", "3", "--page-size", "16", "--layers", "2", "--heads", "2", "--head-dim", "8", "--repeats", "1"]


@pytest.fixture(autouse=True)
def small_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_host_bench, "POOL_GB", 0.02)


def test_sglang_host_runs_every_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    doc, progress = run_bench(monkeypatch, tmp_path, "sglang-host", *SMALL)
    rows = doc["results"]["rows"]
    assert [r["mode"] for r in rows] == sglang_host_bench.MODES == progress.done
    assert all(r["pool"] == "2L-2x8-page16" and r["mib"] == 3 * 16 * 2 * 2 * 2 * 8 * 2 / 2**20 for r in rows)
    assert all(r["checked_rounds"] == 2 and r["store_us"] > 0 and r["load_us"] > 0 and r["memcpy_us"] > 0 for r in rows)
    assert doc["config"]["pages"] == 3


@pytest.mark.parametrize("wrong", ["pages swapped", "a byte beside", "nothing stored"])
def test_sglang_host_fails_on_a_wrong_transfer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], wrong: str
) -> None:
    load, store = HostPath.load, HostPath.store

    def swapped(self: HostPath) -> None:
        self.dst = self.dst.flip(0)
        try:
            load(self)
        finally:
            self.dst = self.dst.flip(0)

    def beside(self: HostPath) -> None:
        load(self)
        self.host.pages.view(torch.uint8)[1, 0, 0, 0, 0, 0] ^= 1  # page 0: never a source or a destination

    def nothing(self: HostPath) -> None:
        self.keys = [k[::-1] for k in self.keys]
        try:
            store(self)
        finally:
            self.keys = [k[::-1] for k in self.keys]

    if wrong == "nothing stored":
        monkeypatch.setattr(HostPath, "store", nothing)
    else:
        monkeypatch.setattr(HostPath, "load", swapped if wrong == "pages swapped" else beside)
    assert main(["bench", "sglang-host", *SMALL, "--no-server"]) == 1
    said = {
        "pages swapped": "a destination page does not hold its source's bytes",
        "a byte beside": "the load wrote outside its destination pages",
        "nothing stored": "pages found after they were stored",
    }
    assert said[wrong] in capsys.readouterr().err
