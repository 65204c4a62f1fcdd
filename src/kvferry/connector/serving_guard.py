"""An error inside kvferry while an engine serves turns the connector off; it never takes the engine's step down.

An engine calls the connector's hooks from its scheduler loop and its model runner: an exception there (an engine
API that drifted, a kvferry bug) would end the engine. Every hook an engine adapter exposes while serving is
wrapped (`serving_hook`): the first exception is logged once, as an ERROR with its traceback, and the engine's
connectors turn off (`ServingGuard`, shared by the scheduler's and the worker's connector of an engine in one
process). From then on:

- lookups miss (0 external tokens) and plans are empty: nothing new is loaded or stored;
- the worker refuses new transfers (a load in a plan made before fails and is reported failed, so the engine
  recomputes its tokens; a store does not run), and the transfers in flight end and are reported as they would be;
- what the engine still waits for is answered as before: a finished request that had stores planned is reported
  "saving" (`OffLedger`), and the worker reports it done, so the engine frees its blocks; a request waiting for a
  hit whose load was never planned (vLLM's WAITING_FOR_REMOTE_KVS) gets a load that fails (the engine recomputes
  it); the scheduler's lookup locks are freed.

An error while off (the worker's reports still run) is logged at DEBUG and answered with the hook's plain "nothing"
(``fallback``). Exceptions at start (bad settings, an unsupported layout) are not caught: refusing to start is right.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from kvferry.cache.keys import TokenIds
from kvferry.connector.plan import LoadSpec, StepPlan

log = logging.getLogger(__name__)


class ServingGuard:
    """Whether an engine's connectors are off, and what each does when they turn off."""

    def __init__(self) -> None:
        self.off = False
        self.asleep = False  # the engine's sleep mode (vLLM's: between unregister_kv_caches and restore_kv_caches)
        self.ledger = OffLedger()  # kept by the scheduler's connector
        self._lock = threading.Lock()
        self._turn_offs: list[Callable[[], None]] = []

    def on_turn_off(self, action: Callable[[], None]) -> None:
        self._turn_offs.append(action)

    def trip(self, hook: str, exc: BaseException) -> None:
        """Turn off after ``exc`` raised in ``hook``: one ERROR, then each connector's turn-off action."""
        with self._lock:
            if self.off:
                return
            self.off = True
        log.error(
            "kvferry connector turned off after an error in %s: %s: %s. The engine serves on without it: every lookup "
            "misses and nothing is loaded or stored until the engine restarts",
            hook,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        for action in self._turn_offs:
            try:
                action()
            except Exception:
                log.debug("kvferry: turning off: %s failed", action, exc_info=True)


_guards: weakref.WeakValueDictionary[str, ServingGuard] = weakref.WeakValueDictionary()
_guards_lock = threading.Lock()


def guard_for(engine_id: str) -> ServingGuard:
    """The guard of engine ``engine_id`` in this process (its scheduler's and worker's connectors share it)."""
    with _guards_lock:
        guard = _guards.get(engine_id)
        if guard is None:
            guard = _guards[engine_id] = ServingGuard()
        return guard


F = TypeVar("F", bound=Callable[..., Any])


def serving_hook(
    fallback: Callable[..., Any],
    *,
    when_off: Callable[..., Any] | None = None,
    seen: Callable[..., None] | None = None,
    while_asleep: Callable[..., Any] | None = None,
) -> Callable[[F], F]:
    """Wrap a connector hook (the connector's ``_guard`` a `ServingGuard`): an exception trips the guard and is
    answered like a call while off.

    While off, ``when_off(connector, ...)`` answers (None: the hook itself, which then runs with transfers refused);
    an error there gets ``fallback(...)``. ``seen(connector, result, ...)`` records each answer given while on (what
    `OffLedger` must keep answering). ``while_asleep(connector, ...)``: the answer while the engine sleeps (None: the
    hook's own)."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def hook(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            guard: ServingGuard = self._guard
            if guard.asleep and while_asleep is not None and not guard.off:
                return while_asleep(self, *args, **kwargs)
            if not guard.off:
                try:
                    result = method(self, *args, **kwargs)
                except Exception as exc:
                    guard.trip(f"{type(self).__name__}.{method.__name__}", exc)
                else:
                    if seen is not None:
                        seen(self, result, *args, **kwargs)
                    return result
            try:
                return (when_off or method)(self, *args, **kwargs)
            except Exception:
                log.debug("kvferry (off): %s failed", method.__name__, exc_info=True)
                return fallback(*args, **kwargs)

        return cast(F, hook)

    return decorate


@dataclass
class _AwaitedLoad:
    tokens: TokenIds  # the prompt's tokens up to the hit's end
    skip_tokens: int  # the engine's own prefix hit
    block_ids: Sequence[Sequence[int]] = ()  # per KV cache group, once the engine allocated them


class OffLedger:
    """What the scheduler's connector answered the engine, so it keeps answering consistently once off: the requests
    that had stores planned (the engine keeps a finished one's blocks until the worker reports its stores: `finished`)
    and those waiting for a background load not yet planned (`failed_loads`)."""

    def __init__(self) -> None:
        self._storing: set[str] = set()
        self._awaited: dict[str, _AwaitedLoad] = {}

    def matched(self, req_id: str, prompt: Sequence[int], computed: int, answer: tuple[int | None, bool]) -> None:
        found, in_background = answer
        if found and in_background:
            self._awaited[req_id] = _AwaitedLoad(list(prompt[: computed + found]), computed)

    def allocated(self, req_id: str, block_ids: Sequence[Sequence[int]], num_external: int) -> None:
        awaited = self._awaited.get(req_id)
        if awaited is None:
            return
        if num_external <= 0:
            del self._awaited[req_id]
        else:
            awaited.block_ids = [list(ids) for ids in block_ids]

    def planned(self, plan: StepPlan) -> None:
        self._storing.update(spec.req_id for spec in plan.stores)
        self._storing.difference_update(plan.preempted)
        for spec in plan.loads:
            self._awaited.pop(spec.req_id, None)

    def finished(self, req_id: str) -> bool:
        """The engine's request finished: whether the engine is to keep its blocks until the worker reports its
        stores done."""
        self._awaited.pop(req_id, None)
        if req_id in self._storing:
            self._storing.discard(req_id)
            return True
        return False

    def failed_loads(self) -> list[LoadSpec]:
        """Loads for the requests the engine waits on whose load was never planned: each group's blocks from the
        engine's own hit on, which the refusing worker reports failed (the engine recomputes them)."""
        loads = [
            LoadSpec(req_id, awaited.tokens, list(ids), awaited.skip_tokens, in_background=True, group=group)
            for req_id, awaited in self._awaited.items()
            if awaited.block_ids
            for group, ids in enumerate(awaited.block_ids)
        ]
        self._awaited = {r: a for r, a in self._awaited.items() if not a.block_ids}
        return loads
