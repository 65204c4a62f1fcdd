"""The connector's counters as vLLM's KV connector stats: its periodic "KV Transfer metrics" log line and
Prometheus counters ``kvferry_vllm_<counter>_total`` (see `counters.DESCRIPTIONS`) on vLLM's /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvferry.connector.counters import DESCRIPTIONS


@dataclass
class KvferryStats(KVConnectorStats):
    """Counter increments (``data``: name -> amount), from either half of the connector."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 3) if isinstance(value, float) else value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


class KvferryPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name, description in DESCRIPTIONS.items():
            counter = self._counter_cls(
                name=f"kvferry_vllm_{name}", documentation=f"kvferry connector: {description}", labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self._counters[(engine, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value > 0:
                counter.inc(value)
