"""The connector's CURVE keys (``curve`` in kv_connector_extra_config, or the KVFERRY_SECURITY__ variables) reach
its server link: a server that asks for CURVE serves it, and a connector without keys stays off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.config import ServerConfig
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.security import SecurityConfig, write_key_pair
from kvferry.server import KvferryServer
from tests.server.serverkit import FakeEngine


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    write_key_pair(tmp_path, "server")
    write_key_pair(tmp_path / "engines", "engine")
    return tmp_path


@pytest.fixture
def url(keys: Path) -> Iterator[str]:
    security = SecurityConfig(
        curve_secret_key_file=str(keys / "server.key_secret"), curve_client_keys=str(keys / "engines")
    )
    server = KvferryServer(ServerConfig(port=0, http_port=None), FakeEngine(), security=security)  # type: ignore[arg-type]
    server.start()
    yield f"tcp://127.0.0.1:{server.port}"
    server.stop()


def _connects(url: str, settings: ConnectorSettings) -> bool:
    link = ServerLink(url, timeout_s=2, curve=settings.client_curve())
    try:
        return link.connect() and link.chunk_size == 4
    finally:
        link.close()


def test_the_connectors_key_files_reach_a_curve_server(url: str, keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_key = str(keys / "engines" / "engine.key_secret")
    files = {"secret_key_file": engine_key, "server_key_file": str(keys / "server.key")}
    assert _connects(url, ConnectorSettings(mode="server", server_url=url, curve=files))  # type: ignore[arg-type]
    monkeypatch.setenv("KVFERRY_SECURITY__CLIENT_SECRET_KEY_FILE", files["secret_key_file"])
    monkeypatch.setenv("KVFERRY_SECURITY__SERVER_PUBLIC_KEY_FILE", files["server_key_file"])
    assert _connects(url, ConnectorSettings(mode="server", server_url=url))


def test_a_connector_without_keys_does_not_reach_a_curve_server(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVFERRY_SECURITY__CLIENT_SECRET_KEY_FILE", "KVFERRY_SECURITY__SERVER_PUBLIC_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    settings = ConnectorSettings(mode="server", server_url=url)
    assert settings.client_curve() is None and not _connects(url, settings)


def test_a_missing_key_file_names_the_setting(keys: Path) -> None:
    files = {"secret_key_file": str(keys / "nope"), "server_key_file": str(keys / "server.key")}
    with pytest.raises(ValueError, match=r"security\.client_secret_key_file: cannot read"):
        ConnectorSettings.model_validate({"mode": "server", "curve": files}).client_curve()
