"""Who may reach a kvferry server, and what each client may use: the ``security`` section of the configuration.

Secrets (CURVE secret keys, the HTTP token) come from files or from ``KVFERRY_SECURITY__*`` variables and are held
as `pydantic.SecretStr`, so a dump of the configuration (the server's start line, `kvferry config`) shows
``**********`` in their place. Files are read when a server or client starts, not when the config is parsed: an
error then names the setting and the file.

Key files are ZMQ certificates (`kvferry keys`, `zmq.auth.create_certificates`, czmq's zcert: ``NAME.key`` holds
the public key, ``NAME.key_secret`` both) or files holding one Z85-encoded key. ZMQ is imported only where keys
are read or made: the configuration (and `kvferry --help`) does without it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

_Z85_KEY_CHARS = 40  # a 32-byte CURVE key, Z85-encoded


class NamespaceGrant(BaseModel):
    """A key space a tenant may use: a model's name and a salt, as its engines name them (the connector's
    ``model_id`` and ``salt``). The typed parts of a key space (an fp8 cache's encoding, a hybrid model's group, a
    layer split) are the same deployment's and allowed with it; a requested salt is judged by its part before any
    ``|`` (what the typed parts are hashed after)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    salt: str = ""

    @field_validator("salt")
    @classmethod
    def _plain_salt(cls, salt: str) -> str:
        if "|" in salt or "\0" in salt:
            raise ValueError(f"salt={salt!r}: a granted salt holds no '|' (derived salts add it) and no NUL")
        return salt


class TenantConfig(BaseModel):
    """One tenant: a client public key and the key spaces its requests may name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="the tenant's name in the server's log")
    public_key: str | None = Field(None, description="the tenant's CURVE public key (Z85)")
    public_key_file: str | None = Field(None, description="or a file holding it (NAME.key of `kvferry keys`)")
    namespaces: list[NamespaceGrant] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_key(self) -> TenantConfig:
        if (self.public_key is None) == (self.public_key_file is None):
            raise ValueError(f"tenant {self.name!r}: give exactly one of public_key and public_key_file")
        return self

    def key(self) -> bytes:
        if self.public_key is not None:
            return check_key(self.public_key.encode(), f"tenant {self.name!r} public_key")
        assert self.public_key_file is not None
        return read_key(self.public_key_file, secret=False, setting=f"security.tenants[{self.name}].public_key_file")


@dataclass(frozen=True)
class TenantGrants:
    """What one authenticated client may use; `allows` answers for a (model, salt) a request names."""

    name: str
    namespaces: frozenset[tuple[str, str]]

    def allows(self, model: str, salt: str) -> bool:
        if "\0" in salt:
            return False
        base = salt.split("|", 1)[0]
        return (model, base) in self.namespaces


@dataclass(frozen=True)
class ClientCurve:
    """A client's CURVE keys (Z85): its key pair and the server's public key."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)


def curve_client(socket: Any, curve: ClientCurve) -> None:
    """Make ``socket`` (a ZMQ socket, before it connects) a CURVE client with ``curve``'s keys."""
    socket.curve_serverkey = curve.server_public
    socket.curve_publickey = curve.public
    socket.curve_secretkey = curve.secret


class SecurityConfig(BaseModel):
    """Authentication of the server's listeners and the tenants of one server (docs/security.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    curve_secret_key_file: str | None = Field(
        None,
        description="server: its CURVE secret key (NAME.key_secret of `kvferry keys`): turns CURVE on for the "
        "request socket; needed to bind beyond loopback",
    )
    curve_secret_key: SecretStr | None = Field(None, description="server: or the key itself (Z85)")
    curve_client_keys: str | None = Field(
        None,
        description="server: the clients allowed in, each to every namespace: a directory of their public key "
        "files (*.key), or a file of Z85 public keys, one a line",
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="server: clients allowed in, each to its namespaces only: [{name, public_key or "
        "public_key_file, namespaces: [{model, salt}]}] (a JSON list in the environment)",
    )
    http_token_file: str | None = Field(
        None, description="server: a file holding the bearer token /stats and /metrics then ask for"
    )
    http_token: SecretStr | None = Field(None, description="server: or the token itself")
    ipc_mode: str = Field("0600", description="server: the Unix socket's permissions (octal)")
    ipc_group: str | None = Field(None, description="server: the Unix socket's group (name or id)")
    client_secret_key_file: str | None = Field(
        None, description="client: its CURVE key pair (NAME.key_secret of `kvferry keys`)"
    )
    client_secret_key: SecretStr | None = Field(None, description="client: or its secret key itself (Z85)")
    server_public_key_file: str | None = Field(
        None, description="client: the server's public key file (the server's NAME.key)"
    )
    server_public_key: str | None = Field(None, description="client: or the server's public key itself (Z85)")

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants_json(cls, value: Any) -> Any:
        """KVFERRY_SECURITY__TENANTS as a JSON list."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"tenants is not a JSON list: {exc}") from None
        return value

    @field_validator("ipc_mode", mode="before")
    @classmethod
    def _octal_mode(cls, value: Any) -> Any:
        """`0o660`, `"660"` or `"0660"`; YAML reads an unquoted 0660 as the number 432, taken as it is."""
        try:
            bits = value if isinstance(value, int) else int(str(value).removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"ipc_mode={value!r} is not an octal mode such as 0600") from None
        if not 0 <= bits <= 0o777:
            raise ValueError(f"ipc_mode={value!r} is not a file mode between 0000 and 0777")
        return f"0{bits:03o}"

    @model_validator(mode="after")
    def _one_source_each(self) -> SecurityConfig:
        pairs = [
            ("curve_secret_key", "curve_secret_key_file"),
            ("http_token", "http_token_file"),
            ("client_secret_key", "client_secret_key_file"),
            ("server_public_key", "server_public_key_file"),
        ]
        for value, file in pairs:
            if getattr(self, value) is not None and getattr(self, file) is not None:
                raise ValueError(f"give one of {value} and {file}, not both")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names repeat: {names}")
        return self

    @property
    def curve(self) -> bool:
        """Whether the server's request socket is set to use CURVE."""
        return self.curve_secret_key is not None or self.curve_secret_key_file is not None

    @property
    def has_clients(self) -> bool:
        return self.curve_client_keys is not None or bool(self.tenants)

    @property
    def has_http_token(self) -> bool:
        return self.http_token is not None or self.http_token_file is not None

    @property
    def ipc_mode_bits(self) -> int:
        return int(self.ipc_mode, 8)

    def server_secret_key(self) -> bytes:
        if self.curve_secret_key is not None:
            return check_key(self.curve_secret_key.get_secret_value().encode(), "security.curve_secret_key")
        assert self.curve_secret_key_file is not None
        return read_key(self.curve_secret_key_file, secret=True, setting="security.curve_secret_key_file")

    def allowed_clients(self) -> dict[bytes, TenantGrants | None]:
        """Every client public key (Z85) let in: a tenant's grants, or None for a key of `curve_client_keys` (every
        namespace). A key both places is the tenant's: its grants hold."""
        allowed: dict[bytes, TenantGrants | None] = {}
        if self.curve_client_keys is not None:
            allowed.update(dict.fromkeys(_read_key_list(self.curve_client_keys)))
        for tenant in self.tenants:
            grants = frozenset((g.model, g.salt) for g in tenant.namespaces)
            allowed[tenant.key()] = TenantGrants(tenant.name, grants)
        return allowed

    def http_token_value(self) -> str | None:
        if self.http_token is not None:
            token = self.http_token.get_secret_value().strip()
        elif self.http_token_file is not None:
            token = _read_text(self.http_token_file, "security.http_token_file").strip()
        else:
            return None
        if not token:
            raise ValueError("security.http_token: the token is empty")
        return token

    def client_curve(self) -> ClientCurve | None:
        """A client's CURVE keys, or None when neither its key pair nor the server's key is set (no CURVE)."""
        mine = self.client_secret_key is not None or self.client_secret_key_file is not None
        theirs = self.server_public_key is not None or self.server_public_key_file is not None
        if not mine and not theirs:
            return None
        if not (mine and theirs):
            missing = "client_secret_key_file" if not mine else "server_public_key_file"
            raise ValueError(f"security.{missing} (or its key) is needed too: CURVE takes both keys")
        if self.client_secret_key is not None:
            secret = check_key(self.client_secret_key.get_secret_value().encode(), "security.client_secret_key")
        else:
            assert self.client_secret_key_file is not None
            secret = read_key(self.client_secret_key_file, secret=True, setting="security.client_secret_key_file")
        if self.server_public_key is not None:
            server = check_key(self.server_public_key.encode(), "security.server_public_key")
        else:
            assert self.server_public_key_file is not None
            server = read_key(self.server_public_key_file, secret=False, setting="security.server_public_key_file")
        import zmq

        return ClientCurve(server_public=server, public=zmq.curve_public(secret), secret=secret)


def write_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """A new CURVE key pair as ZMQ certificates: ``NAME.key`` (the public key, to hand out) and ``NAME.key_secret``
    (both keys, created owner-only: it is never readable by others, not even for an instant). Refuses to replace
    either file."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name={name!r}: a plain file name is needed")
    import zmq

    public, secret = zmq.curve_keypair()
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in paths:
        if path.exists():
            raise FileExistsError(f"{path} exists: a key pair is never overwritten")
    _write_certificate(paths[0], public, None, 0o644)
    _write_certificate(paths[1], public, secret, 0o600)
    return paths


def _write_certificate(path: Path, public: bytes, secret: bytes | None, mode: int) -> None:
    lines = [
        f"#   ZeroMQ CURVE {'**Secret** ' if secret else 'Public '}Certificate (kvferry keys)",
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions." if secret else "",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")


def read_key(path: str | os.PathLike[str], *, secret: bool, setting: str) -> bytes:
    """The Z85 key in `path`: a ZMQ certificate's (its secret key when `secret`) or the file's one line."""
    import zmq.auth

    text = _read_text(path, setting)
    if "curve" in text:  # a ZMQ certificate
        try:
            public, secret_key = zmq.auth.load_certificate(path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{setting}: {path} is not a ZMQ certificate: {exc}") from None
        key = secret_key if secret else public
        if key is None:
            raise ValueError(f"{setting}: {path} holds no secret key (the .key_secret file of the pair has it)")
        return check_key(key, f"{setting} ({path})")
    return check_key(text.strip().encode(), f"{setting} ({path})")


def check_key(key: bytes, what: str) -> bytes:
    """`key` if it is a Z85-encoded 32-byte key; else ValueError naming `what` (never the key: it may be secret)."""
    from zmq.utils import z85

    if len(key) != _Z85_KEY_CHARS:
        raise ValueError(f"{what}: not a CURVE key (40 Z85 characters), got {len(key)} characters")
    try:
        z85.decode(key)
    except (ValueError, KeyError):
        raise ValueError(f"{what}: not a CURVE key (not Z85 text)") from None
    return key


def _read_key_list(path: str) -> list[bytes]:
    setting = "security.curve_client_keys"
    where = Path(path)
    if where.is_dir():
        files = sorted(where.glob("*.key"))
        if not files:
            raise ValueError(f"{setting}: no public key file (*.key) in {path}")
        return [read_key(f, secret=False, setting=setting) for f in files]
    text = _read_text(path, setting)
    if "curve" in text:
        return [read_key(path, secret=False, setting=setting)]
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"{setting}: {path} holds no key")
    return [check_key(k.encode(), f"{setting} ({path}, line of {k[:4]}...)") for k in keys]


def _read_text(path: str | os.PathLike[str], setting: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{setting}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


__all__ = [
    "ClientCurve",
    "NamespaceGrant",
    "SecurityConfig",
    "TenantConfig",
    "TenantGrants",
    "check_key",
    "read_key",
    "write_key_pair",
]
