"""Question: what does a `transfer` call without `geometry=` pay to find the engine's geometry?

Answer (2026-12-01, CPU machine, d277ccc): `describe` takes 240 us for llama3-8b's 32 layer tensors; recognising
them by fingerprint (`GeometryCache.get`) 17-19 us (qwen2.5-0.5b's 24: 13-17 us).

    PYTHONPATH=src python benchmarks/experiments/geometry_fingerprint.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import MODELS, make_paged
from kvferry.transfer.geometry_cache import GeometryCache

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def per_call_us(call: Callable[[], object], n: int) -> float:
    for _ in range(100):
        call()
    t = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    cache = GeometryCache()
    for model in ("llama3-8b", "qwen2.5-0.5b"):
        paged = make_paged(FMT, MODELS[model], 64, 16)
        described = per_call_us(lambda p=paged: describe(FMT, p), 500)
        recognised = per_call_us(lambda p=paged: cache.get(FMT, p, None), 5000)
        print(f"{model}: describe {described:.0f} us, fingerprint {recognised:.1f} us per call")


if __name__ == "__main__":
    main()
