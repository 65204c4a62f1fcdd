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
