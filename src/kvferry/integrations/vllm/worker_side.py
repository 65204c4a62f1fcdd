"""The worker half of the vLLM connector: carries out each step's `StepPlan` against the engine's KV cache.

Loads run synchronously before the forward pass that needs them (vLLM schedules a step with kvferry hits as a
"sync load" step, so `start_load_kv` is called before the model runs). Stores start after the forward pass and
run in the background; a request's blocks stay with it until its stores are done, which this side reports
through `finished_sending`. A load that comes back short (an object evicted between lookup and load, a tier
gone) is reported block by block, so vLLM recomputes exactly those tokens instead of reading stale KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Protocol

from kvferry.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec

log = logging.getLogger(__name__)


class KVBackend(Protocol):
    """Moves KV between the engine's registered blocks and the cache (in this process or in a server)."""

    def retrieve(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> int:
        """Load the cached prefix of ``tokens``; returns how many leading tokens the blocks now hold (the
        skipped prefix included), a multiple of the chunk size or ``len(tokens)``."""
        ...

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        """Start storing the KV of ``tokens`` held in ``block_ids``; the caller keeps the blocks unchanged
        until the future is done."""
        ...


class WorkerSide:
    def __init__(
        self,
        backend: KVBackend,
        *,
        block_size: int,
        after_load: Callable[[list[int]], None] | None = None,
    ) -> None:
        """``after_load(block_ids)`` runs after each load with the blocks written (a debugging/testing hook)."""
        self._backend = backend
        self.block_size = block_size
        self._after_load = after_load
        self._inflight: dict[str, list[Future[int]]] = {}  # req_id -> its unfinished stores
        self._saving: set[str] = set()  # requests vLLM keeps blocks for until their stores are reported done
        self._finished: set[str] = set()  # those of them that vLLM reported finished
        self._load_errors: set[int] = set()
        self.tokens_loaded = 0
        self.tokens_stored = 0

    def load(self, plan: StepPlan) -> None:
        """Carry out the plan's loads now (before the forward pass that reads them)."""
        for spec in plan.loads:
            self._load_one(spec)

    def start_stores(self, plan: StepPlan) -> None:
        """Start the plan's stores (after the forward pass that computed them)."""
        for spec in plan.stores:
            self._saving.add(spec.req_id)
            self._inflight.setdefault(spec.req_id, []).append(self._store_one(spec))

    def wait_for_requests(self, req_ids: Iterable[str]) -> None:
        """Block until every store of these requests is done (their blocks are about to be reused)."""
        for req_id in req_ids:
            for future in self._inflight.pop(req_id, []):
                self._settle(future, req_id)

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM finished (now or earlier) and keeps blocks for, those whose stores are done."""
        self._finished.update(r for r in finished_req_ids if r in self._saving)
        done = set()
        for req_id in list(self._finished):
            pending = [f for f in self._inflight.get(req_id, []) if not f.done()]
            if pending:
                self._inflight[req_id] = pending
                continue
            self.wait_for_requests([req_id])  # all done: collect their results and errors
            done.add(req_id)
        self._finished -= done
        self._saving -= done
        return done

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes their tokens)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Wait for every store still running."""
        self.wait_for_requests(list(self._inflight))

    def _load_one(self, spec: LoadSpec) -> None:
        target = len(spec.tokens)
        try:
            got = self._backend.retrieve(spec.tokens, spec.block_ids, spec.skip_tokens)
        except Exception:
            log.exception("kvferry: loading %d tokens for request %s failed", target, spec.req_id)
            got = spec.skip_tokens
        if got < target:
            first_bad = max(got, spec.skip_tokens) // self.block_size
            self._load_errors.update(spec.block_ids[first_bad:])
            log.warning(
                "kvferry: request %s: loaded %d of %d tokens; vLLM recomputes the rest",
                spec.req_id,
                got,
                target,
            )
        self.tokens_loaded += max(0, min(got, target) - spec.skip_tokens)
        written = spec.block_ids[spec.skip_tokens // self.block_size : -(-min(got, target) // self.block_size)]
        if self._after_load is not None and written:
            self._after_load(written)

    def _store_one(self, spec: StoreSpec) -> Future[int]:
        try:
            return self._backend.store_async(spec.tokens, spec.block_ids, spec.skip_tokens)
        except Exception as exc:  # a store is best effort: a failed one is a later cache miss
            log.exception("kvferry: starting the store for request %s failed", spec.req_id)
            failed: Future[int] = Future()
            failed.set_exception(exc)
            return failed

    def _settle(self, future: Future[int], req_id: str) -> None:
        try:
            self.tokens_stored += future.result()
        except Exception:
            log.exception("kvferry: a store for request %s failed (a later lookup misses)", req_id)
