"""How the server knows its tiers are up: a thread that probes each tier now and then (`Tier.check`).

A tier learns it is down from a failed operation, and an idle server makes none, so /health would say "ok" with
its Redis gone until the first request that needs it paid a timeout. The probes run on this thread only: a frozen
backend holds it for the tier's timeout, never the socket loop or an HTTP request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvferry.stopping import join_thread
from kvferry.tiers import Tier

log = logging.getLogger("kvferry.server")


class TierWatch:
    """Calls `check()` on every tier of `tiers()` at start and every `interval_s` until `close()`."""

    def __init__(self, tiers: Callable[[], Sequence[Tier]], interval_s: float) -> None:
        self._tiers = tiers
        self._interval_s = interval_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvferry-tier-watch", daemon=True)
        self._thread.start()

    def close(self, deadline: float) -> bool:
        """Stop probing; True if the thread ended by `deadline` (a probe of a frozen backend holds it for the
        tier's timeout: it is a daemon, left to the process's exit)."""
        self._closed.set()
        return join_thread(self._thread, deadline)

    def _run(self) -> None:
        while True:
            for tier in self._tiers():
                if self._closed.is_set():
                    return
                try:
                    tier.check()
                except Exception:  # a probe must never end the watch
                    log.exception("tier %s: health check raised", tier.name)
            if self._closed.wait(self._interval_s):
                return


def tier_health(tiers: Sequence[Tier]) -> list[dict[str, Any]]:
    """Each tier's health as last seen (no I/O)."""
    return [{"name": t.name, "healthy": t.healthy, "retry_in_s": t.stats()["retry_in_s"]} for t in tiers]
