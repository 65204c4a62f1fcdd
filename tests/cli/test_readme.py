"""README.md stays true: its set-up block, its formats table, its benchmarks table and its Python example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvferry.cache import CacheEngine
from kvferry.cli.bench_cmd import BENCHMARKS
from kvferry.cli.main import main
from kvferry.config import KvferryConfig
from kvferry.server import KvferryServer, ServerConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_setup_commands() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["pip install -e . && kvferry server", "bash .ci/run"]


def test_readme_formats_table_is_what_kvferry_formats_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() in README


def test_readme_benchmarks_table_has_every_benchmark() -> None:
    rows = re.findall(r"^\| `kvferry bench ([a-z-]+)` \|", README, flags=re.M)
    assert rows == [b.name for b in BENCHMARKS]


def test_readme_python_examples_run() -> None:
    """Every python block, in order, in one namespace (later examples continue earlier ones); the client example
    against a real server (only its port is changed, to a free one)."""
    namespace: dict[str, object] = {"__name__": "readme_example"}
    blocks = _blocks("python")
    assert len(blocks) >= 3
    server = KvferryServer(
        ServerConfig(port=0, http_port=0),
        CacheEngine(KvferryConfig.load(env={}, overrides={"cache": {"l1_size_gb": 0.05}})),
    )
    server.start()
    try:
        for example in blocks:
            if example.startswith("# needs a running `kvferry server`"):
                example = example.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{server.port}")
            exec(compile(example, "README.md", "exec"), namespace)
    finally:
        server.stop()
