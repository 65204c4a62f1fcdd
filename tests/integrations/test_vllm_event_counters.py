"""What kvferry's KV events lost reaches vLLM's /metrics with the connector's other counters: stores the events
forgot for want of room (`BlockEvents.dropped`) and losses of the feed (a full queue in embedded mode), as
``kvferry_vllm_events_dropped_total`` and ``kvferry_vllm_event_feed_losses_total``."""

from __future__ import annotations

import importlib.util
import os
import random
from functools import partial
from types import SimpleNamespace

import pytest

from kvferry.connector.block_events import BlockEvents
from kvferry.connector.event_feeds import CacheFeed
from kvferry.formats import EngineKVFormat
from tests.cache.cachekit import BS, CHUNK, NB, cache_engine, make_paged, random_blocks, random_tokens

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra"),
]


def test_lost_events_are_counted_on_vllms_metrics() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvferry.integrations.vllm.connector import KvferryConnector
    from kvferry.integrations.vllm.kv_events import VllmKVEvents
    from kvferry.integrations.vllm.vllm_stats import KvferryPromMetrics

    src = make_paged(FMT, NB, seed=4)
    rng = random.Random(5)
    stores = rng.randrange(3, 7)  # finished requests' stores, one pending at most: all but the last forgotten
    with cache_engine(64, FMT, src) as engine:
        feed = CacheFeed(engine, capacity=1)
        events = VllmKVEvents(BlockEvents(feed, block_size=BS, chunk_size=CHUNK, max_pending=1))
        for i in range(stores):
            tokens = random_tokens(2 * CHUNK, seed=i)
            events.events.finished(f"r{i}", tokens, [os.urandom(32) for _ in range(2 * CHUNK // BS)])
            engine.store(tokens, src, random_blocks(2 * CHUNK // BS, i), FMT)
        events.take()  # the queue held one record of the stores' many: one loss, then a re-announcement
        connector = SimpleNamespace(_scheduler=None, worker_counters=None, _stats_since={}, _events=events)
        stats = KvferryConnector.get_kv_connector_stats.__wrapped__(connector)  # type: ignore[attr-defined]
        assert stats.data == {"events_dropped": stores - 1, "event_feed_losses": 1}
        assert KvferryConnector.get_kv_connector_stats.__wrapped__(connector) is None  # nothing moved since

    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = KvferryPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    metrics.observe(stats.reduce())
    assert registry.get_sample_value("kvferry_vllm_events_dropped_total", {"engine": "0"}) == stores - 1
    assert registry.get_sample_value("kvferry_vllm_event_feed_losses_total", {"engine": "0"}) == 1
