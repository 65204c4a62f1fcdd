"""`kvferry server` flags: defaults, then YAML, then environment, then flags; bad values name the field."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kvferry.server import ServerConfig, add_server_arguments, config_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVFERRY_")]:
        monkeypatch.delenv(name)
    config = config_from_args(parse([]))
    assert config.server == ServerConfig()
    assert config.server.host == "127.0.0.1" and config.server.endpoint == "tcp://127.0.0.1:5555"


def test_flags_override_yaml_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml = tmp_path / "kvferry.yaml"
    yaml.write_text("server:\n  port: 7000\n  heartbeat_timeout_s: 20\ncache:\n  chunk_size: 512\n")
    monkeypatch.setenv("KVFERRY_SERVER__HTTP_PORT", "7001")
    monkeypatch.setenv("KVFERRY_CACHE__CHUNK_SIZE", "128")
    argv = ["--config", str(yaml), "--port", "7100", "--l1-size-gb", "2", "--eviction", "s3fifo"]
    argv += ["--l2", "disk:/tmp/a?size=1GB", "--l2", "redis://127.0.0.1:6379", "--max-message-mb", "2"]
    config = config_from_args(parse(argv))
    assert (config.server.port, config.server.http_port, config.server.heartbeat_timeout_s) == (7100, 7001, 20)
    assert config.server.max_message_bytes == 2 * 2**20
    assert (config.cache.chunk_size, config.cache.l1_size_gb, config.cache.eviction_policy) == (128, 2, "s3fifo")
    assert config.tiers == ["disk:/tmp/a?size=1GB", "redis://127.0.0.1:6379"]
    assert config_from_args(parse(["--no-http"])).server.http_port is None


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"heartbeat_timeout_s=1\.0 must exceed heartbeat_interval_s=2\.0"):
        config_from_args(parse(["--heartbeat-timeout", "1"]))
    with pytest.raises(ValueError, match="port"):
        config_from_args(parse(["--port", "70000"]))
