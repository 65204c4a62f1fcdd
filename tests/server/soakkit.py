"""The soak test's parts: the KV every prompt must come back as, a client process running mixed traffic, and the
server's footprint (RSS, descriptors, threads, sessions, locks).

Every prompt's KV is a function of the prompt alone (seeded by it), so whichever client stored it, any hit can be
checked byte for byte. A client writes what it saw (counts, latencies by op and time bucket, prompts stored) to its
own JSON file every couple of seconds: one killed by SIGKILL loses only its last moments.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from tests.server.serverkit import FMT_REAL, REAL_BS, REAL_CHUNK, REAL_HS, REAL_NB, REAL_NH, REAL_NL, REAL_NS

PROMPTS = 200  # distinct prompts of 4 chunks (64 KiB each): 50 MiB, far more than the pool holds
PROMPT_TOKENS = 4 * REAL_CHUNK
PROMPT_BLOCKS = PROMPT_TOKENS // REAL_BS
SRC = list(range(PROMPT_BLOCKS))  # blocks a client stores from
DST = list(range(PROMPT_BLOCKS, 2 * PROMPT_BLOCKS))  # blocks a client retrieves into
FLUSH_S = 2.0


def prompt_tokens(prompt: int) -> list[int]:
    return [prompt * PROMPT_TOKENS + i for i in range(PROMPT_TOKENS)]


def expected_block(prompt: int, block: int) -> torch.Tensor:
    """The KV of block `block` of `prompt`: [NL, 2, BS, NH, HS] bf16."""
    gen = torch.Generator().manual_seed(prompt * 1000 + block)
    return torch.randn(REAL_NL, 2, REAL_BS, REAL_NH, REAL_HS, generator=gen).to(torch.bfloat16)


def new_kv() -> list[torch.Tensor]:
    buffer = torch.zeros(REAL_NL, 2, REAL_NB, REAL_BS, REAL_NH, REAL_HS, dtype=torch.bfloat16)
    return list(buffer.unbind(0))


def write_prompt(kv: list[torch.Tensor], prompt: int) -> None:
    for block, block_id in enumerate(SRC):
        data = expected_block(prompt, block)
        for layer, tensor in enumerate(kv):
            tensor[:, block_id] = data[layer]


def wrong_blocks(kv: list[torch.Tensor], prompt: int, blocks: int) -> int:
    """How many of the first `blocks` retrieved blocks differ from `prompt`'s KV in any byte."""
    wrong = 0
    for block in range(blocks):
        data = expected_block(prompt, block)
        got = torch.stack([tensor[:, DST[block]] for tensor in kv])
        wrong += not torch.equal(got.view(torch.int16), data.view(torch.int16))
    return wrong


class Tally:
    """What one client saw: counts, latencies (s) by (op, time bucket), prompts stored; `flush` writes it."""

    def __init__(self, path: Path, start_wall: float, bucket_s: float) -> None:
        self.path, self.start_wall, self.bucket_s = path, start_wall, bucket_s
        self.counts: Counter[str] = Counter()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.stored: set[int] = set()

    def timed(self, op: str, call: Any) -> Any:
        started = time.perf_counter()
        result = call()
        bucket = int((time.time() - self.start_wall) // self.bucket_s)
        self.latencies[f"{op}/{bucket}"].append(time.perf_counter() - started)
        return result

    def flush(self) -> None:
        doc = {"counts": self.counts, "latencies": self.latencies, "stored": sorted(self.stored)}
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(doc))
        os.replace(partial, self.path)


def serve_prompt(client: Any, reg: int, kv: list[torch.Tensor], prompt: int, tally: Tally, again: bool) -> None:
    """One engine request: look the prompt up, load and check what hit, store it if it did not all hit (or
    `again`: an engine that computed it anyway, so that stores go on once every prompt is cached)."""
    tokens = prompt_tokens(prompt)
    found = tally.timed("LOOKUP", lambda: client.lookup(tokens, registration=reg))
    if found.tokens:
        hit = tokens[: found.tokens]
        got = tally.timed("RETRIEVE", lambda: client.retrieve(reg, hit, DST[: len(hit) // REAL_BS]))
        tally.counts["chunks_checked"] += got // REAL_CHUNK
        tally.counts["wrong_blocks"] += wrong_blocks(kv, prompt, got // REAL_BS)
    if again or (found.tokens < PROMPT_TOKENS and not found.pending):
        write_prompt(kv, prompt)
        if tally.timed("STORE", lambda: client.store(reg, tokens, SRC)) == PROMPT_TOKENS:
            tally.stored.add(prompt)


def soak_client(endpoint: str, seed: int, path: str, start_wall: float, bucket_s: float, stop_wall: float) -> None:
    """Child: mixed traffic on its own session until `stop_wall`, then close (unless it is killed first)."""
    from kvferry.client import KvferryClient, ServerError

    rng = random.Random(seed)
    tally = Tally(Path(path), start_wall, bucket_s)
    kv = new_kv()
    client = KvferryClient(endpoint, timeout_s=10)
    reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
    flush_at = time.monotonic() + FLUSH_S
    while time.time() < stop_wall:
        try:
            serve_prompt(client, reg, kv, rng.randrange(PROMPTS), tally, again=rng.random() < 0.1)
            tally.counts["requests"] += 1
        except (ServerError, ConnectionError, TimeoutError) as exc:
            tally.counts[f"error:{type(exc).__name__}"] += 1
        if time.monotonic() >= flush_at:
            tally.flush()
            flush_at = time.monotonic() + FLUSH_S
    client.close()
    tally.flush()


def footprint(pid: int, http_port: int) -> dict[str, Any]:
    """The server process's RSS (MiB), open descriptors and threads, and its sessions, registrations and locks."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/stats", timeout=10) as response:
        stats = json.loads(response.read())
    return {
        "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "sessions": len(stats["sessions"]),
        "registrations": stats["open_registrations"],
        "locks": stats["cache"]["locks"],
    }


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
