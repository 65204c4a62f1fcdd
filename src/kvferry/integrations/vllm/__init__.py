"""kvferry as a vLLM KV connector.

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"mode": "embedded"}}'

`KvferryConnector` (in `connector`) needs vLLM; the scheduler half (`scheduler_side`), the worker half
(`worker_side`) and the rest of this package do not, so importing them never pulls vLLM in.
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
