"""The keyword options of `CacheEngine.store` and `CacheEngine.retrieve`, typed once for the synchronous calls,
their steps and their asynchronous forms, so a misspelt or missing option is a type error at every call site
(`typing.Unpack`). Their meaning is documented on `CacheEngine.store_steps` and `CacheEngine.retrieve_steps`."""

from __future__ import annotations

from typing import TypedDict

from kvferry.cache.keys import CacheNamespace
from kvferry.formats import KVGeometry


class TransferOptions(TypedDict, total=False):
    """The options a store and a retrieve share."""

    namespace: CacheNamespace | None
    block_size: int | None
    skip_prefix_tokens: int
    geometry: KVGeometry | None


class StoreOptions(TransferOptions, total=False):
    valid_until: float | None
    tail: bool
    pages: bool


class RetrieveOptions(TransferOptions, total=False):
    lock_id: int | None
    pages: bool
