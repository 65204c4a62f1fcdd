"""The cache engine's own host pool, sized from the config with errors a person can act on."""

from __future__ import annotations

import logging
import os

from kvferry.memory import HostPool

log = logging.getLogger(__name__)


def host_pool(size_gb: float, size_bytes: int, populate: bool, shared: bool = False) -> HostPool:
    """The engine's own pool of ``cache.l1_size_gb``; a size this machine cannot hold is a ValueError naming the
    setting, not an allocator's traceback. It is mapped up front (``populate``) only if the memory is free now:
    mapping more than that would push other processes out, or wake the OOM killer."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if size_bytes > memory:
        raise ValueError(
            f"cache.l1_size_gb={size_gb!r} ({size_bytes / 2**30:.1f} GiB) exceeds this machine's memory "
            f"({memory / 2**30:.1f} GiB): give the host pool less (--l1-size-gb)"
        )
    available = _available_bytes()
    if populate and available is not None and size_bytes > available:
        log.warning(
            "cache.l1_size_gb=%s is more than the %.1f GiB free now: the pool's pages are mapped as stores reach "
            "them, not at start",
            size_gb,
            available / 2**30,
        )
        populate = False
    try:
        return HostPool(size_bytes, populate=populate, shared=shared)
    except (RuntimeError, MemoryError, OSError) as exc:  # torch's allocator (pinned or not), a memfd: refused
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"cache.l1_size_gb={size_gb!r}: cannot allocate a {size_bytes / 2**30:.1f} GiB host pool ({reason})"
        ) from None


def _available_bytes() -> int | None:
    """MemAvailable (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
