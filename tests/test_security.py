"""The security section: secrets that never show in a dump, key files in both formats, tenants' grants."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest
import zmq

from kvferry.config import KvferryConfig
from kvferry.security import SecurityConfig, TenantGrants, read_key, write_key_pair


def test_secrets_from_the_environment_never_show_in_a_dump(tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    env = {
        "KVFERRY_SECURITY__CURVE_SECRET_KEY": secret.decode(),
        "KVFERRY_SECURITY__HTTP_TOKEN": "token-f00d",
        "KVFERRY_SECURITY__CLIENT_SECRET_KEY": secret.decode(),
        "KVFERRY_SECURITY__SERVER_PUBLIC_KEY": public.decode(),
    }
    config = KvferryConfig.load(env=env)
    dumped = json.dumps(config.model_dump(mode="json"))
    assert secret.decode() not in dumped and "token-f00d" not in dumped
    assert config.security.server_secret_key() == secret and config.security.http_token_value() == "token-f00d"
    keys = config.security.client_curve()
    assert keys is not None and (keys.public, keys.secret, keys.server_public) == (public, secret, public)
    assert secret.decode() not in repr(keys)


def test_a_key_pair_written_is_read_back_and_its_secret_is_owner_only(tmp_path: Path) -> None:
    public_file, secret_file = write_key_pair(tmp_path / "keys", "node1")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = read_key(secret_file, secret=True, setting="s")
    assert read_key(public_file, secret=False, setting="s") == zmq.curve_public(secret)
    assert zmq.auth.load_certificate(secret_file) == (zmq.curve_public(secret), secret)  # ZMQ's own format
    with pytest.raises(ValueError, match="holds no secret key"):
        read_key(public_file, secret=True, setting="s")
    with pytest.raises(FileExistsError, match="never overwritten"):
        write_key_pair(tmp_path / "keys", "node1")


def test_client_keys_from_a_directory_a_list_and_tenants(tmp_path: Path) -> None:
    (tmp_path / "clients").mkdir()
    pairs = [zmq.curve_keypair() for _ in range(4)]
    write_key_pair(tmp_path / "clients", "a")  # a certificate in the directory
    (tmp_path / "clients" / "b.key").write_text(pairs[0][0].decode() + "\n")  # a bare key beside it
    (tmp_path / "list").write_text(f"# engines\n{pairs[1][0].decode()}\n\n{pairs[2][0].decode()}\n")
    tenant = {"name": "t", "public_key": pairs[3][0].decode(), "namespaces": [{"model": "m", "salt": "s"}]}
    by_dir = SecurityConfig(curve_client_keys=str(tmp_path / "clients")).allowed_clients()
    assert len(by_dir) == 2 and pairs[0][0] in by_dir and set(by_dir.values()) == {None}
    by_list = SecurityConfig.model_validate({"curve_client_keys": str(tmp_path / "list"), "tenants": [tenant]})
    allowed = by_list.allowed_clients()
    assert set(allowed) == {pairs[1][0], pairs[2][0], pairs[3][0]}
    assert allowed[pairs[3][0]] == TenantGrants("t", frozenset({("m", "s")}))


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"curve_secret_key": "short"}, "not a CURVE key (40 Z85 characters), got 5"),
        ({"curve_secret_key_file": "/nonexistent/k"}, "security.curve_secret_key_file: cannot read /nonexistent/k"),
    ],
)
def test_a_bad_key_is_named_without_its_text(settings: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as raised:
        SecurityConfig.model_validate(settings).server_secret_key()
    assert "short" not in str(raised.value)


def test_grants_allow_the_deployments_derived_salts_only() -> None:
    grants = TenantGrants("t", frozenset({("m", "s")}))
    assert grants.allows("m", "s") and grants.allows("m", "s|kv_cache_dtype=fp8_e4m3") and grants.allows("m", "s|x")
    assert not grants.allows("m", "") and not grants.allows("m", "s2") and not grants.allows("other", "s")
    assert not grants.allows("m", "s\0x")


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"ipc_mode": "999"}, "not an octal mode"),
        ({"ipc_mode": 0o1777}, "between 0000 and 0777"),
        ({"http_token": "a", "http_token_file": "/f"}, "give one of http_token and http_token_file"),
        ({"tenants": '[{"name": "t", "public_key": "k", "namespaces": [{"model": "m", "salt": "a|b"}]}]'}, "'|'"),
        ({"tenants": [{"name": "t", "namespaces": [{"model": "m"}]}]}, "exactly one of public_key"),
    ],
)
def test_bad_security_settings_are_named(settings: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SecurityConfig.model_validate(settings)


def test_ipc_mode_reads_octal_as_written() -> None:
    assert [SecurityConfig.model_validate({"ipc_mode": m}).ipc_mode_bits for m in ("660", "0o640", 0o600)] == [
        0o660,
        0o640,
        0o600,
    ]
