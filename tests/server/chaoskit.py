"""The client process of the chaos test: random stores, lookups and retrieves of overlapping prompts, every
retrieved byte checked against what any client would have stored for that prefix.

The KV of a chunk is a function of the tokens up to its end (the cache key's input), so every process knows what
a hit must hold without talking to the others. Block regions a request may still be using when it fails (timed
out, server unreachable) are left alone for a while: a server that runs late must not see them reused.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.server.serverkit import FMT_REAL, REAL_BS, REAL_HS, REAL_NH, REAL_NL, REAL_NS, real_kv

CHUNK = 64
PER_CHUNK = CHUNK // REAL_BS
REGION = 6 * PER_CHUNK  # blocks of the longest prompt
REGIONS = 6
NB = REGION * REGIONS
TIMEOUT_S = 3.0
TAINTED_S = 5.0  # how long a region whose request failed is left alone


def prompts() -> list[list[int]]:
    """Ten prompts: 0-3 chunks of one shared base, then 1-3 chunks of their own and a 5-token tail."""
    base = np.random.default_rng(0).integers(0, 50_000, size=3 * CHUNK).tolist()
    out = []
    for j in range(10):
        own = np.random.default_rng(100 + j).integers(0, 50_000, size=(1 + j % 3) * CHUNK + 5).tolist()
        out.append(base[: (j % 4) * CHUNK] + own)
    return out


def truth(tokens: list[int], chunk: int) -> torch.Tensor:
    """The KV every client holds for chunk `chunk` of `tokens`: [NL, 2, PER_CHUNK, BS, NH, HS] bf16."""
    prefix = np.asarray(tokens[: (chunk + 1) * CHUNK], dtype="<u4").tobytes()
    seed = int.from_bytes(hashlib.blake2b(prefix, digest_size=8).digest(), "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    shape = (REAL_NL, 2, PER_CHUNK, REAL_BS, REAL_NH, REAL_HS)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


class _Blocks:
    """The client's KV and the block regions it hands out (a region in doubt rests for TAINTED_S)."""

    def __init__(self, seed: int) -> None:
        self.kv = real_kv(seed, nb=NB)
        self.rested_until = [0.0] * REGIONS
        self.rng = random.Random(seed)

    def region(self) -> int:
        free = [r for r in range(REGIONS) if self.rested_until[r] <= time.monotonic()]
        return self.rng.choice(free) if free else -1

    def ids(self, region: int, n_chunks: int) -> list[int]:
        start = region * REGION
        return list(range(start, start + n_chunks * PER_CHUNK))

    def fill(self, ids: list[int], tokens: list[int], n_chunks: int) -> None:
        for c in range(n_chunks):
            block = torch.tensor(ids[c * PER_CHUNK : (c + 1) * PER_CHUNK])
            value = truth(tokens, c)
            for layer in range(REAL_NL):
                self.kv[layer][:, block] = value[layer]

    def poison(self, ids: list[int]) -> None:
        for layer in range(REAL_NL):
            self.kv[layer][:, torch.tensor(ids)] = -3.0

    def holds(self, ids: list[int], tokens: list[int], n_chunks: int) -> bool:
        for c in range(n_chunks):
            block = torch.tensor(ids[c * PER_CHUNK : (c + 1) * PER_CHUNK])
            value = truth(tokens, c)
            if not all(torch.equal(self.kv[layer][:, block], value[layer]) for layer in range(REAL_NL)):
                return False
        return True


def chaos_client(endpoint: str, seed: int, stop: Any, result_path: str) -> None:
    """Child: run random requests until `stop` is set, then end the session and write a report."""
    from kvferry.client import KvferryClient, RegistrationLost, ServerError, ServerUnavailable

    all_prompts = prompts()
    blocks = _Blocks(seed)
    rng = random.Random(seed)
    report: dict[str, Any] = {"seed": seed, "ops": {}, "errors": {}, "unexpected": [], "corrupt": 0}
    report |= {"verified_bytes": 0, "hit_tokens": 0, "stored_tokens": 0, "slow": [], "lock_short": 0}
    chunk_bytes = truth(all_prompts[0], 0).numel() * 2
    client = KvferryClient(endpoint, timeout_s=TIMEOUT_S)
    reg: int | None = None
    while not stop.is_set():
        op = "register" if reg is None else rng.choice(["store", "store", "retrieve", "lookup", "lookup_lock"])
        tokens = rng.choice(all_prompts)
        n_chunks = len(tokens) // CHUNK
        region = blocks.region()
        if region < 0:
            time.sleep(0.05)
            continue
        ids = blocks.ids(region, n_chunks)
        started = time.time()
        try:
            if op == "register":
                reg = client.register_kv_cache(blocks.kv, FMT_REAL, namespace=REAL_NS)
            elif op == "store":
                blocks.fill(ids, tokens, n_chunks)
                report["stored_tokens"] += client.store(reg, tokens, ids)
            elif op == "lookup":
                report["hit_tokens"] += client.lookup(tokens, registration=reg).tokens
            else:
                locked = None
                if op == "lookup_lock":
                    found = client.lookup(tokens, registration=reg, lock=True)
                    report["hit_tokens"] += found.tokens
                    locked = found.lock
                blocks.poison(ids)
                got = client.retrieve(reg, tokens, ids, lock=locked)
                if locked is not None and got < found.tokens:
                    report["lock_short"] += 1  # a locked hit must still be there
                if got % CHUNK or not blocks.holds(ids, tokens, got // CHUNK):
                    report["corrupt"] += 1
                report["verified_bytes"] += got // CHUNK * chunk_bytes
        except RegistrationLost:
            reg = None
            _count(report["errors"], "registration_lost")
        except (ServerUnavailable, TimeoutError) as exc:
            blocks.rested_until[region] = time.monotonic() + TAINTED_S
            _count(report["errors"], type(exc).__name__)
            time.sleep(0.02)
        except ServerError as exc:
            if exc.code == "DEADLINE_EXCEEDED":
                blocks.rested_until[region] = time.monotonic() + TAINTED_S
                _count(report["errors"], exc.code)
            else:
                report["unexpected"].append(str(exc))
        ended = time.time()
        _count(report["ops"], op)
        if ended - started > TIMEOUT_S / 2:
            report["slow"].append([op, started, ended])
        time.sleep(rng.uniform(0.002, 0.02))
    client.close()
    Path(result_path).write_text(json.dumps(report))


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1
