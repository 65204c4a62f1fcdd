"""Cache engine overheads, as a script: `kvferry bench cache` (kvferry/bench/cache_bench.py), its flags, and results
also written to bench-out/bench_cache.json unless --json names another file.

    python3 benchmarks/bench_cache.py [--repeats 50] [--json PATH]
"""

import sys

from kvferry.bench.cache_bench import main

if __name__ == "__main__":
    sys.exit(main())
