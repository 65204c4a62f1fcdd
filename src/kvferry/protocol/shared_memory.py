"""Which files a client may pass as shared host memory (a REGISTER_KV_CACHE ``shm_fd`` storage): the client names
only such memory, and the server maps nothing else (never a device, a pipe or a file on disk a client points at)."""

from __future__ import annotations

import re

# A memfd, or a file in /dev/shm (torch's unlinked ones included), as /proc/<pid>/fd and /proc/<pid>/maps show
# them, less a trailing " (deleted)".
SHARED_MEMORY_PATH = re.compile(r"/memfd:.*|/dev/shm/[^/]+")


def is_shared_memory(path: str) -> bool:
    return SHARED_MEMORY_PATH.fullmatch(path.removesuffix(" (deleted)")) is not None
