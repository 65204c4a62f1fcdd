"""kvferry as a vLLM KV connector.

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"mode": "embedded"}}'

`KvferryConnector` (in `connector`) needs vLLM; the scheduler half's reading of vLLM's objects
(`scheduler_side`, `vllm_versions`) and the rest of this package do not, so importing them never pulls vLLM in.
The connector's engine-neutral core (both halves' logic, the backends) is `kvferry.connector`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvferryConnector"]


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector class with getattr(module, "KvferryConnector") after importing this package.
    if name == "KvferryConnector":
        from kvferry.integrations.vllm.connector import KvferryConnector

        return KvferryConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
