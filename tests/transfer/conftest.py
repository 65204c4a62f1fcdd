"""Fixtures of the transfer tests."""

from __future__ import annotations

import pytest
import torch

from kvferry.kernels import triton_copy
from kvferry.memory import HostPool
from kvferry.transfer import gpu_engine
from kvferry.transfer.engine_config import EngineConfig
from tests.transfer.cpu_engine import CopyingDriver, World, completion_init, engine_on


@pytest.fixture
def cpu_engine(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """make(pool, slot_bytes, mode) -> (TransferEngine on CPU memory, its world)."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(gpu_engine.Completion, "__init__", completion_init)
    monkeypatch.setattr(gpu_engine.Completion, "__del__", lambda self: None)

    def make(pool: HostPool, slot_bytes: int, mode: str = "staged", batch: bool = True):  # type: ignore[no-untyped-def]
        world = World(pool, slot_bytes)
        monkeypatch.setattr(triton_copy, "launch_raw", world.launch_raw)
        config = EngineConfig(slot_bytes=slot_bytes, mode=mode, batch_dma=batch)
        return engine_on(world, CopyingDriver(), config), world

    return make
