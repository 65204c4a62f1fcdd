"""The process-wide GPU engines behind `kvferry.transfer`: their settings, and a CacheEngine's config applied.

No GPU here: the engine class is replaced by a stand-in that records the settings it was made with."""

from __future__ import annotations

import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.memory import HostPool
from kvferry.transfer import api, configure_gpu, gpu_engine
from kvferry.transfer.gpu_engine import EngineConfig, default_engine


class _Engine:
    def __init__(self, device: torch.device, config: EngineConfig) -> None:
        self.device, self.config = device, config


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> dict[torch.device, object]:
    monkeypatch.setattr(gpu_engine, "TransferEngine", _Engine)
    monkeypatch.setattr(gpu_engine, "_engines", {})
    monkeypatch.setattr(api, "_gpu_config", None)
    return gpu_engine._engines


def test_default_engines_follow_the_configured_settings(engines: dict[torch.device, object]) -> None:
    gpu = torch.device("cuda", 0)
    first = default_engine(gpu, api._gpu_config)
    assert first.config == EngineConfig() and default_engine(gpu, api._gpu_config) is first  # made once
    configure_gpu(slots=3, slot_bytes=32 << 20, kernel_priority=0)
    second = default_engine(gpu, api._gpu_config)
    assert second is not first and (second.config.slots, second.config.kernel_priority) == (3, 0)
    assert default_engine(gpu, api._gpu_config) is second


def test_bad_gpu_settings_fail_when_given(engines: dict[torch.device, object]) -> None:
    with pytest.raises(TypeError, match="staging"):
        configure_gpu(staging=2)
    with pytest.raises(ValueError, match="mode='fast'"):
        configure_gpu(mode="fast")
    with pytest.raises(ValueError, match="positive"):
        configure_gpu(slots=0)
    assert api._gpu_config is None  # nothing half-applied


def test_a_cache_engine_applies_its_transfer_section(engines: dict[torch.device, object]) -> None:
    pool = HostPool(1 << 20, pin=False)
    with CacheEngine(KvferryConfig.load(env={}), pool=pool):
        assert api._gpu_config is None  # the defaults: nothing to set, another cache's settings stay
    config = KvferryConfig.load(env={}, overrides={"transfer": {"staging_slot_mib": 16, "batch_dma": False}})
    with CacheEngine(config, pool=pool):
        assert api._gpu_config == EngineConfig(slot_bytes=16 << 20, batch_dma=False)
