"""`kvferry bench sglang-gpu`: the SGLang unified-cache linker on a GPU, over SGLang's device KV pools as its
allocation code builds them, beside a plain memcpy of the same bytes.

The pools are the recorded ones of `kvferry.bench.sglang_pools` (Llama-3-8B's MHA K and V, DeepSeek-V3's MLA latent;
64-token pages), replayed on the GPU and seen by the linker's own code. Each mode (embedded: the cache in this
process; server: a ``kvferry server`` holding the pool, the KV registered by CUDA IPC, over loopback TCP and over its
Unix socket) stores a prefix of pages from pages scattered over the pool and loads it into other scattered pages, as
SGLang's unified radix cache drives a linker (`kvferry.bench.sglang_linker_path`), beside a pinned memcpy of the same
bytes timed alternately (`kvferry.bench.rounds`). A store is timed by the host's clock from the call to SGLang's poll
seeing it done. A load is timed as SGLang's forward sees it: by the GPU's clock (`timing.gpu_span`), from the call to
the point where the forward's stream may go on (in process, a wait on the GPU; through a server, the host's wait
returned), and its memcpy likewise to the end of the copy on the GPU. Every load of the timed rounds and the warm-up
is checked outside its timed region (each destination page holding its source page's bytes, every other byte
unchanged); a failed check ends the run with an error (exit status 1).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from typing import Any

from kvferry.bench.harness import Outcome, Steps, add_json_argument, description_of, positive, require_cuda
from kvferry.bench.report import new_table
from kvferry.bench.rounds import measure, stray_ceilings
from kvferry.bench.server_process import ServerProcess, add_busy_poll_argument, check_busy_poll, mps_line
from kvferry.bench.sglang_linker_path import LinkerPath
from kvferry.bench.sglang_pools import BENCH_TAG, case_of, load_fixtures
from kvferry.bench.timing import PinnedCopy, gpu_span, synchronize, wake_up_line, wake_up_us
from kvferry.connector.settings import ConnectorSettings

POOL_GB = 4.0
PAGES = 64  # a 4096-token prefix in 64-token pages
DEVICE = "cuda"
CASES_TAG = BENCH_TAG
MODES = ["embedded", "server tcp", "server ipc"]
DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench sglang-gpu                                # on a machine with CUDA
  kvferry bench sglang-gpu --repeats 15 --json bench-out/sglang_gpu.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed rounds per pool and mode (medians), after a warm-up round"
    )
    parser.add_argument("--no-server", action="store_true", help="embedded mode only")
    parser.add_argument(
        "--layer-groups", type=int, default=1, help="loads handed over in this many groups of layers (the linker's "
        "layer_groups); the table then says when the first layers landed",
    )  # fmt: skip
    add_busy_poll_argument(parser)
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    check_busy_poll(args)
    positive(args, "repeats")
    positive(args, "layer_groups")
    require_cuda("this benchmark")


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    fixtures = [f for f in load_fixtures() if f["case"]["tag"] == CASES_TAG]
    modes = ["embedded"] if args.no_server else MODES
    steps.expect(len(fixtures) * len(modes))
    rows: list[dict[str, Any]] = []
    wake = wake_up_us()  # before any server: nothing else running
    for mode in modes:
        for fixture in fixtures:  # a server per pool: its chunk size is the pool's page size
            page = case_of(fixture).page_size
            ipc = tempfile.TemporaryDirectory(prefix="kvferry-bench-") if mode == "server ipc" else None
            ipc_path = None if ipc is None else f"{ipc.name}/server.sock"
            server = None
            if mode != "embedded":
                server = ServerProcess(POOL_GB, args.busy_poll_us, chunk_size=page, ipc_path=ipc_path)
            try:
                settings = _settings(mode, page, None if server is None else server.endpoint)
                path = LinkerPath(fixture, settings, DEVICE, PAGES, args.layer_groups)
                try:
                    copy = PinnedCopy(path.nbytes)
                    row = measure(path, copy, None, args.repeats, settle=synchronize, span=gpu_span,
                                  h2d_enqueue=functools.partial(copy.start, False))  # fmt: skip
                    first = statistics.median(path.first_layer_s[1:])  # the timed rounds' (not the warm-up's)
                    rows.append({"mode": mode, "pool": path.case.name, **row, "first_layers_us": first * 1e6})
                finally:
                    path.close()
                steps.done(f"{mode}: {path.case.name}")
            finally:
                if server is not None:
                    server.stop()
                if ipc is not None:
                    ipc.cleanup()
    config = {
        "pages": PAGES,
        "repeats": args.repeats,
        "pool_gb": POOL_GB,
        "layer_groups": args.layer_groups,
        "busy_poll_us": args.busy_poll_us,
    }
    strayed = stray_ceilings(rows, lambda row: f"{row['mode']} {row['pool']}")
    wake_line = wake_up_line(wake, "; a load pays one more: SGLang's forward waits", args.busy_poll_us)
    shown = [*_show(rows, args.layer_groups), *strayed, wake_line, mps_line()]
    return Outcome(config, {"rows": rows, "wake_up_us": wake}, shown, device="cuda")


def _settings(mode: str, page: int, endpoint: str | None) -> ConnectorSettings:
    if mode != "embedded":
        return ConnectorSettings(mode="server", server_url=str(endpoint), timeout_s=30.0)
    return ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": page, "l1_size_gb": POOL_GB}})


def _show(rows: list[dict[str, Any]], groups: int) -> list[Any]:
    first = ("first layers us",) if groups > 1 else ()
    table = new_table(
        f"a {PAGES}-page prefix through kvferry's SGLang linker, against a same-run pinned memcpy (ratio: the memcpy's"
        " time over the transfer's; a load to where the forward's stream may go on, by the GPU's clock; every load"
        " checked)"
        + (f"; loads in {groups} groups of layers, the first landed after 'first layers us'" if groups > 1 else ""),
        ("mode", "SGLang pool", "MiB", "store us", "ratio", "GB/s", "load us", "ratio", "GB/s", *first),
        names=2,
    )
    for r in rows:
        table.add_row(
            r["mode"], r["pool"], f"{r['mib']:.0f}", f"{r['store_us']:.0f}", f"{r['store_ratio']:.3f}",
            f"{r['store_gbps']:.1f}", f"{r['load_us']:.0f}", f"{r['load_ratio']:.3f}", f"{r['load_gbps']:.1f}",
            *((f"{r['first_layers_us']:.0f}",) if groups > 1 else ()),
        )  # fmt: skip
    return [table]
