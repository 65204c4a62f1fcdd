"""Client library for `kvferry server`: register an engine's KV once, then store/retrieve by block ids."""

from kvferry.client.client import KvferryClient
from kvferry.client.errors import RegistrationLost, ServerError, ServerUnavailable
from kvferry.client.records import LookupResult, PrefetchStatus

__all__ = ["KvferryClient", "LookupResult", "PrefetchStatus", "RegistrationLost", "ServerError", "ServerUnavailable"]
