"""What the connector's halves pass each other through vLLM: the scheduler's step plan to the workers, the workers'
loads back to the scheduler, and the key space once KV is registered (vLLM's metadata types)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvferry.connector.plan import StepPlan

if TYPE_CHECKING:
    from kvferry.connector.layer_parts import KeySpaceFields


class KvferryConnectorMetadata(KVConnectorMetadata):
    """One step's `StepPlan`, in the type vLLM passes from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvferryWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker halves tell the scheduler half after a step: the loads that ran, counted per request over
    the tensor-parallel ranks (a lock goes once every rank's load ran), and those that came back short on any."""

    def __init__(self, loaded: Counter[str], failed: set[str]) -> None:
        self.loaded = loaded
        self.failed = failed

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvferryWorkerMeta:
        assert isinstance(other, KvferryWorkerMeta), type(other)
        return KvferryWorkerMeta(self.loaded + other.loaded, self.failed | other.failed)


class KvferryHandshake(KVConnectorHandshakeMetadata):
    """What the worker half tells the scheduler half once KV is registered: the cache key space (plain fields)."""

    def __init__(self, key_space: KeySpaceFields, group_key_spaces: list[KeySpaceFields] | None = None) -> None:
        self.key_space = key_space  # one key space's fields, or a layer split's parts' (`layer_parts`)
        self.group_key_spaces = group_key_spaces  # a hybrid model's: one per KV cache group
