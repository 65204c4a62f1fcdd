"""The argument maps of the client's requests (their schemas: `kvferry.server.requests`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvferry.cache.page_keys import KeyedPages
from kvferry.protocol.messages import pack_ids

Namespace = Mapping[str, str | int]


def key_space_args(registration: int | None, namespace: Namespace | None) -> dict[str, Any]:
    """A request's key space: a registration's, or an explicit one (a process that holds no KV)."""
    if registration is not None and namespace is None:
        return {"registration": registration}
    if namespace is not None and registration is None:
        return {"namespace": dict(namespace)}
    raise ValueError("give exactly one of registration= and namespace=")


def transfer_args(
    registration: int, tokens: Any, block_ids: Any, skip_prefix_tokens: int, pages: bool = False
) -> dict[str, Any]:
    """A STORE's or RETRIEVE's common arguments; pages keyed by their own hash (`KeyedPages`) go as their keys, from
    which the server makes their tokens (`kvferry.cache.page_keys`)."""
    args: dict[str, Any] = {"registration": registration}
    if pages and isinstance(tokens, KeyedPages):
        args |= {"tokens": b"", "page_keys": tokens.raw_keys()}
    else:
        args["tokens"] = pack_ids(tokens, "tokens")
    args |= {"block_ids": pack_ids(block_ids, "block_ids"), "skip_prefix_tokens": skip_prefix_tokens}
    if pages:
        args["pages"] = True
    return args


def demote_args(tokens: Any, chunks: range, key_space: dict[str, Any]) -> dict[str, Any]:
    """A DEMOTE's arguments: ``chunks`` a range of chunk indices, step 1, from 0 on."""
    if chunks.step != 1 or chunks.start < 0:
        raise ValueError(f"chunks={chunks!r} must be consecutive chunk indices from 0 on")
    args = {"tokens": pack_ids(tokens, "tokens"), "first_chunk": chunks.start, "num_chunks": len(chunks)}
    return {**args, **key_space}


def store_args(
    registration: int, tokens: Any, block_ids: Any, skip_prefix_tokens: int, tail: bool, pages: bool
) -> dict[str, Any]:
    """A STORE's arguments (``tail``: a request's last tokens short of a chunk; ``pages``: each chunk a page)."""
    args = transfer_args(registration, tokens, block_ids, skip_prefix_tokens, pages)
    if tail:
        args["tail"] = True
    return args


def retrieve_args(
    registration: int, tokens: Any, block_ids: Any, skip_prefix_tokens: int, lock: int | None, pages: bool
) -> dict[str, Any]:
    """A RETRIEVE's arguments (``lock``: a lookup's, held for it; ``pages``: each chunk a page)."""
    args = transfer_args(registration, tokens, block_ids, skip_prefix_tokens, pages)
    if lock is not None:
        args["lock"] = lock
    return args
