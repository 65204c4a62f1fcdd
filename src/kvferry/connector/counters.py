"""The connector's counters, each counted once per event (a request is looked up once however often vLLM's
scheduler asks again), kept as running totals on each half; vLLM collects the increments (`take`) every step for
its log line and its Prometheus metrics (`kvferry_vllm_*`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DESCRIPTIONS = {
    "lookup_requests": "requests looked up in kvferry (once per request)",
    "lookup_hit_requests": "looked-up requests with a kvferry hit",
    "lookup_hit_tokens": "prompt tokens kvferry held at lookup (once per request)",
    "hit_tokens_taken": "tokens of kvferry hits vLLM scheduled to load (beyond its own prefix cache)",
    "requests_resumed": "preempted requests scheduled again (their loads and stores planned anew)",
    "loads": "loads run",
    "load_failures": "loads that came back short or failed (vLLM recomputed the rest)",
    "tokens_loaded": "tokens loaded into vLLM's KV cache",
    "load_seconds": "time from the start of each load to its end",
    "stores": "stores run",
    "store_failures": "stores that failed (later lookups miss)",
    "tokens_stored": "tokens stored into kvferry",
    "store_seconds": "time from the start of each store to its end",
    "events_dropped": "finished requests' stores or chunk keys the KV events forgot for want of room (their blocks "
    "not announced: a router sees a miss)",
    "event_feed_losses": "times the KV events' feed lost kvferry's records (embedded: its queue was full; server "
    "mode: batches the server's replay no longer held); kvferry's blocks are announced again after each",
}


@dataclass
class _Totals:
    def take(self, since: dict[str, float]) -> dict[str, float]:
        """The increments since ``since`` (updated in place to now); only the counters that moved."""
        now = asdict(self)
        moved = {name: value - since.get(name, 0) for name, value in now.items() if value != since.get(name, 0)}
        since.update(now)
        return moved


@dataclass
class SchedulerCounters(_Totals):
    lookup_requests: int = 0
    lookup_hit_requests: int = 0
    lookup_hit_tokens: int = 0
    hit_tokens_taken: int = 0
    requests_resumed: int = 0

    def count_lookup(self, hit_tokens: int) -> None:
        self.lookup_requests += 1
        self.lookup_hit_requests += hit_tokens > 0
        self.lookup_hit_tokens += hit_tokens


@dataclass
class WorkerCounters(_Totals):
    loads: int = 0
    load_failures: int = 0
    tokens_loaded: int = 0
    load_seconds: float = 0.0
    stores: int = 0
    store_failures: int = 0
    tokens_stored: int = 0
    store_seconds: float = 0.0


@dataclass
class EventCounters(_Totals):
    """The scheduler's KV events of kvferry's blocks (`kvferry.connector.block_events`): what they lost."""

    events_dropped: int = 0
    event_feed_losses: int = 0


assert {f.name for c in (SchedulerCounters, WorkerCounters, EventCounters) for f in fields(c)} == set(DESCRIPTIONS)
