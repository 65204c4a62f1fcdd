"""The vLLM settings a state-space hybrid's Mamba states depend on (`state_settings`), on vLLM's own CacheConfig:
the scheduler block size vLLM's CPU platform resets in its multiprocess layout is put back (once, with a warning),
and a Mamba group under prefix_cache_retention_interval 0 gets a warning naming the setting."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvferry.connector.kv_groups import KVGroup
from kvferry.integrations.vllm.state_settings import restore_scheduler_block_size, warn_of_sparse_state_retention

pytest.importorskip("vllm")
from vllm.config import CacheConfig

MAMBA_BLOCK = 384
HYBRID = [KVGroup(0, "mamba", MAMBA_BLOCK, ("layers.0.linear_attn",)), KVGroup(1, "full", MAMBA_BLOCK, ("layers.1",))]
ATTENTION_ONLY = [KVGroup(0, "sliding_window", 128, ("layers.0",), 64), KVGroup(1, "full", 128, ("layers.1",))]


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="kvferry.integrations.vllm.state_settings"):
        yield caplog


def cache_config(block_size: int, mode: str = "align", retention: int | None = 0) -> CacheConfig:
    config = CacheConfig(mamba_cache_mode=mode, prefix_cache_retention_interval=retention)
    config.block_size = block_size  # as vLLM's CPU platform leaves it: its default, not the Mamba block size
    return config


def test_the_scheduler_block_size_vllm_reset_is_put_back_once(warnings: pytest.LogCaptureFixture) -> None:
    config = cache_config(128)
    assert restore_scheduler_block_size(config, HYBRID)
    assert config.block_size == MAMBA_BLOCK  # vLLM's scheduler now cuts prefill chunks at Mamba boundaries
    [record] = warnings.records
    assert record.levelno == logging.WARNING and "was 128, not the Mamba block size 384" in record.getMessage()
    assert "--block-size" in record.getMessage()
    assert not restore_scheduler_block_size(config, HYBRID)  # once: nothing left to put back
    assert len(warnings.records) == 1


@pytest.mark.parametrize(
    ("config", "groups"),
    [
        (cache_config(MAMBA_BLOCK), HYBRID),  # what vLLM set stands: nothing to do
        (cache_config(128), ATTENTION_ONLY),  # no state to align to
        (cache_config(128, mode="none"), HYBRID),  # no prefix caching of states: vLLM aligns no chunk
    ],
    ids=["aligned", "no-mamba", "not-align-mode"],
)
def test_a_block_size_is_left_alone_where_no_state_needs_it(
    warnings: pytest.LogCaptureFixture, config: CacheConfig, groups: list[KVGroup]
) -> None:
    found = config.block_size
    assert not restore_scheduler_block_size(config, groups)
    assert config.block_size == found and not warnings.records


def test_a_mamba_group_under_retention_zero_is_warned_of(warnings: pytest.LogCaptureFixture) -> None:
    assert warn_of_sparse_state_retention(cache_config(MAMBA_BLOCK).prefix_cache_retention_interval, HYBRID)
    [record] = warnings.records
    message = record.getMessage()
    assert record.levelno == logging.WARNING and "prefix_cache_retention_interval is 0" in message
    assert "--prefix-cache-retention-interval 384" in message and "chat's next turn" in message


@pytest.mark.parametrize(("retention", "groups"), [(MAMBA_BLOCK, HYBRID), (2 * MAMBA_BLOCK, HYBRID), (None, HYBRID),
                                                   (0, ATTENTION_ONLY)])  # fmt: skip
def test_no_retention_warning_where_states_are_kept_or_there_are_none(
    warnings: pytest.LogCaptureFixture, retention: int | None, groups: list[KVGroup]
) -> None:
    assert not warn_of_sparse_state_retention(retention, groups)
    assert not warnings.records
