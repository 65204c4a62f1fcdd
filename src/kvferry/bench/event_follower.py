"""`kvferry bench server --events`: a subscriber following the server's KV event stream, as a router would, in a
process of its own while the cases run; what it received is checked (a stream that published nothing would make
the comparison with events off meaningless)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from kvferry.bench.harness import BenchError

# The follower: kvferry's reference consumer (`EventSubscriber` into an `EventIndex`) until its stdin closes, then
# one JSON line of what it holds.
_FOLLOW = """
import json, sys, threading
from kvferry.client.event_index import EventIndex, EventSubscriber, Stream
index, stream = EventIndex(), Stream("server", sys.argv[1], sys.argv[2])
subscriber = EventSubscriber([stream], index)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("following", flush=True)
while not done.is_set():
    subscriber.poll(0.1)
subscriber.close()
print(json.dumps({"held": index.summary(), "last_seq": stream.last_seq, "gaps": stream.gaps}), flush=True)
"""


class EventFollower:
    """Follows the stream at ``endpoint`` (PUB) and ``replay_endpoint`` until `finish`."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        cmd = [sys.executable, "-c", _FOLLOW, endpoint, replay_endpoint]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "following":
            self.proc.kill()
            raise BenchError("--events: the event subscriber did not start")

    def finish(self) -> dict[str, Any]:
        """What the subscriber received: the chunk keys it holds per medium, the last sequence number, the gaps;
        BenchError if it received no batch or holds no chunk."""
        try:
            out, _ = self.proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise BenchError("--events: the event subscriber did not stop") from None
        lines = out.strip().splitlines()
        if self.proc.returncode != 0 or not lines:
            raise BenchError(f"--events: the event subscriber failed (status {self.proc.returncode})")
        got: dict[str, Any] = json.loads(lines[-1])
        if got["last_seq"] < 0 or not got["held"].get("server", {}).get("CPU"):
            raise BenchError(f"--events: the subscriber received no stored chunk ({got})")
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
