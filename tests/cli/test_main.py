"""`kvferry` top level, every `kvferry bench` subcommand's --help, `kvferry formats` and the wiring of
`kvferry server`."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

from kvferry.cli.bench_cmd import BENCHMARKS
from kvferry.cli.formats_cmd import object_shape_rule
from kvferry.cli.main import main
from kvferry.formats import LAYOUTS, EngineKVFormat

KVFERRY = [sys.executable, "-c", "import sys; from kvferry.cli.main import main; sys.exit(main())"]


def test_help_lists_commands_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("bench", "formats", "server", "examples:", "kvferry bench transfer"):
        assert word in out


def test_bench_transfer_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "transfer", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--format", "--direction", "--tokens", "--chunk-size", "--block-size", "--backend"):
        assert flag in out
    for flag in ("--device", "--dtype", "--repeats", "--json", "--layers", "--heads", "--head-size", "examples:"):
        assert flag in out


def test_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for b in BENCHMARKS:
        assert b.name in out
    assert "examples:" in out


# Each benchmark's own flags, as its --help must name them (besides --json).
FLAGS = {
    "transfer": ("--model", "--format", "--tokens", "--repeats"),
    "cache": ("--repeats",),
    "pool": ("--ops", "--capacity-mib"),
    "tiers": ("--dir", "--total-mib", "--reps", "--redis-url", "--objects"),
    "server": ("--requests", "--transfers", "--model", "--device", "--pool-gb", "--busy-poll-us", "--ipc"),
    "server-engines": ("--engines", "--rounds", "--think-ms", "--model", "--device", "--pool-gb", "--ipc"),
    "gpu-transfer": ("--reps", "--sections"),
    "cache-gpu": (),
    "vllm-gpu": ("--repeats", "--no-server", "--no-gemm", "--steps", "--busy-poll-us"),
    "sglang-gpu": ("--repeats", "--no-server", "--layer-groups", "--busy-poll-us"),
    "sglang-host": ("--pages", "--page-size", "--layers", "--heads", "--head-dim", "--repeats", "--no-server"),
    "codec": ("--repeats", "--chunks", "--models", "--gemm-seconds", "--no-gemm", "--sweep"),
    "codec-accuracy": ("--seed",),
    "codec-greedy": ("--codec", "--exact-layers", "--layers", "--prompts", "--tokens"),
    "vllm-ttft": (
        "--prompt-tokens",
        "--prompts",
        "--layers",
        "--hidden",
        "--chunk-size",
        "--dtype",
        "--server",
        "--foreground-loads",
    ),
    "vllm-async-load": ("--prefix-tokens", "--running", "--layers", "--kv-heads"),
    "vllm-batch": ("--prompt-tokens", "--prompts", "--rounds", "--modes"),
    "vllm-chat": (
        "--conversations",
        "--turns",
        "--first-tokens",
        "--new-tokens",
        "--generated",
        "--layers",
        "--hidden",
        "--chunk-size",
    ),
}


def test_every_benchmark_has_flags_listed_here() -> None:
    assert set(FLAGS) == {b.name for b in BENCHMARKS}


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_bench_subcommand_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: kvferry bench {name}" in out
    for flag in (*FLAGS[name], "--json", "examples:"):
        assert flag in out


def test_help_imports_no_benchmark() -> None:
    """`kvferry --help` and `kvferry bench --help` import no benchmark (nor ZMQ, Redis, the cache); a vLLM
    benchmark's --help does not import vLLM."""
    code = (
        "import json, sys\n"
        "from kvferry.cli.main import main\n"
        "def imported(argv):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    names = ('kvferry.bench', 'kvferry.cache', 'zmq', 'redis', 'vllm', 'transformers', 'rich.progress')\n"
        "    return sorted(n for n in names if n in sys.modules)\n"
        "top, bench = imported(['--help']), imported(['bench', '--help'])\n"
        "ttft, load = imported(['bench', 'vllm-ttft', '--help']), imported(['bench', 'vllm-async-load', '--help'])\n"
        "print('IMPORTED', json.dumps([top, bench, ttft, load]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    top, bench, ttft, load = json.loads(done.stdout.rsplit("IMPORTED ", 1)[1])
    assert top == bench == []
    assert not {"vllm", "transformers"} & {*ttft, *load}


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_formats_table_has_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for fmt in EngineKVFormat:
        assert fmt.name in out
        assert LAYOUTS[fmt].engines.split()[0] in out


def test_formats_markdown_is_one_row_per_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| id | name |")
    assert len(lines) == 2 + len(EngineKVFormat)
    row = next(line for line in lines if f"`{EngineKVFormat.NL_X_NB_BS_NH_TWO_HS.name}`" in line)
    assert "`[1, NL, chunk, NH*2*HS]`" in row


@pytest.mark.parametrize(
    ("fmt", "rule"),
    [
        (EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, "[2, NL, chunk, NH*HS]"),
        (EngineKVFormat.NL_X_NB_BS_HS, "[1, NL, chunk, HS]"),
        (EngineKVFormat.NL_X_NB_NH_BS_CS, "[1, NL, chunk, NH*2*HS]"),
        (EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS, "[1, NL, chunk, sum of plane HS]"),
        (EngineKVFormat.VLLM_CPU_NL_X_NB_NH_KT_V, "[2, NL, chunk, NH*HS]"),
        (EngineKVFormat.NL_X_NB_BSV_BSS, "[1, NL, chunk, HS] (1-byte elements)"),
    ],
)
def test_object_shape_rule(fmt: EngineKVFormat, rule: str) -> None:
    assert object_shape_rule(LAYOUTS[fmt]) == rule


def test_server_help_shows_the_server_flags() -> None:
    done = subprocess.run([*KVFERRY, "server", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--port", "--l1-size-gb", "--chunk-size", "--eviction", "--l2", "--config", "examples:"):
        assert flag in done.stdout


def test_server_bad_flag_value_is_a_usage_error() -> None:
    done = subprocess.run([*KVFERRY, "server", "--port", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--port" in done.stderr


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_server_runs_until_a_signal_and_then_stops_promptly(how: signal.Signals) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*KVFERRY, "server", "--port", "0", "--no-http", "--l1-size-gb", "0.0625"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        log = ""
        while "ready" not in log:
            log += lines.get(timeout=120)  # queue.Empty fails the test if the server never gets ready
        proc.send_signal(how)  # its handlers are in place before it says "ready"
        # Its stop is bounded (kvferry.server.app.STOP_DEADLINE_S), whatever the machine's load.
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
