"""The connector's answers to vLLM once it is off (`serving_guard`), and what it records while on to give them.

Each ``*_off`` answers a hook while off; each ``saw_*`` records, from an answer given while on, what vLLM will still
wait for (the scheduler connector's `OffLedger`). The worker's hooks need neither: they run on, refusing transfers.
"""

from __future__ import annotations

from typing import Any

from kvferry.connector.plan import StepPlan
from kvferry.connector.serving_guard import OffLedger
from kvferry.integrations.vllm.connector_metadata import KvferryConnectorMetadata


def _ledger(connector: Any) -> OffLedger:
    ledger: OffLedger = connector._guard.ledger
    return ledger


def no_tokens(*args: Any, **kwargs: Any) -> tuple[int, bool]:
    return 0, False


def matched_off(connector: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
    return 0, False


def saw_matched(connector: Any, answer: tuple[int | None, bool], request: Any, num_computed_tokens: int) -> None:
    _ledger(connector).matched(request.request_id, request.prompt_token_ids or [], num_computed_tokens, answer)


def allocated(connector: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
    """Both on and off: the blocks vLLM gave a request that waits for a background load."""
    _ledger(connector).allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)


def saw_allocated(connector: Any, result: None, request: Any, blocks: Any, num_external_tokens: int) -> None:
    allocated(connector, request, blocks, num_external_tokens)


def empty_plan(*args: Any, **kwargs: Any) -> KvferryConnectorMetadata:
    return KvferryConnectorMetadata(StepPlan())


def plan_off(connector: Any, scheduler_output: Any) -> KvferryConnectorMetadata:
    """No work, but the loads vLLM still waits for, made to fail (it then recomputes them)."""
    return KvferryConnectorMetadata(StepPlan(loads=_ledger(connector).failed_loads()))


def saw_plan(connector: Any, metadata: Any, scheduler_output: Any) -> None:
    if isinstance(metadata, KvferryConnectorMetadata):
        _ledger(connector).planned(metadata.plan)


def blocks_freed(*args: Any, **kwargs: Any) -> tuple[bool, None]:
    return False, None


def finished_off(connector: Any, request: Any, block_ids: Any) -> tuple[bool, None]:
    """Keep the blocks of a request that had stores planned until the worker reports them (it still does)."""
    return _ledger(connector).finished(request.request_id), None


def saw_finished(connector: Any, answer: tuple[bool, Any], request: Any, block_ids: Any) -> None:
    _ledger(connector).finished(request.request_id)


def no_reports(*args: Any, **kwargs: Any) -> tuple[None, None]:
    return None, None


def no_transfer_results(*args: Any, **kwargs: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults()


def no_block_ids(*args: Any, **kwargs: Any) -> set[int]:
    return set()


def nothing(*args: Any, **kwargs: Any) -> None:
    return None


def nothing_off(connector: Any, *args: Any, **kwargs: Any) -> None:
    return None


def no_events(*args: Any, **kwargs: Any) -> list[Any]:
    return []
