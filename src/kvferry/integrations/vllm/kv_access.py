"""How the connector's workers reach vLLM's device KV cache (vLLM 0.34's ``kv_cache_access``), which decides whether
vLLM may allocate its extensible KV cache (driver-mapped, VMM memory).

Server mode shares the engine's KV with the ``kvferry server`` by legacy CUDA IPC (``cudaIpcGetMemHandle``), which
cannot export driver-mapped memory: it declares ``LEGACY_IPC``, and vLLM then allocates its KV cache as before
(its extensible cache off for this engine). Embedded mode copies in the worker's own process: ``IN_PROCESS``.
vLLM before 0.34 has no such declaration and never asks; the answer is then the flag's name.
"""

from __future__ import annotations

import logging
from typing import Any

from kvferry.connector.settings import ConnectorSettings

log = logging.getLogger(__name__)


def kv_cache_access(kv_transfer_config: Any) -> Any:
    """vLLM's ``KVCacheAccess`` flag for the connector configured by ``kv_transfer_config`` (its name where this
    vLLM has no such flags); a bad extra config raises as the connector's start would."""
    settings = ConnectorSettings.from_extra_config(getattr(kv_transfer_config, "kv_connector_extra_config", None))
    name = "LEGACY_IPC" if settings.mode == "server" else "IN_PROCESS"
    if settings.mode == "server":
        log.info(
            "kvferry: server mode shares the KV cache with the kvferry server by legacy CUDA IPC, which cannot "
            "export driver-mapped memory: vLLM's extensible KV cache is off for this engine"
        )
    try:
        from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return name
    return KVCacheAccess[name]
