"""Runs one vLLM engine for the end-to-end tests (one process per engine, so engines never share state).

    python vllm_driver.py PHASE --model DIR --prompts FILE --out FILE [options]

PHASE
  reference   no connector: every prompt of the prompts file, greedy, then the conversation (see chat).
  embedded    the cache in this process (and a disk tier written on store, which the test reads objects back
              from): the main prompt as a miss, a hit, a hit whose loaded KV the test hook corrupts, and a hit
              whose load fails (vLLM must recompute it).
  isa         embedded, the main prompt as a miss then a hit (for --isa / --dtype variants).
  pool        embedded with a 4 MiB pool over a disk tier (8 objects of the test's fp32 KV): the batch of prompts,
              three times, as one batch; then two probes, each with what an index of the engine's KV events
              predicts for it.
  bad-chunk   embedded with a chunk size that is not a multiple of vLLM's block size: must refuse to start.
  server      a kvferry server at --server-url: the main prompt once (--runs: the named prompts, in order);
              with --events-url (the server's stream), vLLM publishes KV events and the report holds kvferry's.
  resilience  server mode with no server at start: misses; then the driver starts a server, waits for the
              connector to reconnect, stores, hits; then kills the server (SIGKILL) and goes on (misses).
  hold        server mode: the main prompt once, then writes --out and waits to be killed by the test.
  guard       embedded: the main prompt as a miss; then, the scheduler half's plans raising (an API drift while
              serving), the main prompt again (its hit was answered before the plan raised: the connector turns
              off and vLLM recomputes it), and once more (a miss).
  chat        embedded (or server mode with --server-url): a conversation, each turn the previous turn's prompt,
              its output and the next segment of the prompts file's "chat" list.

Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless --multiprocessing: then vLLM's engine
core and its CPU worker are two more processes, so the connector's scheduler half runs apart from its KV.
``--isa`` forces vLLM's CPU attention ISA (this process only); ``--tp N`` runs N tensor-parallel workers (processes
of their own). Writes a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # so vLLM can import the hooks module by name
sys.path.insert(1, str(HERE.parents[1]))  # the repository, for `tests.ports`

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}
CHUNK_SIZE = 256
MAX_TOKENS = 12


def force_isa(isa: str) -> None:
    """Make vLLM's CPU attention backend pick ``isa`` (an ISA the CPU lacks would crash the engine: the test
    skips those)."""
    from vllm.v1.attention.backends import cpu_attn

    cpu_attn._get_attn_isa = lambda *args, **kwargs: isa


def make_llm(model: str, extra: dict[str, Any] | None, dtype: str, tp: int = 1, kv_events: Any = None) -> Any:
    from vllm import LLM

    kv_transfer = None
    if extra is not None:
        kv_transfer = {
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        enable_prefix_caching=False,  # so a repeat is served by kvferry, not vLLM's own prefix cache
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv_transfer,
        tensor_parallel_size=tp,
        kv_events_config=kv_events,
    )


def kv_events_config() -> tuple[Any, str]:
    """``--kv-events-config`` publishing on loopback (vLLM's ZMQ publisher), and its replay endpoint."""
    from kvferry.bench.vllm_events import vllm_events_config

    config = vllm_events_config()
    return config, config.replay_endpoint


def kvferry_events(replay: str) -> list[dict[str, Any]]:
    """Every event vLLM's publisher sent so far that kvferry reported, as a router following the engine received
    them (`kvferry.bench.vllm_events.kvferry_events`)."""
    from vllm.distributed.kv_events import BlockStored

    from kvferry.bench import vllm_events

    events: list[dict[str, Any]] = []
    for event in vllm_events.kvferry_events(replay):
        stored = isinstance(event, BlockStored)
        events.append({
            "type": type(event).__name__, "hashes": [_hash(h) for h in event.block_hashes],
            "medium": event.medium, "block_size": event.block_size if stored else None,
            "parent": _hash(event.parent_block_hash) if stored else None,
            "tokens": list(event.token_ids) if stored else None,
        })  # fmt: skip
    return events


def _hash(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def probe_predictions(llm: Any, events: list[dict[str, Any]], probes: list[list[int]]) -> list[dict[str, Any]]:
    """What a router following the engine's events alone predicts for each probe prompt (its leading blocks held in
    some medium, in tokens), then the probe run: vLLM's count of the tokens the connector loaded for it. The
    probes' block hashes are the engine's own (its block hasher, in this process)."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import Request

    held: set[tuple[Any, str]] = set()
    for event in events:
        for h in event["hashes"]:
            (held.add if event["type"] == "BlockStored" else held.discard)((h, event["medium"]))
    blocks = {h for h, _ in held}
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    hasher = llm.llm_engine.engine_core.engine_core.request_block_hasher
    answers = []
    for tokens in probes:
        request = Request("probe", tokens, SamplingParams(), None, block_hasher=hasher)
        hashes = [_hash(maybe_convert_block_hash(h)) for h in request.block_hashes]
        leading = next((i for i, h in enumerate(hashes) if h not in blocks), len(hashes))
        (cached,) = generate(llm, [tokens])["cached"]
        answers.append({"predicted": leading * block_size, "cached": cached})
    return answers


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [int(o.num_cached_tokens or 0) for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
        "seconds": time.perf_counter() - started,
    }


def chat(llm: Any, segments: list[list[int]]) -> list[dict[str, Any]]:
    """One conversation: turn i's prompt is turn i-1's prompt and output, then ``segments[i]``."""
    runs: list[dict[str, Any]] = []
    history: list[int] = []
    for segment in segments:
        prompt = history + segment
        run = generate(llm, [prompt])
        runs.append({**run, "prompt_tokens": len(prompt)})
        history = prompt + run["tokens"][0]
    return runs


def connector_state(llm: Any) -> dict[str, Any]:
    """What the test checks after the runs (vLLM internals, in-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvferry.connector import backends

    # A request whose stores were running when it finished is released by the connector's report in a later
    # step: one short request (no lookup, no store) makes sure that step ran.
    generate(llm, [list(range(16))])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    side = scheduler.connector._scheduler
    worker = get_kv_transfer_group()._worker
    backend = backends.find(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    state: dict[str, Any] = {
        # The first run stored chunks, so vLLM kept its blocks until the connector reported the stores done; a
        # request still held after the later runs would be leaked blocks.
        "requests_held": len(scheduler.requests),
        "tracked": len(list(side.tracked_requests())) if side is not None else 0,
        "scheduler_locks": side.locks_held() if side is not None else 0,
        "scheduler_counters": vars(side.counters) if side is not None else {},
        "worker_counters": vars(worker.counters) if worker is not None else {},
        "failure_policy": llm.llm_engine.vllm_config.kv_transfer_config.kv_load_failure_policy,
    }
    if isinstance(backend, backends.EmbeddedBackend):
        ns = backend.namespace
        fields = ("model", "kv_dtype", "layout", "world_size", "rank", "salt", "kv_cache_dtype", "group", "split")
        state.update(
            namespace={name: getattr(ns, name) for name in fields},
            hash_algo=backend.engine.config.cache.hash_algo,
            chunk_size=backend.engine.chunk_size,
            cache_locks=backend.engine.stats()["locks"],
        )
    return state


def start_server(port: int, log_path: Path, chunk_size: int = CHUNK_SIZE) -> subprocess.Popen[bytes]:
    flags = ["--port", str(port), "--no-http", "--chunk-size", str(chunk_size), "--l1-size-gb", "0.25"]
    with log_path.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kvferry.cli", "server", *flags], stdout=log, stderr=log)


def wait_until(condition: Any, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


def resilience(llm_factory: Any, prompt: list[int], report: dict[str, Any], out_dir: Path) -> Any:
    from kvferry.connector import backends
    from tests.ports import port_for_a_restart

    port = port_for_a_restart()  # the engine's client connects long before the server listens
    url = f"tcp://127.0.0.1:{port}"
    started = time.perf_counter()
    llm = llm_factory({"mode": "server", "server_url": url, "timeout_s": 2.0})
    report["engine_start_seconds"] = time.perf_counter() - started
    link = backends.find(llm.llm_engine.vllm_config.kv_transfer_config.engine_id).link
    runs = [generate(llm, [prompt])]  # no server: a miss
    server = start_server(port, out_dir / "resilience-server.log")
    try:
        report["reconnect_seconds"] = wait_until(lambda: link.up, 60, "the connector did not reconnect")
        runs.append(generate(llm, [prompt]))  # stores
        runs.append(generate(llm, [prompt]))  # hits
    finally:
        server.kill()
        server.wait()
    started = time.perf_counter()
    runs.extend(generate(llm, [prompt]) for _ in range(5))  # the server is gone mid-run
    report["after_kill_seconds"] = time.perf_counter() - started
    report["runs"] = runs
    return llm


def time_connector_shutdowns(log: Path) -> None:
    """Append how long each `KvferryConnector.shutdown` takes to `log`: the test bounds the connector's part of an
    engine's exit apart from vLLM's own teardown (seconds on a loaded machine)."""
    from kvferry.integrations.vllm import KvferryConnector

    shutdown = KvferryConnector.shutdown

    def timed(self: Any) -> None:
        started = time.perf_counter()
        try:
            shutdown(self)
        finally:
            with log.open("a") as f:
                f.write(f"{time.perf_counter() - started:.3f}\n")

    KvferryConnector.shutdown = timed  # type: ignore[method-assign]


def write_report(out: Path, report: dict[str, Any]) -> None:
    """Whole or not at all: a test waiting for the file (the hold phase) reads it as soon as it exists."""
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    phases = ["reference", "embedded", "isa", "pool", "bad-chunk", "server", "resilience", "hold", "chat", "guard"]
    parser.add_argument("phase", choices=phases)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tier-dir")
    parser.add_argument("--server-url")
    parser.add_argument("--multiprocessing", action="store_true")
    parser.add_argument("--isa", choices=["vec", "vec16", "amx"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--runs", help="server phase: comma-separated prompt names to run in turn")
    parser.add_argument("--events-url", help="server phase: the server's KV event stream (vLLM publishes events)")
    parser.add_argument("--direct-loads", action="store_true", help="server phase: loads copied out of its pool here")
    args = parser.parse_args()
    if args.phase == "hold":
        # Ctrl-C as from a terminal: a process started in the background by a non-interactive shell (CI, nohup)
        # inherits SIGINT ignored, and Python then never installs its handler: the engine would not hear it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        time_connector_shutdowns(Path(args.out).with_suffix(".shutdown"))
    if args.tp > 1:  # a CPU per rank for its OpenMP threads
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(args.tp))
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    # In-process engines start faster and let the test hooks reach the worker.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocessing else "0"
    if args.isa:
        force_isa(args.isa)
    prompts = json.loads(Path(args.prompts).read_text())
    main_prompt = prompts["main"]
    out = Path(args.out)
    report: dict[str, Any] = {"phase": args.phase}

    events, replay = kv_events_config() if args.phase == "pool" or args.events_url else (None, "")

    def llm_factory(extra: dict[str, Any] | None) -> Any:
        return make_llm(args.model, extra, args.dtype, args.tp, events)

    embedded = {
        "mode": "embedded",
        "config": {
            "cache": {"chunk_size": CHUNK_SIZE, "l1_size_gb": 0.25, "tier_write": "on_store"},
            "tiers": [f"disk:{args.tier_dir}?size=1GB"],
        },
        "after_load_hook": "vllm_hooks:corrupt_loaded_kv",
    }
    if args.phase == "bad-chunk":
        try:
            llm_factory({**embedded, "config": {"cache": {"chunk_size": 200}}})
            report["error"] = None
        except Exception:
            report["error"] = traceback.format_exc()
        write_report(out, report)
        os._exit(0)
    if args.phase == "resilience":
        llm = resilience(llm_factory, main_prompt, report, out.parent)
    elif args.phase == "guard":
        llm = llm_factory({**embedded, "after_load_hook": None})
        report["runs"] = [generate(llm, [main_prompt])]
        side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler

        def drifted(*args: Any, **kwargs: Any) -> Any:
            raise AttributeError("'SchedulerOutput' object has no attribute 'injected_drift'")

        side.build_plan = drifted
        report["runs"] += [generate(llm, [main_prompt]) for _ in range(2)]
    else:
        extra = {
            "reference": None,
            "embedded": embedded,
            "isa": embedded,
            "pool": {
                "mode": "embedded",
                "config": {
                    "cache": {"chunk_size": CHUNK_SIZE, "l1_size_gb": 4 / 1024},  # 4 MiB: 8 fp32 chunk objects
                    "tiers": [f"disk:{args.tier_dir}?size=1GB"],
                },
            },
            "server": {"mode": "server", "server_url": args.server_url}
            | ({"events_url": args.events_url} if args.events_url else {})
            | ({"direct_loads": True} if args.direct_loads else {}),
            "hold": {"mode": "server", "server_url": args.server_url},
            "chat": (
                {"mode": "server", "server_url": args.server_url}
                if args.server_url
                else {"mode": "embedded", "config": {"cache": {"chunk_size": CHUNK_SIZE, "l1_size_gb": 0.25}}}
            ),
        }[args.phase]
        started = time.perf_counter()
        llm = llm_factory(extra)
        report["engine_start_seconds"] = time.perf_counter() - started
        batch = prompts["batch"] if args.phase == "pool" else [main_prompt]
        repeats = {"reference": 1, "server": 1, "hold": 1, "isa": 2, "pool": 3, "embedded": 2, "chat": 1}[args.phase]
        if args.phase == "reference":
            batch = [main_prompt, *prompts["batch"]]
        if args.runs:
            report["runs"] = [generate(llm, [prompts[name]]) for name in args.runs.split(",")]
        elif args.phase == "chat":
            report["runs"] = chat(llm, prompts["chat"])
        else:
            report["runs"] = [generate(llm, batch) for _ in range(repeats)]
        if args.phase == "reference" and "chat" in prompts:
            report["chat"] = chat(llm, prompts["chat"])
    if args.phase == "embedded":
        import vllm_hooks

        vllm_hooks.CORRUPT["on"] = True
        report["runs"].append(generate(llm, [main_prompt]))
        vllm_hooks.CORRUPT["on"] = False
        report["corrupt_calls"] = vllm_hooks.CORRUPT["calls"]
        with vllm_hooks.failing_loads(llm):
            report["runs"].append(generate(llm, [main_prompt]))
    if args.phase == "guard":  # the requests vLLM still holds after one more step (none: no blocks leaked)
        generate(llm, [list(range(16))])
        report["requests_held"] = len(llm.llm_engine.engine_core.engine_core.scheduler.requests)
    if args.phase == "hold":
        write_report(out, report)
        while True:  # the test ends this process with a signal
            time.sleep(1)
    in_process = not args.multiprocessing and args.tp == 1  # the worker is in this process
    if in_process and args.phase not in ("reference", "guard"):
        report.update(connector_state(llm))
    if events is not None:
        report["kv_events"] = kvferry_events(replay)
    if args.phase == "pool":  # a stored prompt continued, and one that leaves it inside its second chunk
        first = prompts["batch"][0]
        probes = [first + list(range(7, 57)), first[:400] + list(range(7, 207))]
        report["probes"] = probe_predictions(llm, report["kv_events"], probes)
    # Shut the engine down (the connector waits for its loads and stores and flushes its tiers), then exit
    # without running interpreter teardown, which vLLM's background threads can stall.
    llm.llm_engine.engine_core.shutdown()
    write_report(out, report)
    os._exit(0)


if __name__ == "__main__":
    main()
