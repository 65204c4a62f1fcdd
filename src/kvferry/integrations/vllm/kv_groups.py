"""vLLM's KV cache groups (its hybrid KV cache manager, HMA) as kvferry sees them.

A hybrid model (Gemma 3, gpt-oss: sliding-window and full attention; Llama 4: chunked local attention) has one
KV cache group per layer kind; vLLM hands a connector one block table per group and frees a windowed group's
blocks once they leave the window. kvferry registers each group's layers as KV of their own: their own format,
object shape and key space, keyed by the group's index, kind and window (`KVGroup.tag`), so a model's groups
never share a key. A prefix hit is the longest chunk-aligned prefix every group holds (`GroupedLookups`); a
windowed group then loads only what lies in the window at the hit's end (vLLM allocates nothing before it).

Mamba / linear-attention groups (``MambaSpec``) keep one state per request rather than KV per token: they are
refused (`UnsupportedGroups`), so the connector stays off for such models and vLLM runs without it.

Nothing here imports vLLM: groups are read by attribute, so the logic runs in tests without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvferry.integrations.vllm.backends import Backend, Hit
from kvferry.integrations.vllm.page_views import UnsupportedKVLayout

Kind = Literal["full", "sliding_window", "chunked_local"]
NULL_BLOCK = 0  # vLLM's null block (block_pool.null_block, the pool's first block): a freed windowed position


class UnsupportedGroups(UnsupportedKVLayout):
    """The model's KV cache groups include a kind kvferry does not move (the message says which)."""


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its layers, block size and kind; ``window`` in tokens for windowed kinds
    (the sliding window, or the local-attention chunk), with ``retained`` extra trailing tokens vLLM keeps."""

    index: int
    kind: Kind
    block_size: int
    layer_names: tuple[str, ...]
    window: int = 0
    retained: int = 0

    @property
    def tag(self) -> str:
        """What names the group in cache keys: its index, kind and window."""
        return f"group={self.index}:{self.kind}" + (f":{self.window}" if self.window else "")

    @property
    def windowed(self) -> bool:
        return self.kind != "full"

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


def groups_of(kv_cache_config: Any) -> list[KVGroup]:
    """The groups of vLLM's ``KVCacheConfig`` (by attribute); UnsupportedGroups for a kind kvferry cannot move."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind_name = type(spec).__name__
        names = tuple(group.layer_names)
        if kind_name == "FullAttentionSpec" or kind_name == "MLAAttentionSpec":
            groups.append(KVGroup(index, "full", spec.block_size, names))
        elif kind_name == "SlidingWindowSpec":
            retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
            groups.append(KVGroup(index, "sliding_window", spec.block_size, names, spec.sliding_window, retained))
        elif kind_name == "ChunkedLocalAttentionSpec":
            groups.append(KVGroup(index, "chunked_local", spec.block_size, names, spec.attention_chunk_size))
        else:
            raise UnsupportedGroups(
                f"vLLM's KV cache group {index} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''}) is "
                f"{kind_name}: kvferry moves full, sliding-window and chunked-local attention groups only"
            )
    return groups


def hybrid_groups(kv_cache_config: Any) -> list[KVGroup]:
    """The groups when the model needs the hybrid path (several groups, or a windowed one); else none."""
    groups = groups_of(kv_cache_config)
    return groups if len(groups) > 1 or groups[0].windowed else []


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
    lock the tuple of the groups' locks). Each group's lookup is of the whole prefix from token 0, so a windowed
    group whose chunk is missing (evicted, never written) shortens the hit, never lets a load read the wrong one.
    ``whole_chunks=False``: a hit may end in a tail, for backends over one block table (a model's layer parts,
    `layer_parts`), whose every store writes the same tail to each."""

    def __init__(self, backends: Sequence[Backend], *, whole_chunks: bool = True) -> None:
        self.backends = list(backends)
        self.whole_chunks = whole_chunks

    @property
    def chunk_size(self) -> int | None:
        sizes = {backend.chunk_size for backend in self.backends}
        return sizes.pop() if len(sizes) == 1 else None

    def lookup(self, tokens: list[int]) -> Hit | None:
        hits: list[Hit] = []
        for backend in self.backends:
            hit = backend.lookup(tokens)
            if hit is None:  # a lower tier is still bringing chunks up: ask again later
                self.free_lock(tuple(h.lock for h in hits))
                return None
            hits.append(hit)
            if hit.tokens == 0:
                break  # a miss in one group is a miss for all: the others need not be asked
        if len(hits) < len(self.backends) or not hits:
            self.free_lock(tuple(h.lock for h in hits))
            return Hit(0)
        # Whole chunks only: a group's block-granular tail (a finished request's last partial chunk) is stored by
        # that group alone, and the windowed groups' loads are planned chunk by chunk.
        chunk = (self.chunk_size or 1) if self.whole_chunks else 1
        return Hit(min(h.tokens for h in hits) // chunk * chunk, tuple(h.lock for h in hits))

    def free_lock(self, lock: Any) -> None:
        if lock is None:
            return
        for backend, held in zip(self.backends, lock, strict=False):
            if held is not None:
                backend.free_lock(held)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
