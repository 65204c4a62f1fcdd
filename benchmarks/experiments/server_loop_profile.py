"""Question: with several engines at once, where does the server's socket thread (the one that reads every request
and runs LOOKUPs and the start of every GPU transfer) spend its time?

Runs a server in a child process with cProfile on its socket thread only, puts `kvferry bench server-engines`' engine
processes on it at once (each its own KV and session: rounds of a 16-chunk LOOKUP, a one-chunk STORE and RETRIEVE,
then a pause), stops it, and prints the thread's time idle in its poll and its hottest functions (cProfile roughly
doubles the cost of Python calls: the shares count, not the microseconds).

    PYTHONPATH=src python3 benchmarks/experiments/server_loop_profile.py [--engines 8] [--device cuda]
        [--model qwen2.5-0.5b] [--rounds 300] [--think-ms 2] [--ipc]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import pstats
import sys
import tempfile


def serve(out: str, argv: list[str]) -> int:
    """The server, its socket thread profiled; the profile goes to `out` when the loop ends."""
    import cProfile

    from kvferry.server import server
    from kvferry.server.app import run_from_command_line

    inner = server.KvferryServer._loop

    def loop(self: server.KvferryServer, *args: object) -> None:
        profile = cProfile.Profile()  # enabled on this thread only
        profile.enable()
        try:
            inner(self, *args)  # type: ignore[arg-type]
        finally:
            profile.disable()
            profile.dump_stats(out)

    server.KvferryServer._loop = loop  # type: ignore[method-assign]
    return run_from_command_line(argv)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--think-ms", type=float, default=2.0)
    parser.add_argument("--ipc", action="store_true")
    args = parser.parse_args()

    from kvferry.bench import server_bench, server_engines_bench

    stats_file = tempfile.mktemp(suffix=".prof")
    socket_dir = tempfile.mkdtemp(prefix="kvf-")

    # ServerProcess runs `python -m kvferry.server ...`; run this file's serve() with the same flags instead.
    original_popen = server_bench.subprocess.Popen

    def popen(cmd: list[str], **kwargs: object) -> object:
        if cmd[1:3] == ["-m", "kvferry.server"]:
            cmd = [cmd[0], __file__, "--serve", stats_file, *cmd[3:]]
        return original_popen(cmd, **kwargs)

    server_bench.subprocess.Popen = popen  # type: ignore[assignment]
    ipc_path = os.path.join(socket_dir, "server.sock") if args.ipc else None
    server = server_bench.ServerProcess(pool_gb=4.0, ipc_path=ipc_path)
    server_bench.subprocess.Popen = original_popen  # type: ignore[assignment]
    try:
        ctx = mp.get_context("spawn")
        engines = server_engines_bench._run_engines(ctx, server.endpoint, args, args.engines)
    finally:
        server.stop()
    rounds = sum(len(engine["lookup"]) for engine in engines)
    stats = pstats.Stats(stats_file)
    total = stats.total_tt  # type: ignore[attr-defined]
    entries = stats.stats.items()  # type: ignore[attr-defined]
    idle = sum(ct for (file, _, name), (_, _, _, ct, _) in entries if name == "poll" and "zmq" in file)
    busy = total - idle
    print(f"{args.engines} engines x {args.rounds} rounds of 3 requests: the socket thread busy {busy:.2f} s (outside "
          f"its poll), {busy / (3 * rounds) * 1e6:.0f} us a request under the profiler")  # fmt: skip
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(stats_file, stream=text).sort_stats(key).print_stats(28)
        print(text.getvalue().split("\n", 6)[-1])
    os.unlink(stats_file)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], sys.argv[3:]))
    main()
