"""`kvferry bench vllm-chat`: multi-turn conversations on vLLM's CPU backend, with and without kvferry.

Needs the vllm extra. A random-weight Llama (no download) in two engines, one after the other, each in a process of
its own: vLLM alone, and vLLM with kvferry embedded (over a disk tier written on store, to measure a tier's bytes
too). Both keep vLLM's own prefix cache on but give it too few blocks to hold the conversations (about two of their
longest prompts), so what one turn computed is gone from vLLM by the time its conversation comes back. Turn 1 of
every conversation is a random prompt; turn t+1 is turn t's prompt, its --generated tokens and --new-tokens more.
Conversations take turns (turn 1 of each, then turn 2 of each, ...). A turn's time to first token is the wall time
of a `generate` with `max_tokens=1`; then the same prompt generates the turn's answer (its prefill then hits, in
either engine). Reported: per turn, the median TTFT over the conversations and its speed-up, the tokens vLLM
reported cached against those the turn could reuse (the previous turn's prompt and answer), and the bytes per
stored token in kvferry's pool and in its disk tier, with the share of tail objects (partial last chunks).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvferry.bench.harness import Outcome, Steps, add_json_argument, description_of, positive, require_vllm
from kvferry.bench.report import new_table
from kvferry.bench.vllm_child import VOCAB, connector_config, engine_env, llama_shape, run_child, write_shaped_llama

MODES = ("vLLM alone", "kvferry")
VLLM_BLOCK = 128  # vLLM's CPU backend's default block size
DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench vllm-chat                                  # 4 conversations x 4 turns, a 6-layer model
  kvferry bench vllm-chat --conversations 6 --json bench-out/vllm_chat.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=4, help="conversations (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default: %(default)s)")
    parser.add_argument("--first-tokens", type=int, default=1000, help="turn 1's prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=300, help="new tokens a turn (default: %(default)s)")
    parser.add_argument("--generated", type=int, default=16, help="tokens a turn generates (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="the model's layers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=512, help="model width, a multiple of 256 (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvferry's chunk, in tokens (default: %(default)s)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "conversations", "turns", "first_tokens", "new_tokens", "generated", "layers", "hidden")
    positive(args, "chunk_size")
    llama_shape(args.layers, args.hidden)  # a width it cannot make is refused here
    require_vllm()


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(len(MODES) * (3 + args.turns))
    model: dict[str, Any] = dict(llama_shape(args.layers, args.hidden))
    workdir = Path(tempfile.mkdtemp(prefix="kvferry-chat-"))
    names = ("conversations", "turns", "first_tokens", "new_tokens", "generated", "chunk_size")
    measured: dict[str, dict[str, Any]] = {}
    try:
        for mode in MODES:
            payload = {"model_dir": str(workdir / "model"), "model": model, "mode": mode, "tier": str(workdir / "tier")}
            payload |= {name: getattr(args, name) for name in names}
            measured[mode] = run_child("kvferry.bench.vllm_chat_bench:measure", payload, engine_env(), steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    alone, kvferry = measured["vLLM alone"], measured["kvferry"]
    turns = []
    for t in range(1, args.turns):
        base = statistics.median(r[t]["ttft_s"] for r in alone["turns"])
        with_kvferry = statistics.median(r[t]["ttft_s"] for r in kvferry["turns"])
        turns.append(
            {
                "turn": t + 1,
                "ttft_alone_s": base,
                "ttft_kvferry_s": with_kvferry,
                "speedup": base / with_kvferry,
                "cached_alone": sum(r[t]["cached"] for r in alone["turns"]),
                "cached_kvferry": sum(r[t]["cached"] for r in kvferry["turns"]),
                "reusable": sum(r[t]["reusable"] for r in kvferry["turns"]),
                "prompt_tokens": kvferry["turns"][0][t]["prompt_tokens"],
            }
        )
    model |= {"head_dim": 64, "parameters": kvferry["parameters"]}
    results = {"turns": turns, "storage": kvferry["storage"], "engine_start_s": kvferry["engine_start_s"]}
    config = {"model": model, "dtype": "float32", "vllm_blocks": kvferry["vllm_blocks"]}
    config |= {name: getattr(args, name) for name in names}
    return Outcome(config, results, _show(args, results))


def _show(args: argparse.Namespace, results: dict[str, Any]) -> list[Any]:
    table = new_table(
        f"vLLM CPU, {args.conversations} conversations x {args.turns} turns (+{args.generated} generated, "
        f"+{args.new_tokens} new a turn), {args.layers}-layer random Llama",
        ("turn", "prompt tokens", "TTFT alone s", "TTFT kvferry s", "speed-up", "cached / reusable tokens"),
    )
    for r in results["turns"]:
        table.add_row(
            str(r["turn"]),
            str(r["prompt_tokens"]),
            f"{r['ttft_alone_s']:.3f}",
            f"{r['ttft_kvferry_s']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{r['cached_kvferry']} / {r['reusable']} (alone {r['cached_alone']})",
        )
    s = results["storage"]
    line = (
        f"kvferry pool: {s['pool_bytes_per_token']:.0f} B per stored token (KV: {s['kv_bytes_per_token']} B); per "
        f"full-chunk token {s['pool_bytes_per_chunk_token']:.0f} B (+{s['pool_growth']:.1%}; tails: "
        f"{s['tail_tokens']} tokens, {s['tail_share']:.1%} of the chunks'); disk tier: "
        f"{s['tier_bytes_per_token']:.0f} B per stored token (chunks only)"
    )
    return [table, line]


def _generate(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return time.perf_counter() - started, out


def measure(payload: dict[str, Any], step: Callable[[str], None]) -> dict[str, Any]:
    """In the engine's process (see `vllm_child`): write the model, start vLLM, then run the conversations."""
    parameters = write_shaped_llama(Path(payload["model_dir"]), payload["model"], "float32")
    step("model written")
    import vllm

    from kvferry.connector import backends

    turns, generated, new = payload["turns"], payload["generated"], payload["new_tokens"]
    longest = payload["first_tokens"] + (turns - 1) * (generated + new) + generated
    blocks = 2 * -(-longest // VLLM_BLOCK)  # about two of the longest prompts: fewer than the conversations
    transfer = None
    if payload["mode"] == "kvferry":
        cache = {"chunk_size": payload["chunk_size"], "l1_size_gb": 1, "tier_write": "on_store"}
        transfer = connector_config(config={"cache": cache, "tiers": [f"disk:{payload['tier']}?size=4GB"]})
    started = time.perf_counter()
    llm = vllm.LLM(
        model=payload["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=longest + 16,
        max_num_batched_tokens=longest + 16,  # a whole prompt in one prefill step
        num_gpu_blocks_override=blocks,
        kv_transfer_config=transfer,
    )
    engine_start_s = time.perf_counter() - started
    step("vLLM engine started")
    rng = random.Random(0)
    _generate(llm, [rng.randrange(VOCAB) for _ in range(64)], 1)  # warm-up: first-call costs out of the numbers
    step("warm-up")
    histories: list[list[int]] = [[] for _ in range(payload["conversations"])]
    rows: list[list[dict[str, Any]]] = [[] for _ in histories]
    for t in range(turns):
        for c, history in enumerate(histories):
            prompt = history + [rng.randrange(VOCAB) for _ in range(payload["first_tokens"] if t == 0 else new)]
            ttft_s, first = _generate(llm, prompt, 1)
            _, answer = _generate(llm, prompt, generated)
            time.sleep(0.2)  # the answer's store (at its finish) lands before the next turn's lookup
            rows[c].append(
                {
                    "ttft_s": ttft_s,
                    "cached": int(first.num_cached_tokens or 0),
                    "reusable": len(history),
                    "prompt_tokens": len(prompt),
                }
            )
            histories[c] = prompt + list(answer.outputs[0].token_ids)
        step(f"turn {t + 1}")
    storage = None
    transfer_config = llm.llm_engine.vllm_config.kv_transfer_config
    if transfer_config is not None:
        backend = backends.find(str(transfer_config.engine_id))
        assert isinstance(backend, backends.EmbeddedBackend)  # configured so, in this process
        storage = _storage(backend.engine, backend.namespace.layout, Path(payload["tier"]))
    llm.llm_engine.engine_core.shutdown()
    return {
        "parameters": parameters,
        "engine_start_s": engine_start_s,
        "vllm_blocks": blocks,
        "turns": rows,
        "storage": storage,
    }


def _storage(engine: Any, layout: str, tier_dir: Path) -> dict[str, Any]:
    """Bytes per stored token in the pool (chunks and tails) and in the disk tier (chunks only); ``layout`` is the
    key space's object layout, `kind:kv_size x layers x chunk x width`."""
    stats = engine.stats()
    geometry = layout.split(":")[1].split("x")
    kv_bytes_per_token = int(geometry[0]) * int(geometry[1]) * int(geometry[3]) * 4  # fp32
    tokens = stats["stored_bytes"] // kv_bytes_per_token
    tails = stats["stored_tail_tokens"]
    deadline = time.monotonic() + 30
    on_disk = 0
    while time.monotonic() < deadline:  # tier writes run in the background
        on_disk = sum(f.stat().st_size for f in tier_dir.rglob("*.kvf"))
        if on_disk >= (tokens - tails) * kv_bytes_per_token:
            break
        time.sleep(0.2)
    return {
        "kv_bytes_per_token": kv_bytes_per_token,
        "stored_tokens": tokens,
        "tail_tokens": tails,
        "tail_share": tails / max(1, tokens - tails),  # what tails add to the chunks' tokens
        "pool_used_bytes": stats["pool_used_bytes"],
        "pool_bytes_per_token": stats["pool_used_bytes"] / max(1, tokens),
        # What the pool spends per token a chunks-only cache would hold: the growth tails cost
        "pool_bytes_per_chunk_token": stats["pool_used_bytes"] / max(1, tokens - tails),
        "pool_growth": stats["pool_used_bytes"] / max(1, (tokens - tails) * kv_bytes_per_token) - 1,
        "evictions": stats["evictions"],
        "tier_bytes": on_disk,
        "tier_bytes_per_token": on_disk / max(1, tokens - tails),
    }
