"""KvferryConfig: defaults, YAML, KVFERRY_* environment variables, overrides, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvferry.config import CacheConfig, KvferryConfig, env_overrides


def test_defaults() -> None:
    cfg = KvferryConfig.load(env={})
    assert cfg.cache.chunk_size == 256
    assert cfg.cache.eviction_policy == "lru"
    assert cfg.tiers == []
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 5555
    assert cfg.cache.l1_size_bytes == 4 * 2**30


def test_yaml_then_env_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kvferry.yaml"
    path.write_text(
        "cache:\n  chunk_size: 512\n  eviction_policy: s3fifo\n  l1_size_gb: 1.5\n"
        "tiers: ['disk:/tmp/kv?size=1GB']\nserver:\n  port: 7000\n"
    )
    cfg = KvferryConfig.from_yaml(path)
    assert (cfg.cache.chunk_size, cfg.cache.eviction_policy, cfg.server.port) == (512, "s3fifo", 7000)
    assert cfg.tiers == ["disk:/tmp/kv?size=1GB"]
    assert cfg.cache.l1_size_bytes == int(1.5 * 2**30)
    env = {
        "KVFERRY_CACHE__CHUNK_SIZE": "1024",
        "KVFERRY_TIERS": "redis://127.0.0.1:6379, disk:/x?size=1GB",
        "HOME": "/",
    }
    cfg = KvferryConfig.load(path, env=env, overrides={"server": {"port": 7100}})
    assert cfg.cache.chunk_size == 1024
    assert cfg.cache.eviction_policy == "s3fifo"  # from YAML, untouched by env
    assert cfg.tiers == ["redis://127.0.0.1:6379", "disk:/x?size=1GB"]
    assert cfg.server.port == 7100


def test_env_tier_list_as_json() -> None:
    assert env_overrides({"KVFERRY_TIERS": '["a", "b"]'}) == {"tiers": ["a", "b"]}
    with pytest.raises(ValueError, match="KVFERRY_TIERS"):
        env_overrides({"KVFERRY_TIERS": "[1, 2]"})
    with pytest.raises(ValueError, match="KVFERRY_TIERS"):
        env_overrides({"KVFERRY_TIERS": "[oops"})


def test_unknown_env_variable_is_named() -> None:
    with pytest.raises(ValueError, match=r"KVFERRY_CACHE__CHUNKSIZE.*KVFERRY_CACHE__CHUNK_SIZE"):
        KvferryConfig.load(env={"KVFERRY_CACHE__CHUNKSIZE": "5"})


@pytest.mark.parametrize(
    "cache",
    [{"chunk_size": 0}, {"watermark": 1.5}, {"eviction_policy": "fifo"}, {"hash_algo": "md5"}, {"bogus": 1}],
)
def test_bad_values_are_rejected_naming_the_field(cache: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match=next(iter(cache))):
        KvferryConfig.load(env={}, overrides={"cache": cache})


def test_bad_env_value_is_rejected() -> None:
    with pytest.raises(ValidationError, match="chunk_size"):
        KvferryConfig.load(env={"KVFERRY_CACHE__CHUNK_SIZE": "many"})


def test_bad_yaml_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        KvferryConfig.from_yaml(path)
    with pytest.raises(ValueError, match=r"missing\.yaml"):
        KvferryConfig.from_yaml(tmp_path / "missing.yaml")


def test_sections_are_frozen() -> None:
    cfg = CacheConfig()
    with pytest.raises(ValidationError):
        cfg.chunk_size = 5  # type: ignore[misc]


def test_transfer_section_gives_the_gpu_engine_settings(tmp_path: Path) -> None:
    from kvferry.transfer.engine_config import EngineConfig

    path = tmp_path / "kvferry.yaml"
    path.write_text("transfer:\n  staging_slots: 3\n  slice_mib: 8\n  mode: staged\n")
    env = {
        "KVFERRY_TRANSFER__STAGING_SLOT_MIB": "128",
        "KVFERRY_TRANSFER__KERNEL_PRIORITY": "0",
        "KVFERRY_TRANSFER__GRAPH_MAX_MIB": "0",
    }
    cfg = KvferryConfig.load(path, env=env)
    engine = EngineConfig(**cfg.transfer.engine_settings())
    assert (engine.slots, engine.slot_bytes, engine.slice_bytes) == (3, 128 << 20, 8 << 20)
    assert (engine.mode, engine.kernel_priority, engine.zero_copy_below, engine.batch_dma) == (
        "staged",
        0,
        4 << 20,
        True,
    )
    assert engine.graph_max_bytes == 0  # graphs off
    assert EngineConfig(**KvferryConfig.load(env={}).transfer.engine_settings()) == EngineConfig()  # same defaults
    with pytest.raises(ValidationError, match="staging_slot_mib"):
        KvferryConfig.load(env={"KVFERRY_TRANSFER__STAGING_SLOT_MIB": "0"})
