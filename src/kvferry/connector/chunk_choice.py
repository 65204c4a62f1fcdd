"""Embedded mode's chunk size where the user set none: a multiple of the engine's block sizes.

An engine may pick block sizes itself: vLLM's attention block size for a hybrid model follows its page sizes,
which depend on the machine (Qwen3-Next's was 384 on one CPU and 256 on another). kvferry's default chunk size (256
tokens) is then not always whole blocks; where ``cache.chunk_size`` is not set, the chunk is the smallest multiple
of every KV cache group's block size (their least common multiple) that is at least the default, and the start-up
log says so. A chunk size the user set is kept and checked (`ConnectorSettings.check_chunk_size`); in server mode
the server's chunk size rules.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from kvferry.config import CacheConfig
from kvferry.connector.settings import ConnectorSettings

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE: int = CacheConfig.model_fields["chunk_size"].default


def chunk_size_for(block_sizes: Iterable[int], default: int = DEFAULT_CHUNK_SIZE) -> int:
    """The smallest multiple of every one of ``block_sizes`` that is at least ``default``."""
    step = math.lcm(*block_sizes)
    return step * max(1, -(-default // step))


def follow_block_size(settings: ConnectorSettings, block_sizes: Iterable[int], *, announce: bool) -> ConnectorSettings:
    """``settings`` with embedded mode's ``cache.chunk_size`` set to `chunk_size_for` the engine's block sizes when
    the user set none (the config, its file or ``KVFERRY_CACHE__CHUNK_SIZE``); logged at INFO when ``announce``."""
    if settings.mode != "embedded":
        return settings
    config = settings.kvferry_config()
    if "chunk_size" in config.cache.model_fields_set:
        return settings
    sizes = sorted(set(block_sizes))
    chunk = chunk_size_for(sizes)
    if announce:
        log.info(
            "kvferry: chunk size %d tokens (cache.chunk_size not set: the smallest multiple of the engine's block "
            "size%s %s from %d on)",
            chunk,
            "s" if len(sizes) > 1 else "",
            ", ".join(map(str, sizes)),
            DEFAULT_CHUNK_SIZE,
        )
    cache = {**settings.config.get("cache", {}), "chunk_size": chunk}
    return settings.model_copy(update={"config": {**settings.config, "cache": cache}})
