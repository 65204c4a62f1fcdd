import pytest

from kvferry.tiers.health import HealthGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gate(clock: Clock, changes: list[bool] | None = None) -> HealthGate:
    return HealthGate("t", 1.0, 8.0, clock=clock, on_change=None if changes is None else changes.append)


def test_healthy_gate_lets_everything_through() -> None:
    gate = _gate(Clock())
    assert all(gate.allow() for _ in range(5))
    assert gate.healthy and gate.retry_in_s == 0


def test_failure_blocks_until_backoff_then_admits_exactly_one_probe() -> None:
    clock, changes = Clock(), []
    gate = _gate(clock, changes)
    gate.failure(OSError("down"))
    assert not gate.healthy and changes == [False]
    assert not gate.allow()
    clock.now += 0.99
    assert not gate.allow()
    clock.now += 0.02
    assert gate.allow()  # the probe
    assert not gate.allow()  # nobody else while it runs
    gate.success()
    assert gate.healthy and changes == [False, True]
    assert gate.allow() and gate.allow()


def test_failed_probes_double_the_delay_up_to_the_cap() -> None:
    clock = Clock()
    gate = _gate(clock)
    gate.failure(OSError("down"))
    delays = []
    for _ in range(6):
        delays.append(gate.retry_in_s)
        clock.now += gate.retry_in_s
        assert gate.allow()
        gate.failure(OSError("still down"))
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_failures_of_requests_already_in_flight_do_not_extend_the_backoff() -> None:
    clock = Clock()
    gate = _gate(clock)
    gate.failure(OSError("down"))
    for _ in range(20):
        gate.failure(OSError("in flight"))
    assert gate.retry_in_s == 1.0


def test_success_resets_the_delay() -> None:
    clock = Clock()
    gate = _gate(clock)
    gate.failure(OSError("down"))
    clock.now += 1
    gate.allow()
    gate.failure(OSError("down"))
    assert gate.retry_in_s == 2.0
    clock.now += 2
    gate.allow()
    gate.success()
    gate.failure(OSError("down again"))
    assert gate.retry_in_s == 1.0


def test_a_probe_that_never_reports_does_not_block_probing_forever() -> None:
    clock = Clock()
    gate = _gate(clock)
    gate.failure(OSError("down"))
    clock.now += 1
    assert gate.allow()  # the probe's caller vanishes
    clock.now += 8.5
    assert gate.allow()


def test_backoff_must_be_positive_and_below_the_cap() -> None:
    with pytest.raises(ValueError, match="backoff"):
        HealthGate("t", 0.0, 1.0)
    with pytest.raises(ValueError, match="backoff"):
        HealthGate("t", 2.0, 1.0)
