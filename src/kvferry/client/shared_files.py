"""Host memory this process already shares through a file: a shared mapping (``MAP_SHARED``) of a memfd or a
/dev/shm file that one of this process's descriptors holds open -- SGLang's ``shm`` host allocator
(``memfd_create`` then ``mmap``), torch's own file-descriptor sharing, any engine that allocates so.

The server maps such memory through ``/proc/<pid>/fd/<fd>`` as it is, so registering it copies nothing; torch's
sharing (`UntypedStorage._share_fd_cpu_`) would first move the bytes into a file of its own, which for memory torch
did not allocate (a buffer over an ``mmap``) it cannot do.
"""

from __future__ import annotations

import bisect
import os
import stat
from dataclasses import dataclass

from kvferry.protocol.shared_memory import is_shared_memory


@dataclass(frozen=True)
class SharedFile:
    fd: int  # this process's descriptor of the file
    offset_bytes: int  # where the memory starts in the file


class SharedMappings:
    """This process's shared mappings of shared-memory files, as /proc/self/maps lists them when built (none
    without /proc)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._maps: list[tuple[int, int, int, int, int]] = []  # start, end, file offset, device, inode
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                lines = maps.read().splitlines()
        except OSError:
            return
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[1][3:4] != "s" or not is_shared_memory(fields[5]):
                continue
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            self._starts.append(start)
            self._maps.append((start, end, int(fields[2], 16), os.makedev(major, minor), int(fields[4])))

    def of(self, address: int, nbytes: int) -> SharedFile | None:
        """The shared-memory file under ``[address, address + nbytes)`` and a descriptor that holds it open, where
        one of the mappings covers the range; None otherwise (private or anonymous memory, a file no descriptor
        of this process holds, a range across mappings)."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start, end, offset, device, inode = self._maps[i]
        if address + nbytes > end:
            return None
        fd = _descriptor_of(device, inode)
        return None if fd is None else SharedFile(fd, offset + address - start)


def shared_file(address: int, nbytes: int) -> SharedFile | None:
    """`SharedMappings.of` with the mappings as they are now."""
    return SharedMappings().of(address, nbytes)


def _descriptor_of(device: int, inode: int) -> int | None:
    """A descriptor of this process open on the regular file ``(device, inode)``."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            info = os.fstat(int(name))
        except (OSError, ValueError):  # the listing's own descriptor, gone by now
            continue
        if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) == (device, inode):
            return int(name)
    return None
