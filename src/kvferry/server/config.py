"""Typed settings of `kvferry server` (the `server` section of `KvferryConfig`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

_MIB = 1 << 20


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
        description="Also listen on this Unix socket (clients connect to ipc://PATH): a lower-latency endpoint for "
        "engines on this host; the socket file's permissions decide who may connect.",
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
        description="Threads that copy CPU KV (both directions; torch's own ops then use one thread, so no idle "
        "OpenMP thread spins on a core a copy needs). 0 = one per CPU this process may run on.",
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
        description="After each request, the socket thread polls without sleeping for this long (microseconds): "
        "a request arriving meanwhile finds it awake, at the cost of a CPU core while requests keep coming.",
    )
    tier_check_interval_s: float = Field(
        5.0, gt=0, description="How often each tier is probed, so /health knows a tier is down before a request does."
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
