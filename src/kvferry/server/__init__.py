"""`kvferry server`: one cache process shared by many engine processes over ZMQ (and a Unix socket on its host)."""

from kvferry.server.app import add_server_arguments, config_from_args, main
from kvferry.server.server import KvferryServer

__all__ = ["KvferryServer", "add_server_arguments", "config_from_args", "main"]
