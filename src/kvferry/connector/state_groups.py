"""Mamba / linear-attention state (vLLM's ``MambaSpec`` groups) as kvferry objects.

Such a group keeps no KV per token: each block of its table holds the layers' recurrent state (conv and ssm or
temporal state, dtypes of their own) after the tokens up to the block's end. Under vLLM's ``mamba_cache_mode
"align"`` (what its prefix caching of hybrids turns on) block ``i`` of a request's table holds the state after
``(i + 1) * block_size`` tokens where it is not vLLM's null block; vLLM hands a connector each state it commits,
with its exact block and boundary, in the step that computes it (``boundary_state_offloads``), and on a hit of
``H`` tokens allocates one block for the state, at index ``H // block_size - 1``. In the step that schedules the
request its worker copies that block into the block of the request's running state (the last of the step's
table), which the forward pass starts from, before the connector's ``start_load_kv``: a foreground load writes
the state into both (`hybrid_scheduler`).

kvferry stores the state at a chunk boundary as one object of its own, a byte copy per layer of the state region
of the block's page (vLLM's view of a layer is ``[blocks, 1, 1, state bytes]`` of int8, in a page of
``page_size_padded`` bytes it shares with attention layers' pages). The copy path moves chunks of ``chunk_size``
token rows, so the state region is read as ``chunk_size`` rows of `row_bytes` bytes (rounded up to whole rows:
at most a few bytes of the page's padding ride along) in format ``NL_X_NB_NH_BS_CS`` with one block per chunk.

Keys: the object of the state after ``tokens`` is the chunk whose tokens are `state_key_tokens(tokens)`, a digest
of the whole prefix stretched to one chunk, in the group's key space (its tag names the kind ``mamba``). So
lookups, locks, eviction, tiers and a server handle a state as any chunk, and a state is found only at exactly
the boundary it was stored for: a hit needs the state at its end, never one before it (`StateBackend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import blake3
import numpy as np
import torch

from kvferry.cache.keys import TokenIds, token_view
from kvferry.connector.backends import Backend, Hit
from kvferry.connector.engine_kv import EngineKV, UnsupportedKVLayout
from kvferry.connector.state_rows import row_bytes
from kvferry.formats import EngineKVFormat

_KEY_CONTEXT = b"kvferry mamba state key v1"


def state_kv(layers: Sequence[torch.Tensor], names: Sequence[str], page_bytes: int, chunk_size: int) -> EngineKV:
    """The state views of a Mamba group's layers (vLLM's ``[blocks, 1, 1, state bytes]`` int8 views, in layer
    order) as KV kvferry moves: per layer ``[blocks, 1, chunk_size, row bytes]`` uint8 over the same pages."""
    first = layers[0]
    for name, view in zip(names, layers, strict=True):
        if view.dim() != 4 or tuple(view.shape[1:3]) != (1, 1) or view.shape != first.shape:
            raise UnsupportedKVLayout(
                f"the Mamba state view of {name!r} is {tuple(view.shape)}; expected vLLM's [blocks, 1, 1, bytes] "
                f"like {tuple(first.shape)} in every layer of the group"
            )
        if view.element_size() != 1 or view.stride(3) != 1 or view.stride(0) < page_bytes:
            raise UnsupportedKVLayout(
                f"the Mamba state view of {name!r} is {view.dtype} with strides {view.stride()}: not byte pages of "
                f"{page_bytes} bytes"
            )
    state_bytes = int(first.shape[3])
    width = row_bytes(state_bytes, page_bytes, chunk_size)
    shape = (int(first.shape[0]), 1, chunk_size, width)
    rows = [torch.as_strided(v.view(torch.uint8), shape, (v.stride(0), chunk_size * width, width, 1)) for v in layers]
    return EngineKV(EngineKVFormat.NL_X_NB_NH_BS_CS, rows, rows, list(names), chunk_size, "uint8")


def state_key_tokens(tokens: TokenIds, chunk_size: int) -> list[int]:
    """The token ids that key the state after ``tokens``: one chunk, a digest of the whole prefix (blake3 read out
    to ``chunk_size`` 32-bit ids). Two prefixes share it only if they are equal."""
    digest = blake3.blake3(token_view(tokens), derive_key_context=_KEY_CONTEXT.decode()).digest(4 * chunk_size)
    return np.frombuffer(digest, dtype="<u4").tolist()


class StateBackend:
    """A Mamba group's backend: the state after a prefix, as one object (see the module's docstring).

    ``lookup(tokens)`` hits only the state after exactly ``tokens`` (``Hit(len(tokens))``); ``store_async`` and
    ``retrieve_async`` move the state after ``tokens`` out of / into the last of ``block_ids``, the block vLLM
    handed over (store) or allocated (load) for that boundary, never its null block."""

    def __init__(self, backend: Backend, *, demote_superseded: bool = True) -> None:
        self.backend = backend
        self.demote_superseded = demote_superseded

    @property
    def chunk_size(self) -> int | None:
        return self.backend.chunk_size

    def lookup(self, tokens: TokenIds, first_chunk: int = 0) -> Hit | None:
        chunk = self.chunk_size
        if chunk is None or not len(tokens) or len(tokens) % chunk:
            return Hit(0)
        found = self.backend.lookup(state_key_tokens(tokens, chunk))
        if found is None:  # coming up from a lower tier
            return None
        if found.tokens == chunk:
            return Hit(len(tokens), found.lock)
        if found.lock is not None:
            self.backend.free_lock(found.lock)
        return Hit(0)

    def free_lock(self, lock: Any) -> None:
        self.backend.free_lock(lock)

    def store_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Resolves to ``chunk_size`` once stored, 0 when it was present already (or found no room). The state at
        the boundary before (the same prefix's) is then superseded: only a lookup ending exactly there needs it,
        so it goes first when the cache evicts (``demote``), not at once."""
        chunk = self._boundary_chunk(tokens, block_ids)
        stored = self.backend.store_async(state_key_tokens(tokens, chunk), block_ids[-1:], 0)
        if self.demote_superseded and len(tokens) > chunk:
            earlier = state_key_tokens(tokens[: len(tokens) - chunk], chunk)
            stored.add_done_callback(lambda _: self.backend.demote(earlier, range(1)))
        return stored

    def demote(self, tokens: TokenIds, chunks: range) -> None:
        """Nothing: a state is demoted by the store of the next boundary's (`store_async`)."""

    def retrieve_async(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Resolves to ``len(tokens)`` once the state is in place, else to ``skip_prefix_tokens`` (a miss)."""
        chunk = self._boundary_chunk(tokens, block_ids)
        loaded = self.backend.retrieve_async(state_key_tokens(tokens, chunk), block_ids[-1:], 0)
        out: Future[int] = Future()

        def settle(done: Future[int]) -> None:
            exc = done.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(len(tokens) if done.result() == chunk else skip_prefix_tokens)

        loaded.add_done_callback(settle)
        return out

    def retrieve(self, tokens: TokenIds, block_ids: list[int], skip_prefix_tokens: int) -> int:
        return self.retrieve_async(tokens, block_ids, skip_prefix_tokens).result()

    def close(self) -> None:
        self.backend.close()

    def _boundary_chunk(self, tokens: TokenIds, block_ids: list[int]) -> int:
        chunk = self.chunk_size
        if chunk is None:
            raise RuntimeError("the cache's chunk size is not known yet")
        if not len(tokens) or len(tokens) % chunk:
            raise ValueError(f"a Mamba state is kept at chunk boundaries: {len(tokens)} tokens is not one")
        if not block_ids or block_ids[-1] == 0:
            raise ValueError("a Mamba state moves in and out of a real block, never vLLM's null block 0")
        return chunk
