"""The docs stay true: README.md's set-up block and configuration table, docs/configuration.md's and
docs/formats.md's tables, docs/development.md's layers, BENCHMARKS.md's list of benchmarks, the Python examples (run
against a real server), and the docs' size and links."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kvferry.cache import CacheEngine
from kvferry.cli.bench_cmd import BENCHMARKS
from kvferry.cli.main import main
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.server import KvferryServer

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {path.name: path.read_text(encoding="utf-8") for path in (ROOT / "docs").glob("*.md")}


def _blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_readme_opens_with_the_two_setup_commands() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["pip install -e . && kvferry server", "bash .ci/run"]


def test_the_formats_table_is_what_kvferry_formats_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() in DOCS["formats.md"]


@pytest.mark.parametrize(("where", "flags"), [("README.md", ["--brief"]), ("configuration.md", [])])
def test_the_configuration_tables_are_what_kvferry_config_prints(
    capsys: pytest.CaptureFixture[str], where: str, flags: list[str]
) -> None:
    assert main(["config", "--markdown", *flags]) == 0
    assert capsys.readouterr().out.strip() in (README if where == "README.md" else DOCS[where])


def test_benchmarks_md_lists_every_benchmark() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `kvferry bench ([a-z-]+)` \|", text, flags=re.M)
    assert rows == [b.name for b in BENCHMARKS]


def test_the_layers_table_is_the_import_contract() -> None:
    """docs/development.md's package table, lowest first, is pyproject.toml's layers contract read bottom up."""
    (contract,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = [sorted(f"kvferry.{p.strip()}" for p in layer.split("|")) for layer in reversed(contract["layers"])]
    rows = re.findall(r"^\| (`kvferry\.[a-z_]+`(?:, `kvferry\.[a-z_]+`)*) \|", DOCS["development.md"], flags=re.M)
    assert [sorted(re.findall(r"`([a-z_.]+)`", row)) for row in rows] == layers


def test_the_docs_are_short_and_every_link_resolves() -> None:
    assert len(README.encode()) < 12 * 1024
    assert len((ROOT / "BENCHMARKS.md").read_bytes()) < 12 * 1024
    for name, text in [("README.md", README), *((f"docs/{n}", t) for n, t in DOCS.items())]:
        base = ROOT if name == "README.md" else ROOT / "docs"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (base / target).exists(), f"{name} links to {target}, which does not exist"


def test_the_python_examples_run() -> None:
    """Every python block (docs/python_api.md's and docs/server.md's; README.md's where it has one), in order, in one
    namespace (later examples continue earlier ones); the client example against a real server (only its port is
    changed, to a free one)."""
    namespace: dict[str, object] = {"__name__": "readme_example"}
    blocks = [b for text in (README, DOCS["python_api.md"], DOCS["server.md"]) for b in _blocks("python", text)]
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
