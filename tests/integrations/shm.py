"""What is in /dev/shm, and whose it is: the tests that check an engine leaves nothing behind there run beside
other tests (pytest-xdist workers, other runs) that hold segments of their own."""

from __future__ import annotations

import os
from pathlib import Path


def in_use_elsewhere() -> set[str]:
    """/dev/shm entries a live process other than this one has open or mapped (another pytest worker's tests,
    another run's): a segment an ended process left behind is held by nobody."""
    used = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            maps = Path(f"/proc/{entry}/maps").read_text()
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone, or not ours to read
            continue
        used |= {line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line}
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("/dev/shm/"):
                used.add(target.removeprefix("/dev/shm/"))
    return used


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def pid_alive(pid: str) -> bool:
    return os.path.exists(f"/proc/{pid}")


def group_pids(pgid: int) -> set[int]:
    """The processes of process group `pgid` now (from /proc)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            pids.add(int(entry))
    return pids


def left_behind(before: set[str], pids: set[int]) -> set[str]:
    """/dev/shm entries made since `before` that are not another process's: torch names carry their maker's pid,
    and an entry a live process holds is its own (the ended engine's processes are gone); Python's named semaphores
    are unlinked as they are made."""
    new = shm_entries() - before - in_use_elsewhere()
    return {
        e for e in new if not e.startswith("sem.") and not (e.startswith("torch_") and int(e.split("_")[1]) not in pids)
    }
