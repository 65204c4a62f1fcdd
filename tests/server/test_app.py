"""`kvferry server` flags: defaults, then YAML, then environment, then flags; bad values name the field."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from pathlib import Path

import pytest
import zmq

from kvferry.config import ServerConfig
from kvferry.server import add_server_arguments, config_from_args
from kvferry.server.app import run_from_command_line


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
    events = config_from_args(parse(["--events-port", "0", "--events-replay-port", "7200"])).server
    assert (events.events_port, events.events_replay_port) == (0, 7200)
    assert (ServerConfig().events_port, ServerConfig().events_replay_port) == (None, None)  # off unless asked for


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"heartbeat_timeout_s=1\.0 must exceed heartbeat_interval_s=2\.0"):
        config_from_args(parse(["--heartbeat-timeout", "1"]))
    with pytest.raises(ValueError, match="port"):
        config_from_args(parse(["--port", "70000"]))


def _start_failure(argv: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """Run `kvferry server` in this process with flags that must keep it from starting; its one error line."""
    caplog.set_level(logging.INFO, logger="kvferry.server")
    assert run_from_command_line(["--port", "0", "--l1-size-gb", "0.01", *argv]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0]
    return errors[0]


def test_a_busy_http_port_is_reported_as_the_http_port(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        error = _start_failure(["--http-port", str(port)], caplog)
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in error and "tcp://" not in error


def test_a_busy_zmq_port_is_reported_as_the_client_port(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        error = _start_failure(["--no-http", "--port", str(port)], caplog)
    assert f"cannot listen for clients on tcp://127.0.0.1:{port}" in error


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--l2", "disk:/proc/self?size=1GB"], "disk tier directory '/proc/self' is not writable"),
        (["--l1-size-gb", "1000000"], "cache.l1_size_gb=1000000.0 (1000000.0 GiB) exceeds this machine's memory"),
    ],
    ids=["unwritable-tier-directory", "pool-larger-than-memory"],
)
def test_what_keeps_the_server_from_starting_is_one_line(
    flags: list[str], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert says in _start_failure(["--no-http", *flags], caplog)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--l2", "ftp://cache"], "tiers: tier URL 'ftp://cache': unknown scheme 'ftp'"),
        (["--l2", "disk:/tmp/x?size=lots"], "size 'lots' is not a size"),
        (["--heartbeat-timeout", "1"], "server: heartbeat_timeout_s=1.0 must exceed heartbeat_interval_s=2.0"),
    ],
    ids=["unknown-scheme", "bad-size", "bad-heartbeat"],
)
def test_config_errors_are_one_line_and_exit_2(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("KVFERRY_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exited:
        run_from_command_line(flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvferry server: error: ") and says in err


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        (["--host", "0.0.0.0", "--no-http"], {}, "server.host=0.0.0.0 is beyond loopback: the request socket needs "),
        (["--host", "10.1.2.3"], {"curve": True}, "the HTTP port needs security.http_token_file"),
        (["--ipc", "/tmp/kvf-never.sock"], {"curve": True, "tenant": True}, "security.tenants with server.ipc_path"),
        ([], {"clients": True}, "need security.curve_secret_key_file"),
    ],
    ids=["zmq-beyond-loopback", "http-beyond-loopback", "tenants-on-the-unix-socket", "clients-without-server-key"],
)
def test_listeners_beyond_loopback_without_credentials_keep_the_server_from_starting(
    flags: list[str], env: dict[str, bool], says: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("KVFERRY_")]:
        monkeypatch.delenv(name)
    secret = zmq.curve_keypair()[1]
    if env.get("curve"):
        monkeypatch.setenv("KVFERRY_SECURITY__CURVE_SECRET_KEY", secret.decode())
    if env.get("curve") or env.get("clients"):
        grants = [{"model": "m"}]
        tenants = [{"name": "t", "public_key": zmq.curve_keypair()[0].decode(), "namespaces": grants}]
        monkeypatch.setenv("KVFERRY_SECURITY__TENANTS", json.dumps(tenants))
    error = _start_failure(flags, caplog)
    assert says in error and secret.decode() not in caplog.text
    assert error.startswith("kvferry server cannot start: ")


def test_the_config_logged_at_start_shows_no_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = zmq.curve_keypair()[1].decode()
    monkeypatch.setenv("KVFERRY_SECURITY__CURVE_SECRET_KEY", secret)
    monkeypatch.setenv("KVFERRY_SECURITY__HTTP_TOKEN", "token-c0ffee")
    monkeypatch.setenv("KVFERRY_TIERS", "redis://:redis-pw@127.0.0.1:1/0")
    _start_failure(["--host", "0.0.0.0"], caplog)  # no client keys: it stops right after the config's line
    started = [r.getMessage() for r in caplog.records if "starting with config" in r.getMessage()]
    assert len(started) == 1 and '"http_token": "**********"' in started[0]
    assert secret not in caplog.text and "token-c0ffee" not in caplog.text and "redis-pw" not in caplog.text
    assert "127.0.0.1:1/0" in started[0]  # the tier is named, its password not
