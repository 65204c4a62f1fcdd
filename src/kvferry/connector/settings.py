"""The connector's settings: vLLM's ``kv_connector_extra_config``, validated so a typo names itself.

--kv-transfer-config '{"kv_connector": "KvferryConnector",
                       "kv_connector_module_path": "kvferry.integrations.vllm",
                       "kv_role": "kv_both",
                       "kv_connector_extra_config": {"mode": "server", "server_url": "tcp://127.0.0.1:5555"}}'
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvferry.config import KvferryConfig, env_overrides
from kvferry.security import ClientCurve, SecurityConfig

_SECURITY_VARIABLES = "KVFERRY_SECURITY__"


class CurveKeyFiles(BaseModel):
    """An engine's CURVE keys for a server that asks for them (docs/security.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret_key_file: str = Field(description="this engine's key pair (NAME.key_secret of `kvferry keys`)")
    server_key_file: str = Field(description="the server's public key (the server's NAME.key)")


class ConnectorSettings(BaseModel):
    """``mode="embedded"``: the cache lives in vLLM's worker process (configured by ``config_file`` and
    ``config``). ``mode="server"``: a ``kvferry server`` at ``server_url`` holds the cache; the worker registers
    its KV cache there once and afterwards only token and block ids cross the socket."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["embedded", "server"] = "embedded"
    server_url: str = Field(
        "tcp://127.0.0.1:5555",
        description="kvferry server endpoint (server mode): tcp://HOST:PORT, or ipc://PATH for the server's --ipc "
        "Unix socket (same host, lower latency)",
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="server mode: a handshake or lookup unanswered this long takes the server as down (lookups then "
        "miss at once until a background reconnect, with backoff, succeeds)",
    )
    legacy_ipc: bool = Field(
        False,
        description="server mode: share vLLM's KV by legacy CUDA IPC where descriptors could pass (vLLM 0.34 then "
        "turns its extensible KV cache off), for settings it refuses that cache with "
        "(kv_cache_memory_bytes, num_gpu_blocks_override, elastic EP, --no-enable-extensible-kv-cache)",
    )
    direct_loads: bool = Field(
        False,
        description="server mode: copy hits here out of a --shared-pool server's pool (same user and host)",
    )
    direct_stores: bool = Field(
        False,
        description="server mode: copy stores here into a --shared-pool server's pool (same user and host)",
    )
    async_load: bool = Field(
        True,
        description="load a hit in the background while vLLM runs the other requests; false: before the forward pass "
        "of its step (a hybrid model of several KV cache groups always loads so)",
    )
    lock_refresh_s: float = Field(
        10.0,
        gt=0,
        description="a waiting request's lookup (and the lock pinning its hit) is renewed when vLLM asks again after "
        "this long; keep it below the cache's lock_timeout_s (30 s by default)",
    )
    config_file: str | None = Field(None, description="embedded mode: a kvferry YAML config file")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="embedded mode: kvferry settings over the file and KVFERRY_* variables, e.g. "
        '{"cache": {"l1_size_gb": 8}, "tiers": ["disk:/var/cache/kvferry?size=100GB"]}',
    )
    codec: Literal["none", "fp8"] | None = Field(
        None,
        description="this engine's chunk objects' codec (docs/codec.md); default: embedded mode the config's "
        "cache.codec, server mode the server's. A codec the engine's KV cannot take (fp32, fp8 caches) refuses to "
        "start, saying why",
    )
    exact_layers: list[int] | None = Field(
        None,
        description="attention layers (positions, negative from the last: [0, -1]) whose objects keep the exact "
        "bytes beside the codec; default: embedded mode cache.exact_layers, server mode none (needs codec here)",
    )
    model_id: str | None = Field(None, description="the model's name in cache keys (default: vLLM's served model name)")
    salt: str = Field("", description="separates deployments that must not share KV")
    curve: CurveKeyFiles | None = Field(
        None,
        description='tcp:// with CURVE: {"secret_key_file": this engine\'s NAME.key_secret, "server_key_file": the '
        "server's NAME.key} (docs/security.md); default: the KVFERRY_SECURITY__* variables",
    )
    events_url: str | None = Field(
        None,
        description="server mode, with vLLM's --kv-events-config: the server's KV event stream, PUB[,REPLAY] "
        "(tcp://HOST:5557,tcp://HOST:5558), where the scheduler learns kvferry's evictions (docs/events.md)",
    )
    after_load_hook: str | None = Field(
        None,
        description="'module:function' called as function(kv_layers, block_ids) after each load "
        "(debugging and tests: e.g. check or perturb what was loaded)",
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Self:
        """Parse vLLM's extra config; ValueError naming each bad key."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'extra config'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"kv_connector_extra_config for KvferryConnector: {problems}") from None

    @model_validator(mode="after")
    def _exact_layers_with_a_codec(self) -> ConnectorSettings:
        if self.mode == "server" and self.exact_layers and self.codec is None:
            raise ValueError(
                'exact_layers in server mode needs this engine\'s codec (e.g. "codec": "fp8"): the server\'s '
                "default codec is not known when the layers are split"
            )
        return self

    def objects_codec(self) -> str | None:
        """The codec this engine's objects are in: the setting, else embedded mode's config (None in server mode:
        the server's ``cache.codec``)."""
        if self.codec is not None or self.mode == "server":
            return self.codec
        return self.kvferry_config().cache.codec

    def objects_exact_layers(self) -> list[int]:
        """The layers kept exact beside the codec: the setting, else embedded mode's config."""
        if self.exact_layers is not None or self.mode == "server":
            return list(self.exact_layers or ())
        return list(self.kvferry_config().cache.exact_layers)

    def check_chunk_size(self, chunk_size: int, block_size: int) -> None:
        """ValueError naming both settings unless kvferry's chunks are whole vLLM blocks."""
        if chunk_size <= 0 or block_size <= 0 or chunk_size % block_size:
            where = (
                "the kvferry server's --chunk-size"
                if self.mode == "server"
                else "kvferry's cache.chunk_size (the connector's config, config_file or KVFERRY_CACHE__CHUNK_SIZE)"
            )
            raise ValueError(
                f"KvferryConnector: {where} = {chunk_size} is not a multiple of vLLM's block size = {block_size} "
                "(--block-size): a chunk must hold whole vLLM blocks; pick a chunk size that is a multiple of the "
                "block size (e.g. 256 with vLLM's default block size on CPU, 128)"
            )

    def client_curve(self) -> ClientCurve | None:
        """Server mode's CURVE keys: ``curve``'s files, else the KVFERRY_SECURITY__ variables (None: no CURVE);
        ValueError naming the setting when a key cannot be read."""
        if self.curve is not None:
            security = SecurityConfig(
                client_secret_key_file=self.curve.secret_key_file, server_public_key_file=self.curve.server_key_file
            )
        else:
            variables = {name: value for name, value in os.environ.items() if name.startswith(_SECURITY_VARIABLES)}
            security = SecurityConfig.model_validate(env_overrides(variables).get("security", {}))
        return security.client_curve()

    def kvferry_config(self) -> KvferryConfig:
        """Embedded mode's cache configuration: defaults < config_file < KVFERRY_* environment < config."""
        return KvferryConfig.load(self.config_file, overrides=self.config)

    def load_after_load_hook(self) -> Callable[..., None] | None:
        if self.after_load_hook is None:
            return None
        module_name, sep, attr = self.after_load_hook.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"after_load_hook={self.after_load_hook!r} must be 'module:function'")
        hook = getattr(importlib.import_module(module_name), attr, None)
        if not callable(hook):
            raise ValueError(f"after_load_hook={self.after_load_hook!r}: {attr} is not a callable of {module_name}")
        return hook
