"""What the SGLang checks share: the documented commands (docs/sglang.md's, one bash block per way to run kvferry
under SGLang; README.md's quick start), and a kvferry server in this process whose chunk size is a page size."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.memory import HostPool
from kvferry.server import KvferryServer
from tests.cli.test_doc_commands import _block_commands

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sglang.md"
README = ROOT / "README.md"


def documented_launch(flag: str, page: Path = DOC) -> list[str]:
    """The commands of ``page``'s bash block whose SGLang launch has ``flag``."""
    (block,) = [
        b for b in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S) if flag in b and "sglang" in b
    ]
    return _block_commands(f"```bash\n{block}```")


@contextlib.contextmanager
def page_server(chunk_size: int, pool_bytes: int = 16 << 20) -> Iterator[KvferryServer]:
    """A server on loopback over a CPU pool of ``pool_bytes``, its chunk size ``chunk_size`` (SGLang's page size,
    or another to be refused); stopped on the way out, if the test has not stopped it."""
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": chunk_size}})
    engine = CacheEngine(config, pool=HostPool(pool_bytes, pin=False))
    server = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        engine.close()


def url_of(server: KvferryServer) -> str:
    return f"tcp://127.0.0.1:{server.port}"
