"""What a client request can fail with, beyond TimeoutError (no reply within the client's timeout)."""

from __future__ import annotations


class ServerError(RuntimeError):
    """The server refused a request; `code` is the protocol's ErrorCode value."""

    def __init__(self, op: str, code: str, message: str) -> None:
        super().__init__(f"{op} failed: {code}: {message}")
        self.op = op
        self.code = code
        self.message = message


class RegistrationLost(ServerError):
    """The server does not hold the registration named (code UNKNOWN_REGISTRATION: it restarted, or this session
    was ended), or ended this client's session (code SESSION_ENDED). Register the KV again and use the new id."""


class ServerUnavailable(ConnectionError):
    """The server cannot be reached now; the request was not sent (or, if it was, is not waited for). The
    client keeps probing in the background and serves requests again once the server answers."""
