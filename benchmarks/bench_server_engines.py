"""Several engine processes on one cache server, as a script: `kvferry bench server-engines`
(kvferry/bench/server_engines_bench.py), its flags, and results also written to bench-out/bench_server_engines.json
unless --json names another file.

    python3 benchmarks/bench_server_engines.py [--engines 4] [--rounds 100] [--think-ms 2] [--device cpu|cuda]
"""

import sys

from kvferry.bench.server_engines_bench import main

if __name__ == "__main__":
    sys.exit(main())
