"""`python -m kvferry.bench.hybrid_eviction`: hit tokens of a hybrid model's multi-turn traffic in a pool smaller
than its working set, with and without demoting the sliding-window chunks a newer boundary supersedes.

A hybrid model's two KV cache groups as the connector's worker side registers them (a sliding-window group, a
full-attention one; 2 layers each, 2 KV heads of 64, bf16, CPU tensors) over one embedded cache engine. Traffic:
``--conversations`` conversations of ``--turns`` turns, taken round-robin; each turn's prompt is the previous
one and ``--turn-chunks`` new chunks, looked up (the hit counted) then stored from the hit's end, as the
connector does. The pool holds ``--pool-share`` of the objects the traffic stores. Both runs ask for the chunks of
the window before a hit's end only (what a windowed group loads); they differ in the eviction order only.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from kvferry.connector.hybrid_worker import HybridWorker, start_hybrid_worker
from kvferry.connector.kv_groups import KVGroup
from kvferry.connector.plan import StepPlan, StoreSpec
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.vllm.kv_layout import recognise

BLOCK, CHUNK, LAYERS_PER_GROUP, HEADS, HEAD = 16, 64, 2, 2, 64
OBJECT_BYTES = LAYERS_PER_GROUP * HEADS * 2 * HEAD * 2 * CHUNK  # one group's chunk: K and V of its layers, bf16


@dataclass(frozen=True)
class Traffic:
    conversations: int
    turns: int
    turn_chunks: int
    window: int

    def prompts(self) -> list[list[int]]:
        """Every turn's prompt, in the order they arrive (round-robin over the conversations)."""
        rng = random.Random(0)
        history: list[list[int]] = [[] for _ in range(self.conversations)]
        out = []
        for _ in range(self.turns):
            for c in range(self.conversations):
                history[c] = history[c] + [rng.randrange(32_000) for _ in range(self.turn_chunks * CHUNK)]
                out.append(history[c])
        return out

    @property
    def stored_objects(self) -> int:
        """Objects the traffic stores with no eviction: every chunk of every conversation, in both groups."""
        return 2 * self.conversations * self.turns * self.turn_chunks


def _worker(traffic: Traffic, pool_bytes: int, demote: bool) -> HybridWorker:
    groups = [
        KVGroup(0, "sliding_window", BLOCK, ("model.layers.0.attn", "model.layers.2.attn"), traffic.window),
        KVGroup(1, "full", BLOCK, ("model.layers.1.attn", "model.layers.3.attn")),
    ]
    blocks = traffic.turns * traffic.turn_chunks * CHUNK // BLOCK + 1
    kvs = []
    for group in groups:  # vLLM's CPU layout: [blocks, heads, block, 2 * head] per layer
        buf = torch.randn(LAYERS_PER_GROUP, blocks, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)
        kvs.append(recognise(dict(zip(group.layer_names, buf, strict=True)), isa="vec", kv_cache_dtype="auto"))
    cache = {"chunk_size": CHUNK, "l1_size_gb": pool_bytes / 2**30}
    settings = ConnectorSettings(mode="embedded", config={"cache": cache})
    return start_hybrid_worker(settings, kvs, groups, model="hybrid", name="bench", demote_superseded=demote)


def run_traffic(traffic: Traffic, pool_bytes: int, demote: bool) -> tuple[int, int]:
    """(hit tokens, prompt tokens) over the turns after each conversation's first."""
    hybrid = _worker(traffic, pool_bytes, demote)
    hit_tokens = asked = 0
    try:
        for n, prompt in enumerate(traffic.prompts()):
            hit = hybrid.lookups.lookup(prompt)
            found = hit.tokens if hit is not None else 0
            if hit is not None:
                hybrid.lookups.free_lock(hit.lock)
            if n >= traffic.conversations:
                hit_tokens += found
                asked += len(prompt)
            table = list(range(1, len(prompt) // BLOCK + 1))
            stores = [StoreSpec(str(n), prompt, table, found, group=g) for g in (0, 1)]
            hybrid.worker.start_stores(StepPlan(stores=stores))
            hybrid.worker.settle_windowed_stores()
            hybrid.worker.preempted([str(n)])  # waits for its stores
    finally:
        hybrid.worker.close()
        hybrid.lookups.close()
    return hit_tokens, asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-chunks", type=int, default=2)
    parser.add_argument("--window", type=int, default=64, help="the sliding window, in tokens")
    parser.add_argument("--pool-share", type=float, default=0.6, help="pool size / objects the traffic stores")
    args = parser.parse_args()
    traffic = Traffic(args.conversations, args.turns, args.turn_chunks, args.window)
    pool_bytes = int(traffic.stored_objects * args.pool_share) * OBJECT_BYTES
    print(
        f"{traffic.conversations} conversations x {traffic.turns} turns of {traffic.turn_chunks} chunks of {CHUNK}"
        f" tokens, window {traffic.window}; pool {pool_bytes >> 20} MiB = {args.pool_share:.0%} of the"
        f" {traffic.stored_objects} objects stored"
    )
    for demote in (False, True):
        hits, asked = run_traffic(traffic, pool_bytes, demote)
        name = "demoting superseded window chunks" if demote else "plain eviction order"
        print(f"{name:36s} hit tokens {hits:7d} of {asked:7d} prompt tokens ({hits / asked:.1%})")


if __name__ == "__main__":
    main()
