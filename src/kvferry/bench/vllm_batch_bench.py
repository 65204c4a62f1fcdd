"""`kvferry bench vllm-batch`: what kvferry's stores cost a busy vLLM on its CPU backend, with nothing to hit.

Needs the vllm extra. A random-weight Llama (no download) in three engines, one after another, each in a process of
its own: vLLM alone, with kvferry embedded, and with kvferry in a `kvferry server` (over its Unix socket). Each
runs --rounds rounds of --prompts unique prompts submitted at once (nothing is ever a hit: every full chunk is a
store), and reports each round's wall time and the process's CPU seconds; the ratios are to vLLM alone. A store
that held up vLLM's step would show as wall time at the same CPU seconds. With --events every engine publishes KV
events (vLLM's ZMQ publisher; the server its stream, which the connector follows), vLLM alone included: the ratios
are then kvferry's cost with its events against vLLM's with its own, and a kvferry engine whose published events
hold none of kvferry's stored blocks fails the run.
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive, require_vllm
from kvferry.bench.report import new_table
from kvferry.bench.server_process import ServerProcess
from kvferry.bench.vllm_child import VOCAB, connector_config, engine_env, llama_shape, run_child, write_shaped_llama
from kvferry.bench.vllm_events import kvferry_blocks_stored, vllm_events_config

MODES = ("vLLM alone", "embedded", "server")

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench vllm-batch                                 # 16 prompts of 1500 tokens at once, 3 rounds
  kvferry bench vllm-batch --prompts 8 --rounds 5 --json bench-out/vllm_batch.json
  kvferry bench vllm-batch --events                        # every engine publishes KV events
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=16, help="unique prompts per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of prompts (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="the model's layers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=512, help="model width, a multiple of 256 (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvferry's chunk, in tokens (default: %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES), help="which engines to run (default: all three)")
    parser.add_argument("--events", action="store_true", help="every engine publishes KV events (--kv-events-config)")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    positive(args, "prompt_tokens", "prompts", "rounds", "layers", "hidden", "chunk_size")
    llama_shape(args.layers, args.hidden)  # a width it cannot make is refused here
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        raise BenchError(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    require_vllm()


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    modes = [m for m in MODES if m in args.modes.split(",")]
    steps.expect(len(modes) * (3 + args.rounds))
    model: dict[str, Any] = dict(llama_shape(args.layers, args.hidden))
    workdir = Path(tempfile.mkdtemp(prefix="kvferry-batch-"))
    measured: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            payload = {"model_dir": str(workdir / "model"), "model": model, "mode": mode}
            names = ("prompt_tokens", "prompts", "rounds", "chunk_size", "events")
            payload |= {name: getattr(args, name) for name in names}
            server = None
            if mode == "server":
                socket = str(workdir / "kvferry.sock")
                server = ServerProcess(pool_gb=2, ipc_path=socket, chunk_size=args.chunk_size, events=args.events)
                payload["server_url"] = server.endpoint
                payload["events_url"] = ",".join(e for e in server.events_endpoints if e)
            try:
                measured[mode] = run_child("kvferry.bench.vllm_batch_bench:measure", payload, engine_env(), steps)
            finally:
                if server is not None:
                    server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = measured.get("vLLM alone")
    results = {}
    for mode, m in measured.items():
        wall = statistics.median(m["round_wall_s"])
        cpu = statistics.median(m["round_cpu_s"])
        results[mode] = {**m, "wall_s": wall, "cpu_s": cpu}
        if base is not None:
            results[mode]["wall_ratio"] = wall / statistics.median(base["round_wall_s"])
            results[mode]["cpu_ratio"] = cpu / statistics.median(base["round_cpu_s"])
    config = {"model": model, "dtype": "float32", "prompt_tokens": args.prompt_tokens, "prompts": args.prompts}
    config |= {"rounds": args.rounds, "chunk_size": args.chunk_size, "events": args.events}
    return Outcome(config, results, _show(args, results))


def _show(args: argparse.Namespace, results: dict[str, Any]) -> list[Any]:
    events = ", KV events on" if args.events else ""
    table = new_table(
        f"vLLM CPU backend, {args.prompts} unique {args.prompt_tokens}-token prompts at once, {args.rounds} rounds"
        f"{events} (medians of the rounds; ratios to vLLM alone)",
        ("engine", "wall s", "ratio", "CPU s (engine process)", "ratio", "tokens stored per round")
        + (("kvferry blocks announced",) if args.events else ()),
    )
    for mode, r in results.items():
        table.add_row(
            mode,
            f"{r['wall_s']:.2f}",
            f"{r.get('wall_ratio', float('nan')):.2f}",
            f"{r['cpu_s']:.2f}",
            f"{r.get('cpu_ratio', float('nan')):.2f}",
            str(r["tokens_stored_per_round"]),
            *([str(r["kvferry_blocks_announced"])] if args.events else []),
        )
    return [table]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(payload: dict[str, Any], step: Callable[[str], None]) -> dict[str, Any]:
    """In the engine's process (see `vllm_child`): write the model, start vLLM, time each round."""
    shape = payload["model"]
    write_shaped_llama(Path(payload["model_dir"]), shape, "float32")
    step(f"{payload['mode']}: model written")

    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    mode, tokens = payload["mode"], payload["prompt_tokens"]
    transfer = None
    if mode == "embedded":
        transfer = connector_config(config={"cache": {"chunk_size": payload["chunk_size"], "l1_size_gb": 2}})
    elif mode == "server":
        follow = {"events_url": payload["events_url"]} if payload["events"] else {}
        transfer = connector_config(mode="server", server_url=payload["server_url"], **follow)
    events = vllm_events_config() if payload["events"] else None
    llm = vllm.LLM(
        model=payload["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=tokens + 16,
        kv_transfer_config=transfer,
        kv_events_config=events,
    )
    step(f"{mode}: vLLM engine started")
    rng = random.Random(0)  # the same prompts in every mode
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(VOCAB) for _ in range(64)])], params, use_tqdm=False)
    step(f"{mode}: warm-up")
    walls, cpus = [], []
    for r in range(payload["rounds"]):
        prompts = [[rng.randrange(VOCAB) for _ in range(tokens)] for _ in range(payload["prompts"])]
        started, cpu = time.perf_counter(), _cpu_s()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        walls.append(time.perf_counter() - started)
        cpus.append(_cpu_s() - cpu)
        step(f"{mode}: round {r + 1}")
    chunks = tokens // payload["chunk_size"] * payload["prompts"] if transfer is not None else 0
    result = {"round_wall_s": walls, "round_cpu_s": cpus, "tokens_stored_per_round": chunks * payload["chunk_size"]}
    if events is not None:
        time.sleep(1.0)  # the last stores' events: published with the engine's next steps
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
        result["kvferry_blocks_announced"] = kvferry_blocks_stored(events.replay_endpoint)
        if transfer is not None and not result["kvferry_blocks_announced"]:
            raise BenchError(f"{mode}: vLLM published no BlockStored of kvferry's (--events)")
    llm.llm_engine.engine_core.shutdown()
    return result
