"""`kvferry keys`: a key pair a server and its clients read back, never written over."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from kvferry.cli.main import main
from kvferry.security import SecurityConfig


def test_keys_writes_a_pair_the_server_and_a_client_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "server", "--dir", str(tmp_path)]) == 0
    assert main(["keys", "node1", "--dir", str(tmp_path / "clients")]) == 0
    out = capsys.readouterr().out
    secret_file = tmp_path / "server.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    server = SecurityConfig(curve_secret_key_file=str(secret_file), curve_client_keys=str(tmp_path / "clients"))
    secret = server.server_secret_key()
    assert f"public key {zmq.curve_public(secret).decode()}" in out and secret.decode() not in out
    (client_public,) = server.allowed_clients()
    client = SecurityConfig(
        client_secret_key_file=str(tmp_path / "clients" / "node1.key_secret"),
        server_public_key_file=str(tmp_path / "server.key"),
    ).client_curve()
    assert client is not None and client.public == client_public
    assert client.server_public == zmq.curve_public(secret)
    assert main(["keys", "server", "--dir", str(tmp_path)]) == 2
    assert "never overwritten" in capsys.readouterr().out
