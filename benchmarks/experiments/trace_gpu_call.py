"""Question: where does the wall time of a GPU request go on the GPU's timeline (the CPU before the first GPU
operation, the gathers, the DMAs), against a memcpy of the same bytes?

Answer (2026-11-29, H200 #11 and #16): the copy engine runs a request back to back at the memcpy's rate (qwen2.5-0.5b,
32 scattered chunks: copy span 1833 us against the memcpy's 1823, 0.995 on the GPU; one llama3-8b chunk's first
gather 14 us, then the DMAs); what the wall clock adds is the CPU time before the first GPU operation
(docs/benchmark_log.md, 2026-11-29).

Run on the GPU machine:  PYTHONPATH=src python3 benchmarks/experiments/trace_gpu_call.py --out $OUT/anatomy.json

One chunk (llama3-8b 32 MiB, qwen2.5-0.5b 3 MiB; `--chunks N` for N), both directions, for engine variants: wall time of
call-to-completion against a same-run single pinned memcpy (medians, alternating), then a torch.profiler (CUPTI)
timeline of a few calls: each kernel / memcpy relative to the Python call, and when the last one ends (the
profiler slows the CPU side). Chrome traces land next to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvferry import Direction
from kvferry.bench.gpu_transfer_bench import F, Setup
from kvferry.transfer.gpu_engine import EngineConfig, MiB, TransferEngine

VARIANTS = {
    "default": EngineConfig(),
    "slices 8 MiB": EngineConfig(slice_bytes=8 * MiB),
    "one DMA per object": EngineConfig(batch_dma=False),
}


def wall_us(fn, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def timeline(trace: Path, label: str) -> list[dict]:
    """Per annotated call: GPU operations relative to the call's start (us)."""
    events = json.loads(trace.read_text())["traceEvents"]
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(label)),
                   key=lambda e: e["ts"])  # fmt: skip
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")),
                 key=lambda e: e["ts"])  # fmt: skip
    out = []
    for call in calls:
        t0, t1 = call["ts"], call["ts"] + call["dur"]  # a call returns once its bytes have moved
        ops = [g for g in gpu if t0 <= g["ts"] < t1]
        if not ops:
            continue
        out.append(
            dict(
                cpu_call_us=call["dur"],
                first_gpu_op_us=ops[0]["ts"] - t0,
                last_gpu_end_us=max(g["ts"] + g["dur"] for g in ops) - t0,
                ops=[(g["cat"], g["name"][:40], round(g["ts"] - t0, 1), round(g["dur"], 1)) for g in ops],
            )
        )
    return out


def one_chunk(s: Setup, model: str, d: Direction, engines: dict, reps: int, out: Path, result: dict) -> None:
    dev = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)

    def memcpy() -> None:
        (host.copy_(dev, non_blocking=True) if d is Direction.D2H else dev.copy_(host, non_blocking=True))
        torch.cuda.synchronize()

    modes = ("staged", "zero_copy") if s.nbytes < 8 * MiB else ("staged",)
    cases = {f"{name} {mode}": (eng, mode) for name, eng in engines.items() for mode in modes}
    samples: dict[str, list[float]] = {"memcpy": []}
    for name, (eng, mode) in cases.items():
        s.run(d, eng, mode)  # warm-up (compiles)
        samples[name] = []
    for _ in range(reps):  # alternate: every case sees the same machine
        samples["memcpy"] += wall_us(memcpy, 1)
        for name, (eng, mode) in cases.items():
            samples[name] += wall_us(lambda eng=eng, mode=mode: s.run(d, eng, mode), 1)
    ceiling = statistics.median(samples["memcpy"])
    for name, values in samples.items():
        med = statistics.median(values)
        row = dict(model=model, direction=d.name, case=name, us=med, ratio=ceiling / med, gbps=s.nbytes / med / 1e3)
        result["onechunk"].append(row)
        print(f"{model:14s} {d.name} {name:38s} {med:8.1f} us  ratio {ceiling / med:.3f}", flush=True)
    trace = out.with_name(f"trace_{model}_{len(s.objects)}_{d.name}.json")
    traced = [c for c in cases.items() if not c[0].startswith("slices")][:2]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, (eng, mode) in traced:
            for _ in range(3):
                with record_function(f"call {name}"):
                    s.run(d, eng, mode)
                time.sleep(0.002)
        for _ in range(3):
            with record_function("call memcpy"):
                memcpy()
            time.sleep(0.002)
    prof.export_chrome_trace(str(trace))
    for name in [*(n for n, _ in traced), "memcpy"]:
        tl = timeline(trace, f"call {name}")
        result["timelines"][f"{model} {d.name} {name}"] = tl
        for t in tl[-1:]:
            print(f"   {name}: call {t['cpu_call_us']:.0f} us, first GPU op at {t['first_gpu_op_us']:.0f}, "
                  f"last ends at {t['last_gpu_end_us']:.0f}: {t['ops']}", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--chunks", type=int, default=1, help="chunks per request (a bulk request's anatomy)")
    ap.add_argument("--models", default="llama3-8b,qwen2.5-0.5b")
    ap.add_argument("--format", default=F.NL_X_TWO_NB_BS_NH_HS.name, help="engine layout (an EngineKVFormat name)")
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "onechunk": [], "timelines": {}}
    engines = {name: TransferEngine("cuda", cfg) for name, cfg in VARIANTS.items()}
    for model in args.models.split(","):
        s = Setup(model, F[args.format], args.chunks)
        for d in (Direction.D2H, Direction.H2D):
            one_chunk(s, model, d, engines, args.reps, args.out, result)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
