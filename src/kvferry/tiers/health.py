"""Circuit breaker for a tier: a failing tier is skipped, then probed after an exponential backoff."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class HealthGate:
    """Decides whether an operation may touch the backend.

    Healthy: every operation passes. The first failure marks the tier unhealthy; from then on operations are
    refused (they become misses without touching the backend) until `backoff` has elapsed, when exactly one
    operation is let through as a probe. A successful probe (or any success) makes the tier healthy again; a
    failed probe doubles the delay up to `backoff_max`. Failures of operations that were already in flight
    when the tier went down are ignored, so a burst of them does not inflate the delay.
    """

    def __init__(
        self,
        name: str,
        backoff_s: float,
        backoff_max_s: float,
        *,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < backoff_s <= backoff_max_s:
            raise ValueError(f"need 0 < backoff ({backoff_s}) <= backoff_max ({backoff_max_s}) seconds")
        self.name = name
        self._initial = backoff_s
        self._max = backoff_max_s
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._healthy = True
        self._delay = backoff_s
        self._next_probe = 0.0
        self._probe_started: float | None = None

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe is allowed (0 when healthy or due)."""
        return 0.0 if self._healthy else max(0.0, self._next_probe - self._clock())

    def allow(self) -> bool:
        with self._lock:
            if self._healthy:
                return True
            now = self._clock()
            # A probe that never reported back (its caller died) must not block probing forever.
            stuck = self._probe_started is not None and now - self._probe_started > self._max
            if now >= self._next_probe and (self._probe_started is None or stuck):
                self._probe_started = now
                return True
            return False

    def success(self) -> None:
        with self._lock:
            was_healthy = self._healthy
            self._healthy = True
            self._delay = self._initial
            self._probe_started = None
        if not was_healthy:
            log.info("tier %s is healthy again", self.name)
            if self._on_change:
                self._on_change(True)

    def failure(self, error: BaseException) -> None:
        with self._lock:
            now = self._clock()
            if self._healthy:
                self._healthy = False
                self._delay = self._initial
            elif self._probe_started is not None:
                self._delay = min(self._delay * 2, self._max)
            else:
                return  # an operation started before the tier went down
            self._next_probe = now + self._delay
            self._probe_started = None
            delay = self._delay
        log.warning(
            "tier %s is unavailable (%s: %s); retrying in %.1fs",
            self.name,
            type(error).__name__,
            error,
            delay,
        )
        if self._on_change:
            self._on_change(False)
