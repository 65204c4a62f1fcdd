"""kvferry's configuration: one typed object, loadable from YAML, from ``KVFERRY_*`` environment variables and
from explicit overrides (the CLI's flags), in that order of precedence (later wins).

Environment variables name a section field with a double underscore: ``KVFERRY_CACHE__CHUNK_SIZE=512``,
``KVFERRY_SERVER__PORT=6000``, ``KVFERRY_SECURITY__HTTP_TOKEN_FILE=/etc/kvferry/token``; the tier list is
``KVFERRY_TIERS`` (a JSON list or comma-separated URLs). Secrets (``security``) dump as ``**********``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvferry.security import SecurityConfig

ENV_PREFIX = "KVFERRY_"
_MIB = 1 << 20


class CacheConfig(BaseModel):
    """The host-memory (L1) cache: chunking, keys, capacity, eviction, locks and checksums."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_size: int = Field(256, gt=0, description="tokens per chunk object (a multiple of the engine's block size)")
    l1_size_gb: float = Field(4.0, gt=0, description="host pool capacity in GiB (2**30 bytes)")
    l1_populate: bool = Field(
        True,
        description="map every page of the pool at start (else an unpinned pool's stores fault page by page, ~3x "
        "slower)",
    )
    eviction_policy: Literal["lru", "s3fifo"] = "lru"
    watermark: float = Field(
        0.9,
        gt=0,
        le=1,
        description="evict a batch once a store's objects push the pool above this fraction (while they are copied)",
    )
    eviction_batch: int = Field(16, gt=0, description="objects one eviction takes (at most a quarter of the pool's)")
    lock_timeout_s: float = Field(
        30.0, gt=0, description="seconds until a lookup lock (or a direct load's read lease) is released"
    )
    shared_pool: bool = Field(
        False,
        description="the pool in a memfd that engines of this user on this host map (direct_loads, direct_stores)",
    )
    hash_algo: Literal["sha256", "blake3"] = Field(
        "blake3",
        description="prefix-hash of the chunk keys: blake3 hashes a long prompt (lookups) ~2x faster than sha256; "
        "sha256 costs ~1 us less a chunk where each key is read out (stores)",
    )
    verify_checksums: bool = Field(
        False, description="checksum every object on store and verify it before every retrieve (costs a pass)"
    )
    tier_write: Literal["on_evict", "on_store"] = Field(
        "on_evict",
        description="on_evict: evicted objects are written to the first tier (write-behind); on_store: every "
        "stored object to every tier at once (for a tier other nodes share: Redis, Mooncake)",
    )
    spill_wait_s: float = Field(
        1.0, ge=0, description="how long a store may wait for evicted objects' tier writes to free pool memory"
    )
    in_flight_wait_s: float = Field(
        2.0,
        ge=0,
        description="how long a store waits for chunks a concurrent store is writing (then stores those that failed)",
    )
    slice_wait_s: float = Field(
        30.0,
        gt=0,
        description="how long an object stored by head slices (tensor-parallel ranks) waits for its other ranks' "
        "slices; an object still missing heads then is dropped",
    )
    async_workers: int = Field(2, gt=0, description="threads serving store_async / retrieve_async")
    codec: Literal["none", "fp8"] = Field(
        "none",
        description="chunk objects' codec: none keeps the engine's bytes; fp8 stores e4m3 values with a scale per "
        "token and head (half the bytes of bf16/fp16 in the pool, over PCIe and in tiers; docs/codec.md)",
    )
    exact_layers: list[int] = Field(
        default_factory=list,
        description="with a codec: positions of attention layers (negative from the last, e.g. [0, -1]) whose "
        "objects keep the engine's exact bytes, as vLLM's --kv-cache-dtype-skip-layers (docs/codec.md)",
    )

    @field_validator("exact_layers", mode="before")
    @classmethod
    def _layer_list(cls, value: Any) -> Any:
        """KVFERRY_CACHE__EXACT_LAYERS as `0,-1` or `[0, -1]`."""
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            try:
                return [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise ValueError(f"exact_layers={value!r} is not a list of layer positions such as 0,-1") from None
        return value

    @property
    def l1_size_bytes(self) -> int:
        """Pool capacity in bytes, rounded down to 4 KiB (the pool's default alignment)."""
        return int(self.l1_size_gb * 2**30) // 4096 * 4096


class TransferConfig(BaseModel):
    """The GPU data path's engines (`kvferry.transfer.engine_config.EngineConfig`), one per GPU, process-wide."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    staging_slots: int = Field(2, gt=0, description="staging slots per direction and GPU")
    staging_slot_mib: int = Field(64, gt=0, description="MiB per staging slot (GPU memory: 2 directions x slots)")
    slice_mib: float | None = Field(
        None, gt=0, description="bytes per pipeline slice; default a quarter of the request, 8 MiB to half a slot"
    )
    zero_copy_below_mib: float = Field(4.0, ge=0, description="requests smaller than this run zero-copy (auto mode)")
    mode: Literal["auto", "staged", "zero_copy"] = "auto"
    kernel_priority: int = Field(
        -1, description="CUDA stream priority of the gathers/scatters (lower = higher; 0 where decode latency rules)"
    )
    batch_dma: bool = Field(True, description="a slice's scattered objects as one cuMemcpyBatchAsync (CUDA 12.8+)")
    programs: int | None = Field(
        None, gt=0, description="programs per gather/scatter launch (default two per SM, eight for the fp8 codec)"
    )
    graph_max_mib: float = Field(
        64.0, ge=0, description="a request of one whole object up to this size replays a captured CUDA graph (0: off)"
    )

    def engine_settings(self) -> dict[str, Any]:
        """The `EngineConfig` keyword arguments these settings give."""
        mib = 1 << 20
        return dict(
            slots=self.staging_slots,
            slot_bytes=self.staging_slot_mib * mib,
            slice_bytes=int(self.slice_mib * mib) if self.slice_mib is not None else None,
            zero_copy_below=int(self.zero_copy_below_mib * mib),
            mode=self.mode,
            programs=self.programs,
            kernel_priority=self.kernel_priority,
            batch_dma=self.batch_dma,
            graph_max_bytes=int(self.graph_max_mib * mib),
        )


class ServerConfig(BaseModel):
    """Where the server listens and how it watches its clients.

    Port 0 (ZMQ or HTTP) binds a free port chosen by the OS; the server logs the ports it got.
    """

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address both ports bind to; loopback unless told otherwise.")
    port: int = Field(5555, ge=0, le=65535, description="ZMQ ROUTER port for clients (0 = any free port).")
    http_port: int | None = Field(
        5556,
        ge=0,
        le=65535,
        description="HTTP port for /health, /metrics, /stats (None = no HTTP side port).",
    )
    ipc_path: str | None = Field(
        None,
        description="Also listen on this Unix socket (ipc://PATH): lower latency for engines on this host; "
        "security.ipc_mode and security.ipc_group decide who may connect.",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="How often clients are told to send a heartbeat when otherwise idle."
    )
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="A session silent for this long is ended and everything it holds is freed."
    )
    max_message_bytes: int = Field(64 * _MIB, ge=4096, description="Larger request frames get a TOO_LARGE error reply.")
    transfer_workers: int = Field(
        4,
        ge=1,
        le=256,
        description="Threads that run STORE/RETRIEVE/REGISTER so the socket loop never blocks.",
    )
    copy_threads: int = Field(
        0,
        ge=0,
        le=256,
        description="Threads that copy CPU KV (torch's own ops then use one thread: no idle OpenMP thread spins on "
        "a core a copy needs). 0 = one per CPU this process may run on.",
    )
    tier_workers: int = Field(
        4,
        ge=1,
        le=256,
        description="Threads that finish LOOKUP/PREFETCH requests needing a tier's answer (a slow tier slows only "
        "those).",
    )
    busy_poll_us: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="After each request, the socket thread polls without sleeping this long (microseconds): a "
        "request arriving meanwhile finds it awake, at the cost of a CPU core.",
    )
    tier_check_interval_s: float = Field(
        5.0, gt=0, description="How often each tier is probed, so /health knows a tier is down before a request does."
    )
    events_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="ZMQ PUB port publishing the cache's KV events in vLLM's format (docs/events.md; None = off, "
        "0 = any free port); binds `host`.",
    )
    events_replay_port: int | None = Field(
        None, ge=0, le=65535, description="ZMQ ROUTER port replaying buffered KV event batches from a sequence number."
    )

    @model_validator(mode="after")
    def _timeout_exceeds_interval(self) -> ServerConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                f"heartbeat_interval_s={self.heartbeat_interval_s} (a healthy client would be dropped)"
            )
        return self

    @property
    def endpoint(self) -> str:
        """The ZMQ endpoint clients connect to (with the configured port)."""
        return f"tcp://{self.host}:{self.port}"


class KvferryConfig(BaseModel):
    """All of kvferry's settings. ``tiers`` are storage tier URLs below the host pool, searched in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache: CacheConfig = Field(default_factory=CacheConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    tiers: list[str] = Field(
        default_factory=list,
        description="storage tiers below the pool, searched in order: disk:/var/cache/kvferry?size=200GB, "
        "redis://host:6379/0, valkey+cluster://host:port,..., mooncake://host:50051?metadata=URL (docs/mooncake.md); "
        "in KVFERRY_TIERS a JSON list or comma-separated",
    )
    server: ServerConfig = Field(default_factory=ServerConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @field_validator("tiers")
    @classmethod
    def _tier_urls_parse(cls, urls: list[str]) -> list[str]:
        """Every tier URL is checked with the config (scheme, parameters, sizes), before anything is opened."""
        from kvferry.tiers.url import parse_tier_url  # the tiers pull in redis-py: only when there are any

        for url in urls:
            parse_tier_url(url)
        return urls

    def shown(self) -> dict[str, Any]:
        """The settings as JSON-able data with every secret hidden (what may be logged or printed): the security
        section's as ``**********``, a tier URL's password as its ``shown`` form does."""
        from kvferry.tiers.url import parse_tier_url

        data = self.model_dump(mode="json")
        data["tiers"] = [parse_tier_url(url).shown for url in self.tiers]
        return data

    @classmethod
    def load(
        cls,
        yaml_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> KvferryConfig:
        """Defaults, then the YAML file, then ``env`` (default ``os.environ``), then ``overrides`` (nested dicts)."""
        data: dict[str, Any] = {}
        if yaml_path is not None:
            _merge(data, _read_yaml(Path(yaml_path)))
        _merge(data, env_overrides(os.environ if env is None else env))
        if overrides:
            _merge(data, dict(overrides))
        return cls.model_validate(data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> KvferryConfig:
        """The YAML file's settings over the defaults (no environment)."""
        return cls.load(path, env={})


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """The nested settings that ``KVFERRY_*`` variables in ``env`` give; unknown names raise ValueError."""
    sections: dict[str, type[BaseModel]] = {
        "CACHE": CacheConfig,
        "SERVER": ServerConfig,
        "TRANSFER": TransferConfig,
        "SECURITY": SecurityConfig,
    }
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        if rest == "TIERS":
            out["tiers"] = _parse_tier_list(name, value)
            continue
        section, sep, field = rest.partition("__")
        model = sections.get(section)
        if not sep or model is None or field.lower() not in model.model_fields:
            known = [f"{ENV_PREFIX}{s}__{f.upper()}" for s, m in sections.items() for f in m.model_fields]
            raise ValueError(f"unknown environment variable {name}; known: {ENV_PREFIX}TIERS, {', '.join(known)}")
        out.setdefault(section.lower(), {})[field.lower()] = value
    return out


def _parse_tier_list(name: str, value: str) -> list[str]:
    text = value.strip()
    if text.startswith("["):
        try:
            urls = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}={value!r} is not a JSON list of tier URLs: {exc}") from None
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"{name}={value!r} must be a JSON list of strings")
        return urls
    return [u.strip() for u in text.split(",") if u.strip()]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {path}: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Deep-merge ``new`` into ``into``: nested mappings merge, anything else replaces."""
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], dict(value))
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


__all__ = ["CacheConfig", "KvferryConfig", "SecurityConfig", "ServerConfig", "TransferConfig", "env_overrides"]
