"""`make_tier(url)`: build a tier from the one-line form used in the config and on the command line.

    disk:/var/cache/kvferry?size=200GB[&workers=4][&direct=auto|on|off][&fsync=off]
    redis://[user:password@]host[:port][/db][?workers=2&timeout=5s&connect_timeout=1s&prefix=kvferry:]
    redis+cluster://host:port[,host:port...][?...]          (valkey:// and valkey+cluster:// are the same)
    mooncake://host[:rpc_port]?metadata=http://host:port/metadata[&segment=1GiB&buffer=64MiB&protocol=tcp|rdma
               &device=mlx5_0&local=HOST&workers=2&batch=16&timeout=2s]

Every tier also takes name= (its metrics label), backoff= and backoff_max= (the unhealthy tier's probe delay,
doubling from backoff up to backoff_max). Sizes: 200GB, 1.5TB (powers of 1000), 512MiB, 4GiB (powers of
1024), or plain bytes. Durations: 2, 2s, 500ms.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple
from urllib.parse import parse_qsl, unquote

from kvferry.tiers.base import Tier
from kvferry.tiers.disk import DiskTier
from kvferry.tiers.mooncake_tier import CHECKSUMS, MooncakeTier
from kvferry.tiers.redis_tier import RedisTier

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|)\s*$")
_HOST_PORT = re.compile(r"^(?:\[(?P<ipv6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]/]+))(?::(?P<port>\d{1,5}))?$")
_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
_COMMON = ("name", "backoff", "backoff_max")
_DISK_PARAMS = ("size", "workers", "direct", "fsync", *_COMMON)
_REDIS_PARAMS = ("workers", "timeout", "connect_timeout", "prefix", "batch", *_COMMON)
_MOONCAKE_OWN = (
    "metadata", "segment", "buffer", "protocol", "device", "local", "workers", "batch", "timeout", "checksum",
)  # fmt: skip
_MOONCAKE_PARAMS = (*_MOONCAKE_OWN, *_COMMON)
_REDIS_SCHEMES = {"redis": False, "valkey": False, "redis+cluster": True, "valkey+cluster": True}
EXAMPLES = (
    "disk:/var/cache/kvferry?size=200GB, redis://127.0.0.1:6379, redis+cluster://10.0.0.1:7000,10.0.0.2:7000, "
    "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata"
)


class TierURLError(ValueError):
    """A tier URL that cannot be used; the message names the part at fault and shows valid forms."""


def parse_size(text: str) -> int:
    """'200GB' -> 200_000_000_000, '512MiB' -> 536_870_912, '4096' -> 4096."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not a size: use e.g. 200GB, 1.5TB, 512MiB, 4GiB or plain bytes")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return int(value)


def parse_duration(text: str) -> float:
    """'2' or '2s' -> 2.0 seconds, '500ms' -> 0.5."""
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"duration {text!r} is not a positive duration: use e.g. 2, 2s or 500ms")
    return float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


class TierSpec(NamedTuple):
    """A parsed tier URL: what `make_tier` builds (nothing opened yet)."""

    kind: Callable[..., Tier]  # the tier class, called with its own arguments: `args` and `kwargs`
    args: tuple[object, ...]
    kwargs: dict[str, object]
    shown: str  # the URL with any password hidden


def make_tier(url: str) -> Tier:
    """The tier ``url`` describes, opened (a disk tier's directory made and probed; Redis is reached lazily)."""
    spec = parse_tier_url(url)
    with _naming(spec.shown):
        return spec.kind(*spec.args, **spec.kwargs)


def parse_tier_url(url: str) -> TierSpec:
    """Check ``url`` without opening anything (a config check); TierURLError names what is wrong."""
    if not isinstance(url, str) or ":" not in url:
        raise TierURLError(f"tier URL {url!r} has no scheme; expected e.g. {EXAMPLES}")
    scheme, _, rest = url.partition(":")
    scheme = scheme.lower()
    location, _, query = rest.partition("?")
    shown = _redact(url)
    if scheme == "disk":
        params = _params(shown, query, _DISK_PARAMS)
        return _disk(shown, location, params)
    if scheme in _REDIS_SCHEMES:
        params = _params(shown, query, _REDIS_PARAMS)
        return _redis(shown, location, params, cluster=_REDIS_SCHEMES[scheme])
    if scheme == "mooncake":
        return _mooncake(shown, location, _params(shown, query, _MOONCAKE_PARAMS))
    raise TierURLError(
        f"tier URL {shown!r}: unknown scheme {scheme!r}; expected disk, redis, redis+cluster, "
        f"valkey, valkey+cluster or mooncake, e.g. {EXAMPLES}"
    )


def _disk(shown: str, location: str, params: dict[str, str]) -> TierSpec:
    if location.startswith("//"):
        host, _, path = location[2:].partition("/")
        if host:
            raise TierURLError(f"tier URL {shown!r}: a disk tier takes a local path, not host {host!r}")
        location = "/" + path
    if not location:
        raise TierURLError(f"tier URL {shown!r} has no directory, e.g. disk:/var/cache/kvferry?size=200GB")
    if "size" not in params:
        raise TierURLError(f"tier URL {shown!r} needs size=, the disk budget, e.g. ?size=200GB or ?size=512MiB")
    direct = params.pop("direct", "auto").lower()
    if direct != "auto" and direct not in _BOOLS:
        raise TierURLError(f"tier URL {shown!r}: direct={direct!r}, expected auto, on or off")
    with _naming(shown):
        kwargs = {
            "workers": _int(params.pop("workers", "4"), "workers"),
            "direct": None if direct == "auto" else _BOOLS[direct],
            "fsync": _bool(params.pop("fsync", "off"), "fsync"),
            **_common(params),
        }
        return TierSpec(DiskTier, (unquote(location), parse_size(params.pop("size"))), kwargs, shown)


def _redis(shown: str, location: str, params: dict[str, str], *, cluster: bool) -> TierSpec:
    if not location.startswith("//"):
        raise TierURLError(f"tier URL {shown!r}: expected //host:port after the scheme")
    netloc, _, path = location[2:].partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes = [_node(shown, part) for part in hosts.split(",")]
    if not cluster and len(nodes) > 1:
        raise TierURLError(f"tier URL {shown!r} lists {len(nodes)} hosts; use redis+cluster:// for a cluster")
    db = 0
    if path:
        if cluster or not path.isdigit():
            raise TierURLError(f"tier URL {shown!r}: path /{path} must be a database number (not for a cluster)")
        db = int(path)
    with _naming(shown):
        kwargs = {
            "cluster": cluster,
            "db": db,
            "username": unquote(username) or None,
            "password": unquote(password) or None,
            "prefix": params.pop("prefix", "kvferry:").encode(),
            "workers": _int(params.pop("workers", "2"), "workers"),
            "timeout_s": parse_duration(params.pop("timeout", "5")),
            "connect_timeout_s": parse_duration(params.pop("connect_timeout", "1")),
            "max_batch": _int(params.pop("batch", "16"), "batch"),
            **_common(params),
        }
        return TierSpec(RedisTier, (nodes,), kwargs, shown)


def _mooncake(shown: str, location: str, params: dict[str, str]) -> TierSpec:
    if not location.startswith("//") or "/" in location[2:]:
        raise TierURLError(f"tier URL {shown!r}: expected mooncake://host:rpc_port (the master), then ?metadata=")
    master = _node(shown, location[2:], default_port=50051)
    metadata = params.pop("metadata", "")
    if not metadata.startswith(("http://", "https://")):
        raise TierURLError(
            f"tier URL {shown!r} needs metadata=, the metadata server's URL, e.g. ?metadata=http://host:8080/metadata"
        )
    with _naming(shown):
        kwargs = {
            "segment_bytes": parse_size(params.pop("segment", "1GiB")),
            "buffer_bytes": parse_size(params.pop("buffer", "64MiB")),
            "protocol": params.pop("protocol", "tcp").lower(),
            "device": params.pop("device", ""),
            "local_host": params.pop("local", None) or None,
            "workers": _int(params.pop("workers", "2"), "workers"),
            "max_batch": _int(params.pop("batch", "16"), "batch"),
            "timeout_s": parse_duration(params.pop("timeout", "2")),
            "checksum": params.pop("checksum", "header").lower(),
            **_common(params),
        }
        if kwargs["protocol"] not in ("tcp", "rdma"):
            raise ValueError(f"protocol={kwargs['protocol']!r} must be tcp or rdma")
        if kwargs["checksum"] not in CHECKSUMS:
            raise ValueError(f"checksum={kwargs['checksum']!r} must be one of {', '.join(CHECKSUMS)}")
        return TierSpec(MooncakeTier, (master, metadata), kwargs, shown)


def _node(shown: str, text: str, *, default_port: int = 6379) -> tuple[str, int]:
    match = _HOST_PORT.match(text)
    if match is None:
        raise TierURLError(f"tier URL {shown!r}: {text!r} is not host[:port]")
    port = int(match.group("port") or default_port)
    if not 0 < port < 65536:
        raise TierURLError(f"tier URL {shown!r}: port {port} is out of range 1..65535")
    return match.group("ipv6") or match.group("host"), port


def _params(shown: str, query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    params: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in allowed:
            raise TierURLError(f"tier URL {shown!r}: unknown parameter {name!r}; this tier takes {', '.join(allowed)}")
        if name in params:
            raise TierURLError(f"tier URL {shown!r}: parameter {name!r} given twice")
        params[name] = value
    return params


def _common(params: dict[str, str]) -> dict[str, object]:
    common: dict[str, object] = {
        "backoff_s": parse_duration(params.pop("backoff", "1")),
        "backoff_max_s": parse_duration(params.pop("backoff_max", "60")),
    }
    if "name" in params:
        common["name"] = params.pop("name")
    return common


def _int(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{what}={text!r} must be a whole number >= 1")
    return int(text)


def _bool(text: str, what: str) -> bool:
    if text.lower() not in _BOOLS:
        raise ValueError(f"{what}={text!r} must be on/off (or true/false, 1/0, yes/no)")
    return _BOOLS[text.lower()]


@contextmanager
def _naming(shown: str) -> Iterator[None]:
    """Re-raise a ValueError from building the tier as a TierURLError that names the URL."""
    try:
        yield
    except TierURLError:
        raise
    except ValueError as exc:
        raise TierURLError(f"tier URL {shown!r}: {exc}") from exc


def _redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)
