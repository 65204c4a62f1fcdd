"""What the scheduler side tells the worker side to do in one engine step (vLLM's connector metadata payload).

Plain dataclasses of ints, lists and token arrays: vLLM may carry them to a worker in another process, and the
worker-side logic can be tested with hand-made plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from kvferry.cache.keys import TokenIds
from kvferry.client.records import LocateResult


class _ByValue:
    """Equal field by field, the tokens by value (an array from the scheduler half equals a list of the same ids)."""

    tokens: TokenIds

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        rest = [f.name for f in fields(self) if f.name != "tokens"]  # type: ignore[arg-type]
        if any(getattr(self, name) != getattr(other, name) for name in rest):
            return False
        mine, theirs = np.asarray(self.tokens), np.asarray(other.tokens)
        return mine.shape == theirs.shape and bool((mine == theirs).all())

    __hash__ = None  # type: ignore[assignment]  # tokens may be an array


@dataclass(frozen=True, eq=False)
class LoadSpec(_ByValue):
    """Copy the cached KV of ``tokens`` into ``block_ids``, except the first ``skip_tokens`` tokens.

    ``tokens`` is a block-aligned prefix of the prompt that the cache reported as a hit; ``block_ids`` holds one
    engine block per ``block_size`` tokens of it. ``skip_tokens`` (a multiple of the block size) is what vLLM
    already holds in its own prefix cache: those blocks may be shared with running requests, so they are
    never written. ``in_background``: the request waits for this load (vLLM's async-load path) while the step
    runs without it; otherwise the load completes before the step's forward pass. ``group``: the vLLM KV cache
    group whose blocks these are (a hybrid model's; 0 otherwise). ``located``: a server's direct load copies
    these objects (under the scheduler's lock, a read lease) without locating them again.
    """

    req_id: str
    tokens: TokenIds  # from the scheduler half: a slice of its uint32 array (`kvferry.cache.keys.token_array`)
    block_ids: list[int]
    skip_tokens: int
    in_background: bool = False
    group: int = 0
    located: LocateResult | None = None  # the hit's objects as the scheduler's lookup located them (`Hit.located`)


@dataclass(frozen=True, eq=False)
class StoreSpec(_ByValue):
    """Copy the KV of ``tokens`` (a prefix of what the request computed: whole chunks of its prompt, or at its
    finish whole blocks, the last partial chunk a tail object) out of ``block_ids`` into the cache, except the
    first ``skip_tokens`` tokens, which the cache already holds (``group``: as in `LoadSpec`)."""

    req_id: str
    tokens: TokenIds  # as in `LoadSpec`
    block_ids: list[int]
    skip_tokens: int
    group: int = 0


@dataclass
class StepPlan:
    """One step's work. ``preempted`` requests lose their blocks after this step: their stores must finish
    first."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.preempted)
