"""Host pool throughput, as a script: `kvferry bench pool` (kvferry/bench/pool_bench.py), its flags, and results also
written to bench-out/bench_pool.json unless --json names another file.

    python3 benchmarks/bench_pool.py [--ops 200000] [--capacity-mib 1024] [--json PATH]
"""

import sys

from kvferry.bench.pool_bench import main

if __name__ == "__main__":
    sys.exit(main())
