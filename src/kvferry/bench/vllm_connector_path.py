"""kvferry's way in `kvferry bench vllm-gpu`: the vLLM connector's worker side over one recorded KV case, checked.

Each round (`next_round`) takes a fresh prefix and gives the source blocks new random bytes; `store` stores the
prefix from the source blocks as vLLM's model runner does after a forward pass (and waits for it); `load` loads it
into the destination blocks as a foreground load before one. Both are the timed calls and nothing else: the lookup
before a load (`look_up`: the scheduler half's, in vLLM's scheduler step, its lock freed once the load ran), the
bytes (`before_load` poisons the destination blocks and snapshots the KV, `check_load` compares) and the tokens the
load reports (vLLM's worker counters: the whole prefix, no failed block) are outside them. A store is checked
through the load that follows it: a store that copied the wrong bytes, or none, gives a wrong or short load.

On any device: the benchmark runs it on CUDA, the tests also on the CPU.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvferry.bench.block_check import BlockCheck, check_count
from kvferry.bench.harness import BenchError
from kvferry.bench.vllm_views import Case, replay
from kvferry.cache.keys import token_array
from kvferry.connector.backends import Hit
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import make_worker_backend
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm.kv_layout import recognise

CHUNK, CHUNKS = 256, 16


class ConnectorPath:
    """One recorded case in one mode: vLLM's KV replayed on ``device``, a worker side, source and destination
    blocks scattered over the cache (a random sample of block ids, vLLM's null block 0 aside), and their check."""

    name = "kvferry"

    def __init__(
        self,
        case: Case,
        fixture: dict[str, Any],
        settings: ConnectorSettings,
        *,
        device: str = "cuda",
        chunk: int = CHUNK,
        chunks: int = CHUNKS,
        seed: int = 0,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """`allocate(bytes)`: the memory vLLM's KV buffer lives in (`kvferry.bench.vllm_views.replay`)."""
        self.case = case
        self.raw, views = replay(fixture, device, allocate)
        self.kv = _recognised(case, views)
        self.prefix_tokens = chunk * chunks
        per = self.prefix_tokens // case.block_size
        self.src, self.dst = scattered_blocks(case.num_blocks, per, seed)
        self.nbytes = sum(layer[0].numel() * layer.element_size() for layer in self.kv.layers) * per * self.kv.split
        src, dst = (list(self.kv.kernel_block_ids(ids)) for ids in (self.src, self.dst))
        self.check = BlockCheck(self.raw, self.kv.layers, src, dst, seed=seed)
        self.backend = make_worker_backend(settings, self.kv, model=case.name, block_size=case.block_size, name="b")
        self.worker = WorkerSide(self.backend, block_size=case.block_size)
        self._locates = settings.direct_loads  # a direct load copies what the lookup located
        self._prefixes = itertools.count()
        self.tokens = self.next_prefix()
        self._loaded_before = 0
        self._hit: Hit | None = None

    def next_prefix(self) -> np.ndarray:
        """A prefix no earlier store stored (its first token differs): every store copies. As the scheduler half
        hands a prompt's tokens to the worker side: a slice of the array it converted once for its lookups."""
        return token_array([next(self._prefixes), *range(1, self.prefix_tokens)])

    def next_round(self) -> None:
        self.tokens = self.next_prefix()
        self.check.refresh_source()
        self._settle()

    def store(self) -> None:
        """The round's prefix stored from the source blocks after the step's forward pass, to done."""
        self.worker.start_stores(StepPlan(stores=[StoreSpec("s", self.tokens, self.src, 0)]))
        self.worker.preempted(["s"])  # waits for the store

    def before_load(self) -> None:
        self.check.poison()
        self._loaded_before = self.worker.counters.tokens_loaded
        self.look_up()
        self._settle()

    def look_up(self) -> None:
        """The round's prefix looked up as the scheduler half does before it plans the load (its hit locked, and
        located where the loads are direct). A short hit shows as the short load that follows it."""
        hit = self._hit = self.backend.lookup(self.tokens)
        whole = hit is not None and hit.tokens == self.prefix_tokens
        if self._locates and whole and hit is not None and hit.located is None:
            raise BenchError(f"{self.case.name}: a lookup did not locate its hit for a direct load")

    def load(self) -> None:
        """The round's prefix loaded into the destination blocks before a forward pass: done when it returns."""
        located = self._hit.located if self._hit is not None else None
        self.worker.start_loads(StepPlan(loads=[LoadSpec("l", self.tokens, self.dst, 0, located=located)]))

    def check_tokens(self) -> None:
        """The last load brought the whole prefix, every block of it (vLLM's worker counters); the lookup's lock is
        freed, as the scheduler half frees it once the workers reported the load."""
        if self._hit is not None:
            self.backend.free_lock(self._hit.lock)
            self._hit = None
        failed = self.worker.take_load_errors()
        loaded = self.worker.counters.tokens_loaded - self._loaded_before
        self._loaded_before = self.worker.counters.tokens_loaded
        check_count(f"{self.case.name}: a load", loaded, self.prefix_tokens)
        if failed:
            raise BenchError(f"{self.case.name}: a load reported {len(failed)} blocks failed")

    def check_load(self) -> None:
        """The last load's token count, then its bytes; checked as the call left them (no synchronize first: the
        bytes must be in place when the load returns), and on a mismatch once more after one, to tell a load that
        returned before its bytes arrived from one that wrote the wrong bytes."""
        self.check_tokens()
        what = f"{self.case.name}: a load through the connector"
        try:
            self.check.verify(what)
        except BenchError:
            if self.check.device.type != "cuda":
                raise
            torch.cuda.synchronize()
            self.check.verify(what)  # wrong bytes: raises as before
            raise BenchError(f"{what}: the bytes were not all in place when the load returned") from None

    def _settle(self) -> None:
        """Wait for the check's own writes, so that a timed call does not wait for them."""
        if self.check.device.type == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        self.worker.close()
        self.backend.close()


def scattered_blocks(num_blocks: int, per: int, seed: int) -> tuple[list[int], list[int]]:
    """Two disjoint sets of ``per`` block ids in random order, out of vLLM's ``num_blocks`` but its null block 0."""
    if 2 * per > num_blocks - 1:
        raise BenchError(f"{num_blocks} blocks cannot hold two sets of {per}")
    blocks = random.Random(seed).sample(range(1, num_blocks), 2 * per)
    return blocks[:per], blocks[per:]


def _recognised(case: Case, views: dict[str, torch.Tensor]) -> EngineKV:
    return recognise(views, isa=None, kv_cache_dtype=case.cache_dtype, mla=case.mla, block_size=case.block_size)
