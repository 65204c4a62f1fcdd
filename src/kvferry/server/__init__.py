"""`kvferry server`: one cache process shared by many engine processes over ZMQ.

`kvferry.config` imports `ServerConfig` from this package, and the server itself imports `kvferry.config`
(through the cache engine), so the entry points are resolved lazily here to keep that import acyclic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.server.config import ServerConfig

if TYPE_CHECKING:
    from kvferry.server.app import add_server_arguments, config_from_args, main
    from kvferry.server.server import KvferryServer

_LAZY = {
    "KvferryServer": "kvferry.server.server",
    "add_server_arguments": "kvferry.server.app",
    "config_from_args": "kvferry.server.app",
    "main": "kvferry.server.app",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvferry.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["KvferryServer", "ServerConfig", "add_server_arguments", "config_from_args", "main"]
