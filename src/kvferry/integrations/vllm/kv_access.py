"""How the connector's workers reach vLLM's device KV cache (vLLM 0.34's ``kv_cache_access``), which decides whether
vLLM may allocate its extensible KV cache (driver-mapped, VMM memory).

Server mode declares ``EXPORTS_FD``: vLLM then creates each KV segment as one physical allocation exportable as a
POSIX file descriptor, and the worker passes those descriptors to the ``kvferry server`` over its Unix socket
(`kvferry.cuda.vmm`, `kvferry.protocol.fd_passing`), which maps the same pages. That needs Linux, a CUDA driver with
the VMM export calls, and the server's Unix socket (``server_url = ipc://PATH``: descriptors cannot cross TCP);
where one is missing, or the ``legacy_ipc`` setting asks for it (vLLM refuses to start with ``EXPORTS_FD`` where it
cannot use its extensible cache: ``kv_cache_memory_bytes``, ``num_gpu_blocks_override``, elastic EP, or the cache
turned off by flag), it declares ``LEGACY_IPC``, logging why: vLLM then allocates its KV cache as before (its
extensible cache off for this engine) and the server maps it by legacy CUDA IPC (``cudaIpcGetMemHandle``).
Embedded mode declares ``IN_PROCESS``: it copies in the worker's own process, through the KV tensors' addresses,
which work on any allocation, the extensible cache's included.
vLLM before 0.34 has no such declaration and never asks; the answer is then the flag's name.
"""

from __future__ import annotations

import logging
from typing import Any

from kvferry.connector.settings import ConnectorSettings
from kvferry.cuda.vmm import fd_export_unavailable_reason

log = logging.getLogger(__name__)


def kv_cache_access(kv_transfer_config: Any) -> Any:
    """vLLM's ``KVCacheAccess`` flag for the connector configured by ``kv_transfer_config`` (its name where this
    vLLM has no such flags); a bad extra config raises as the connector's start would."""
    settings = ConnectorSettings.from_extra_config(getattr(kv_transfer_config, "kv_connector_extra_config", None))
    name = "IN_PROCESS"
    if settings.mode == "server":
        reason = "legacy_ipc is set" if settings.legacy_ipc else fd_export_unavailable_reason()
        if reason is None and not settings.server_url.startswith("ipc://"):
            reason = f"server_url {settings.server_url} is not the server's Unix socket (ipc://PATH)"
        name = "LEGACY_IPC" if reason else "EXPORTS_FD"
        if reason:
            log.info(
                "kvferry: server mode cannot pass the KV cache to the kvferry server by file descriptor (%s): it "
                "shares it by legacy CUDA IPC, which cannot export driver-mapped memory, so vLLM's extensible KV "
                "cache is off for this engine",
                reason,
            )
    try:
        from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return name
    return KVCacheAccess[name]
