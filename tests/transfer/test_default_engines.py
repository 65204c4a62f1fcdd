"""The process-wide GPU engines behind `kvferry.transfer`: their settings, a CacheEngine's config applied, and the
event a thread's transfers are ordered after.

No GPU here: the engine class is replaced by a stand-in that records the settings it was made with."""

from __future__ import annotations

import threading

import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats import EngineKVFormat, describe
from kvferry.memory import HostPool
from kvferry.transfer import api, configure_gpu, gpu_engine, ordered_after
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.gpu_engine import default_engine


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


def test_a_cache_engine_leaves_the_process_gpu_settings_alone(engines: dict[torch.device, object]) -> None:
    """The GPU engines are the process's: a `CacheEngine` never changes them (its owner, the server or the
    connector, applies its config's transfer section with `configure_gpu`)."""
    pool = HostPool(1 << 20, pin=False)
    config = KvferryConfig.load(env={}, overrides={"transfer": {"staging_slot_mib": 16, "batch_dma": False}})
    with CacheEngine(config, pool=pool):
        assert api._gpu_config is None
    configure_gpu(**config.transfer.engine_settings())
    assert api._gpu_config == EngineConfig(slot_bytes=16 << 20, batch_dma=False)


def test_transfers_inside_ordered_after_wait_for_its_event() -> None:
    """`ordered_after(event)` hands its event to the engine of every GPU transfer this thread enqueues inside it, and
    to no other: outside it, and on another thread meanwhile, the engine orders after the caller's stream (None)."""
    seen: list[int | None] = []

    class Recorder:
        def submit(self, *args: object) -> None:
            seen.append(args[7])  # type: ignore[arg-type]  # `after`

    paged = torch.zeros(2, 2, 8, 4, 1, 8)  # one layer, vLLM's flash-attention layout
    geom = describe(EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, [paged[0]], block_size=4)

    def submit() -> None:
        api._submit(geom, [], None, True, 8, 0, Recorder(), None)  # type: ignore[arg-type]

    with ordered_after(77):
        submit()
        with ordered_after(78):
            submit()
        submit()
        elsewhere = threading.Thread(target=submit)
        elsewhere.start()
        elsewhere.join()
    submit()
    assert seen == [77, 78, 77, None, None]
