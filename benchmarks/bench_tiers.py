"""Tiers against plain I/O, as a script: `kvferry bench tiers` (kvferry/bench/tiers_bench.py), its flags, and results
also written to bench-out/bench_tiers.json unless --json names another file.

    python3 benchmarks/bench_tiers.py [--dir DIR] [--total-mib 256] [--reps 3] [--redis-url URL]
                                      [--objects llama3-8b,qwen2.5-0.5b] [--json PATH]
"""

import sys

from kvferry.bench.tiers_bench import main

if __name__ == "__main__":
    sys.exit(main())
