"""Who may talk to the server: listeners beyond loopback refuse to start without credentials, CURVE on the request
socket (its clients' keys checked by pyzmq's ZAP authenticator), and each authenticated key's tenant grants.

A request's client key is the one ZMQ authenticated for the connection it came on (the frame's ZAP "User-Id"),
never anything the request says about itself.
"""

from __future__ import annotations

import ipaddress
import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvferry.config import ServerConfig
from kvferry.security import SecurityConfig, TenantGrants
from kvferry.server.ports import ServerStartError

log = logging.getLogger("kvferry.server")

ZAP_DOMAIN = "kvferry"
_REFUSED_LOGGED = 1024  # refused keys remembered so each is logged once; past that, every refusal is


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only (a wildcard, a name or any other address does not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(server: ServerConfig, security: SecurityConfig) -> None:
    """ServerStartError naming the setting unless every listener beyond loopback asks for credentials, and the
    credentials configured make sense together."""
    if security.has_clients and not security.curve:
        raise ServerStartError(
            "security.curve_client_keys/tenants need security.curve_secret_key_file (the server's own key): "
            "without it the request socket cannot authenticate anybody"
        )
    if security.curve and not security.has_clients:
        raise ServerStartError(
            "security.curve_secret_key_file is set but no client may connect: set security.curve_client_keys "
            "or security.tenants"
        )
    if security.tenants and server.ipc_path is not None:
        raise ServerStartError(
            "security.tenants with server.ipc_path: the Unix socket cannot tell tenants apart (whoever may open it "
            "could use every namespace); leave ipc_path unset on a server shared by tenants"
        )
    if security.tenants and server.events_port is not None:
        raise ServerStartError(
            "server.events_port with security.tenants: the KV event stream carries every tenant's token ids; "
            "leave events off on a server shared by tenants"
        )
    if is_loopback(server.host):
        return
    if not security.curve:
        raise ServerStartError(
            f"server.host={server.host} is beyond loopback: the request socket needs security.curve_secret_key_file "
            "and security.curve_client_keys or security.tenants (docs/security.md)"
        )
    if server.http_port is not None and not security.has_http_token:
        raise ServerStartError(
            f"server.host={server.host} is beyond loopback: the HTTP port needs security.http_token_file "
            "(or --no-http; docs/security.md)"
        )


class RequestAuth:
    """CURVE on the server's request socket: the ZAP authenticator (a thread on the server's context) lets in the
    configured client keys only; `grants` maps each authenticated key to its tenant's namespaces."""

    def __init__(self, ctx: zmq.Context, security: SecurityConfig) -> None:
        if not zmq.has("curve"):
            raise ServerStartError("security.curve_secret_key_file: this libzmq was built without CURVE (libsodium)")
        try:
            self._secret = security.server_secret_key()
            self._allowed = {key.decode(): grants for key, grants in security.allowed_clients().items()}
        except ValueError as exc:
            raise ServerStartError(str(exc)) from None
        self._refused: set[str] = set()  # keys refused and logged (the authenticator's thread only)
        self._authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("kvferry.server.zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        log.info(
            "CURVE on the request socket: %d client keys allowed, %d of them tenants'",
            len(self._allowed),
            sum(grants is not None for grants in self._allowed.values()),
        )

    def callback(self, domain: str, key: bytes) -> bool:
        """The authenticator's question (its thread): may the client with this public key (Z85) connect? A key
        refused is logged once (its client retries every few seconds)."""
        client = key.decode()
        allowed = client in self._allowed
        if not allowed and client not in self._refused:
            if len(self._refused) < _REFUSED_LOGGED:
                self._refused.add(client)
            log.warning("a client with an unknown CURVE key %s was refused (logged once a key)", client)
        return allowed

    def secure(self, router: zmq.Socket) -> None:
        """Make `router` a CURVE server under this authenticator (before it binds)."""
        router.curve_secretkey = self._secret
        router.curve_publickey = zmq.curve_public(self._secret)
        router.curve_server = True
        router.zap_domain = ZAP_DOMAIN.encode()

    def grants(self, user_id: str | None) -> TenantGrants | None:
        """The tenant grants of an authenticated key (None: every namespace). A key not let in cannot reach here."""
        if user_id is None:
            raise PermissionError("a request without an authenticated key on a CURVE socket")
        return self._allowed[user_id]

    def close(self) -> None:
        self._authenticator.stop()
