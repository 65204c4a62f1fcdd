"""vLLM's KV cache groups (its hybrid KV cache manager, HMA) as kvferry sees them.

A hybrid model (Gemma 3, gpt-oss: sliding-window and full attention; Llama 4: chunked local attention) has one
KV cache group per layer kind; vLLM hands a connector one block table per group and frees a windowed group's
blocks once they leave the window. kvferry registers each group's layers as KV of their own: their own format,
object shape and key space, keyed by the group's index, kind and window (`KVGroup.tag`), so a model's groups
never share a key. A prefix hit is the longest chunk-aligned prefix every group holds (`GroupedLookups`); a
windowed group then loads only what lies in the window at the hit's end (vLLM allocates nothing before it).

Mamba / linear-attention groups (``MambaSpec``) keep a state per request rather than KV per token: under vLLM's
``mamba_cache_mode "align"`` (its prefix caching) kvferry stores the state at each chunk boundary vLLM hands over
as an object of its own (`state_groups`), and a hit then also needs every such group's state exactly at its end.
Without "align" vLLM keeps no state at a boundary: such groups are refused (`UnsupportedGroups`), and the
connector stays off for the model.

Nothing here imports vLLM: groups are read by attribute, so the logic runs in tests without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvferry.cache.keys import TokenIds
from kvferry.connector.backends import Backend, Hit
from kvferry.connector.engine_kv import UnsupportedKVLayout

Kind = Literal["full", "sliding_window", "chunked_local", "mamba"]
NULL_BLOCK = 0  # vLLM's null block (block_pool.null_block, the pool's first block): a freed windowed position


class UnsupportedGroups(UnsupportedKVLayout):
    """The model's KV cache groups include a kind kvferry does not move (the message says which)."""


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its layers, block size and kind; ``window`` in tokens for windowed kinds
    (the sliding window, or the local-attention chunk), with ``retained`` extra trailing tokens vLLM keeps;
    ``page_bytes``: a Mamba group's page per layer and block (its state plus padding)."""

    index: int
    kind: Kind
    block_size: int
    layer_names: tuple[str, ...]
    window: int = 0
    retained: int = 0
    page_bytes: int = 0

    @property
    def tag(self) -> str:
        """What names the group in cache keys: its index, kind and window."""
        return f"group={self.index}:{self.kind}" + (f":{self.window}" if self.window else "")

    @property
    def windowed(self) -> bool:
        """A sliding-window or chunked-local group: vLLM frees its blocks before the window."""
        return self.kind == "sliding_window" or self.kind == "chunked_local"

    @property
    def holds_state(self) -> bool:
        """A Mamba / linear-attention group: a block holds the state after the tokens up to its end."""
        return self.kind == "mamba"

    def first_loaded_chunk(self, end: int, chunk: int) -> int:
        """The first ``chunk``-token chunk a hit of ``end`` tokens loads for this group (0 for full attention): the
        one holding the first token whose block vLLM allocates, for a hit vLLM may also take one token short (it
        computes the prompt's last token)."""
        return self.skipped_tokens(max(end - 1, 0)) // chunk

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens whose blocks vLLM frees once ``num_computed`` tokens are computed (0 for full
        attention): vLLM's ``get_num_skipped_tokens`` of the group's manager, block-aligned down as vLLM frees."""
        if self.kind == "sliding_window":
            skipped = max(0, num_computed - self.window + 1 - self.retained)
        elif self.kind == "chunked_local":
            skipped = num_computed // self.window * self.window
        else:
            return 0
        return skipped // self.block_size * self.block_size


def first_unfreed_token(group: KVGroup, block_ids: Sequence[int], start: int, end: int) -> int:
    """The first token at or after ``start`` from which ``block_ids`` (the group's table) holds no freed block up
    to ``end``: a load or store of the group reads or writes only from there."""
    first = start // group.block_size
    span = list(block_ids[first : -(-end // group.block_size)])
    if NULL_BLOCK not in span:
        return start
    last_null = first + len(span) - 1 - span[::-1].index(NULL_BLOCK)  # list methods: no Python loop per block
    return max(start, (last_null + 1) * group.block_size)


class GroupedLookups:
    """The lookups of a hybrid model's groups as one: a hit is the longest prefix every group's backend holds (its
    lock the tuple of the groups' locks), whole chunks. A group whose chunk is missing (evicted, never written)
    shortens the hit, never lets a load read the wrong one.

    With ``groups`` (the groups of ``backends``, in order): a windowed group is asked for the chunks a hit loads
    for it only, those of the window before the hit's end (`KVGroup.first_loaded_chunk`); a Mamba group
    (`state_groups.StateBackend`) holds a state per boundary, which a hit needs exactly at its end. The hit is then
    the longest boundary within the attention groups' hit at which every windowed group holds its window and every
    Mamba group its state; with a Mamba group it also ends before the prompt's last token (vLLM computes at least
    that one, on top of the state the hit loads). Without ``groups`` every group is asked from token 0.
    ``whole_chunks=False``: a hit may end in a tail, for backends over one block table (a model's layer parts,
    `layer_parts`), whose every store writes the same tail to each."""

    def __init__(
        self, backends: Sequence[Backend], groups: Sequence[KVGroup] = (), *, whole_chunks: bool = True
    ) -> None:
        self.backends = list(backends)
        self.whole_chunks = whole_chunks
        self.state_groups = frozenset(group.index for group in groups if group.holds_state)
        self.windowed = {group.index: group for group in groups if group.windowed}

    @property
    def chunk_size(self) -> int | None:
        sizes = {backend.chunk_size for backend in self.backends}
        return sizes.pop() if len(sizes) == 1 else None

    def lookup(self, tokens: TokenIds, first_chunk: int = 0) -> Hit | None:
        """``first_chunk``: passed on to the groups asked from token 0 (a windowed group over layer parts asks its
        parts for its window only)."""
        if self.state_groups:
            tokens = tokens[:-1]
        locks: list[Any] = [None] * len(self.backends)
        end = len(tokens)
        for i, backend in enumerate(self.backends):
            if i in self.state_groups or i in self.windowed:
                continue
            hit = backend.lookup(tokens, first_chunk)
            if hit is None:  # a lower tier is still bringing chunks up: ask again later
                self.free_lock(locks)
                return None
            locks[i] = hit.lock
            end = min(end, hit.tokens)
            if end == 0:
                break  # a miss in one group is a miss for all: the others need not be asked
        # Whole chunks only: a group's block-granular tail (a finished request's last partial chunk) is stored by
        # that group alone, and the windowed groups' loads are planned chunk by chunk.
        chunk = (self.chunk_size or 1) if self.whole_chunks else 1
        reach: int | None = end // chunk * chunk
        states_at: int | None = 0  # the boundary the state groups were last found to hold their states at
        while reach:  # each group may shorten it, which moves the windows: until every group holds the same end
            settled = reach
            for i, group in self.windowed.items():
                reach = self._window_reach(i, group, tokens, reach, chunk, locks)
                if not reach:
                    break
            if reach and self.state_groups and reach != states_at:
                reach = states_at = self._states_at(tokens, reach, chunk, locks)
            if reach == settled:
                break
        if not reach:
            self.free_lock(locks)
            return None if reach is None else Hit(0)
        return Hit(reach, tuple(locks))

    def _window_reach(
        self, i: int, group: KVGroup, tokens: TokenIds, end: int, chunk: int, locks: list[Any]
    ) -> int | None:
        """The longest boundary up to ``end`` at which windowed group ``i`` holds the chunks a hit loads for it
        (its lock put in ``locks``); 0: none; None: one is still coming up from a lower tier."""
        while end > 0:
            hit = self.backends[i].lookup(tokens[:end], group.first_loaded_chunk(end, chunk))
            if hit is None:
                return None
            self._hold(locks, i, hit.lock)
            reach = hit.tokens // chunk * chunk
            if reach >= end:
                return end
            end = reach
        return 0

    def _states_at(self, tokens: TokenIds, end: int, chunk: int, locks: list[Any]) -> int | None:
        """The longest boundary up to ``end`` at which every state group holds its state (their locks put in
        ``locks``); 0: none; None: one is still coming up from a lower tier."""
        for boundary in range(end, 0, -chunk):
            found: dict[int, Any] = {}
            for i in sorted(self.state_groups):
                hit = self.backends[i].lookup(tokens[:boundary])
                if hit is None or hit.tokens != boundary:
                    self.free_lock([found.get(j) for j in range(len(self.backends))])
                    if hit is None:
                        return None
                    break
                found[i] = hit.lock
            else:
                for i, lock in found.items():
                    self._hold(locks, i, lock)
                return boundary
        return 0

    def _hold(self, locks: list[Any], i: int, lock: Any) -> None:
        """Group ``i``'s lock is now ``lock`` (the one it held before is freed)."""
        if locks[i] is not None:
            self.backends[i].free_lock(locks[i])
        locks[i] = lock

    def free_lock(self, lock: Any) -> None:
        if lock is None:
            return
        for backend, held in zip(self.backends, lock, strict=False):
            if held is not None:
                backend.free_lock(held)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
