"""The cache server over loopback, as a script: `kvferry bench server` (kvferry/bench/server_bench.py), its flags,
and results also written to bench-out/bench_server.json unless --json names another file.

    python3 benchmarks/bench_server.py [--requests 2000] [--transfers 300] [--model qwen2.5-0.5b]
                                       [--device cpu|cuda] [--pool-gb 2] [--json PATH]
"""

import sys

from kvferry.bench.server_bench import main

if __name__ == "__main__":
    sys.exit(main())
