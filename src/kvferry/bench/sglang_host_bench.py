"""`kvferry bench sglang-host`: kvferry as SGLang's HiCache storage backend, its pages moved between SGLang's host
KV pool and kvferry's cache, beside a plain memcpy of the same bytes.

The pool is SGLang's MHA host pool in its default layout (``page_first``; Llama-3-8B's shape by default, 64-token
pages), built without SGLang (`kvferry.bench.sglang_host_path`). Each mode stores a prefix of pages from pages
scattered over the pool and loads it into other scattered pages through the backend's own page store, as SGLang's
``batch_set_v1`` / ``batch_get_v1`` call it: embedded (the cache in this process); through a ``kvferry server``
(another process) with the pool in plain memory (the pages staged through a buffer the server maps: a copy more
each way); and with the pool in shared memory (SGLang's ``"allocator": "shm"``: the server maps the pool itself).
Every call is timed to its end beside the fastest plain host memcpy of the same bytes (timed alternately, every
round); every load of the timed rounds and the warm-up is checked outside its timed region (each destination page
holding its source page's bytes, every other byte of the pool unchanged); a failed check ends the run with an
error (exit status 1).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive
from kvferry.bench.report import new_table
from kvferry.bench.samples import Samples
from kvferry.bench.server_process import ServerProcess
from kvferry.bench.sglang_host_path import HostPath
from kvferry.bench.timing import CopyCeiling
from kvferry.connector.settings import ConnectorSettings

MODES = ["embedded", "server staged", "server shm"]
POOL_GB = 2.0
DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench sglang-host
  kvferry bench sglang-host --pages 16 --layers 8 --repeats 15 --json bench-out/sglang_host.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=64, help="pages in the prefix (default 64: 4096 tokens)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens a page (SGLang's --page-size)")
    parser.add_argument("--layers", type=int, default=32, help="the model's layers (default: Llama-3-8B's)")
    parser.add_argument("--heads", type=int, default=8, help="KV heads (default: Llama-3-8B's)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default: Llama-3-8B's)")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per mode (medians), after a warm-up round")
    parser.add_argument("--no-server", action="store_true", help="embedded mode only")
    add_json_argument(parser)


def check(args: argparse.Namespace) -> None:
    for name in ("pages", "page_size", "layers", "heads", "head_dim", "repeats"):
        positive(args, name)


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    modes = ["embedded"] if args.no_server else MODES
    steps.expect(len(modes))
    shape = {"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim, "page_size": args.page_size}
    rows: list[dict[str, Any]] = []
    for mode in modes:
        server = ServerProcess(POOL_GB, chunk_size=args.page_size) if mode != "embedded" else None
        try:
            settings = _settings(mode, args.page_size, None if server is None else server.endpoint)
            path = HostPath(settings, pages=args.pages, shared=mode == "server shm", **shape)
            try:
                if path.direct != (mode != "server staged"):
                    raise BenchError(f"{mode}: the page store {'does not move' if path.direct else 'moves'} pages "
                                       "straight between the pool and the cache")  # fmt: skip
                rows.append({"mode": mode, "pool": path.name, **measure(path, args.repeats)})
            finally:
                path.close()
            steps.done(mode)
        finally:
            if server is not None:
                server.stop()
    config = {"pages": args.pages, "repeats": args.repeats, "pool_gb": POOL_GB, **shape}
    return Outcome(config, {"rows": rows}, _show(rows, args.pages))


def measure(path: HostPath, repeats: int) -> dict[str, Any]:
    """One warm-up round and ``repeats`` timed ones, each: new keys and source bytes, the store, a memcpy of the
    same bytes, the load (checked), a memcpy again; the medians, and the ratios to the fastest memcpy's."""
    samples = Samples()
    ceiling = CopyCeiling(torch.device("cpu"), path.nbytes, "h2d")
    for i in range(repeats + 1):
        if i == 1:  # the warm-up round's (checked all the same)
            samples.clear()
            ceiling.clear()
        path.next_round()
        samples.timed("store", path.store)
        ceiling.time_once()
        path.before_load()
        samples.timed("load", path.load)
        path.check_load()
        ceiling.time_once()
    method, memcpy_s = ceiling.best()
    store_s, load_s = samples.median("store"), samples.median("load")
    return {
        "mib": path.nbytes / 2**20,
        "checked_rounds": repeats + 1,
        "memcpy": method,
        "memcpy_us": memcpy_s * 1e6,
        "store_us": store_s * 1e6,
        "load_us": load_s * 1e6,
        "store_ratio": memcpy_s / store_s,
        "load_ratio": memcpy_s / load_s,
        "store_gbps": path.nbytes / store_s / 1e9,
        "load_gbps": path.nbytes / load_s / 1e9,
        "memcpy_gbps": path.nbytes / memcpy_s / 1e9,
        "memcpy_spread": _spread(ceiling.samples[method]),
    }


def _spread(seconds: list[float]) -> float:
    """The samples' range over their median: how much the machine moved under the ceiling."""
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


def _settings(mode: str, page: int, endpoint: str | None) -> ConnectorSettings:
    if mode != "embedded":
        return ConnectorSettings(mode="server", server_url=str(endpoint), timeout_s=30.0)
    return ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": page, "l1_size_gb": POOL_GB}})


def _show(rows: list[dict[str, Any]], pages: int) -> list[Any]:
    table = new_table(
        f"a {pages}-page prefix through kvferry's HiCache storage backend, against a same-run host memcpy (ratio: "
        "the memcpy's time over the call's; every load checked)",
        ("mode", "SGLang host pool", "MiB", "store us", "ratio", "GB/s", "load us", "ratio", "GB/s", "memcpy GB/s"),
        names=2,
    )
    for r in rows:
        table.add_row(
            r["mode"], r["pool"], f"{r['mib']:.0f}", f"{r['store_us']:.0f}", f"{r['store_ratio']:.3f}",
            f"{r['store_gbps']:.1f}", f"{r['load_us']:.0f}", f"{r['load_ratio']:.3f}", f"{r['load_gbps']:.1f}",
            f"{r['memcpy_gbps']:.1f}",
        )  # fmt: skip
    return [table]
