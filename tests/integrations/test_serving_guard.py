"""`serving_guard`: the first error in a hook is one ERROR and turns the engine's connectors off; answers while off
stay consistent with what vLLM was told while on (`OffLedger`)."""

from __future__ import annotations

import logging
import random

import pytest

from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.serving_guard import OffLedger, ServingGuard, guard_for, serving_hook


class _Hooks:
    def __init__(self, guard: ServingGuard) -> None:
        self._guard = guard
        self.broken = False
        self.off_calls = 0

    @serving_hook(lambda n: -1, when_off=lambda self, n: self._count_off())
    def double(self, n: int) -> int:
        if self.broken:
            raise KeyError("drifted")
        return 2 * n

    def _count_off(self) -> int:
        self.off_calls += 1
        if self.off_calls > 1:
            raise RuntimeError("the off answer failed too")
        return 0


def test_the_first_error_is_one_error_and_later_calls_get_the_off_answers(caplog: pytest.LogCaptureFixture) -> None:
    guard = ServingGuard()
    turned_off: list[str] = []
    guard.on_turn_off(lambda: turned_off.append("scheduler"))
    hooks = _Hooks(guard)
    assert hooks.double(3) == 6
    hooks.broken = True
    with caplog.at_level(logging.DEBUG, logger="kvferry"):
        assert hooks.double(3) == 0  # the off answer
        assert hooks.double(4) == -1  # the off answer raised: the fallback
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "_Hooks.double" in errors[0].getMessage() and errors[0].exc_info is not None
    assert guard.off and turned_off == ["scheduler"]
    guard.trip("again", RuntimeError("second"))  # once off, no second ERROR nor turn-off
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1 and turned_off == ["scheduler"]


def test_an_engine_s_connectors_in_one_process_share_a_guard() -> None:
    first = guard_for("engine-a")
    assert guard_for("engine-a") is first and guard_for("engine-b") is not first


def test_the_ledger_keeps_answering_what_vllm_waits_for() -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(50_000) for _ in range(40)]
    ledger = OffLedger()
    ledger.planned(StepPlan(stores=[StoreSpec("saving", prompt[:16], [1], 0), StoreSpec("preempted", prompt, [2], 0)]))
    ledger.planned(StepPlan(preempted=["preempted"]))
    ledger.matched("waiting", prompt, 8, (24, True))  # a background hit of 24 past vLLM's own 8
    ledger.allocated("waiting", ([3, 4, 5, 6], [9]), 24)
    ledger.matched("foreground", prompt, 0, (16, False))
    ledger.matched("planned", prompt, 0, (16, True))
    ledger.allocated("planned", ([7, 8],), 16)
    ledger.planned(StepPlan(loads=[LoadSpec("planned", prompt[:16], [7, 8], 0, True)]))
    ledger.matched("untaken", prompt, 0, (16, True))
    ledger.allocated("untaken", ([10],), 0)  # vLLM did not take the hit
    assert ledger.failed_loads() == [
        LoadSpec("waiting", prompt[:32], [3, 4, 5, 6], 8, in_background=True, group=0),
        LoadSpec("waiting", prompt[:32], [9], 8, in_background=True, group=1),
    ]
    assert ledger.failed_loads() == []  # each asked once
    assert ledger.finished("saving") is True and ledger.finished("saving") is False
    assert ledger.finished("preempted") is False and ledger.finished("waiting") is False
