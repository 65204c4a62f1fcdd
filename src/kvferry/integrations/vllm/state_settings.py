"""vLLM's settings that decide which Mamba states reach kvferry, checked where the connector starts.

vLLM writes a Mamba group's state into a block (``mamba_cache_mode "align"``) only where a prefill chunk ends on
the block's boundary, and hands a connector only the states its prefix cache keeps (``boundary_state_offloads``).
Two settings decide what arrives:

- its scheduler cuts prefill chunks at multiples of ``cache_config.block_size``, which vLLM raises to the Mamba
  block size (a page holding a state) once the KV cache is laid out. In vLLM's multiprocess layout on its CPU
  platform the engine-core process re-runs the platform's config hook after its start-up handshake, which puts a
  ``block_size`` the user did not set back to the platform's default (128): chunks then end between Mamba
  boundaries, no state lands in a boundary's block, and vLLM hands over none (its own prefix cache misses too).
  `restore_scheduler_block_size` puts vLLM's value back (with a warning) before the first request is scheduled.
- ``prefix_cache_retention_interval``: at 0 (its default) vLLM keeps, and hands over, the state at a prompt's
  last block boundary only (`warn_of_sparse_state_retention`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvferry.connector.kv_groups import KVGroup

log = logging.getLogger(__name__)


def _state_block_size(groups: Sequence[KVGroup]) -> int | None:
    sizes = [group.block_size for group in groups if group.holds_state]
    return max(sizes) if sizes else None


def restore_scheduler_block_size(cache_config: Any, groups: Sequence[KVGroup]) -> bool:
    """Set ``cache_config.block_size`` (vLLM's scheduler's, read each step) back to the Mamba block size where it
    differs under "align" mode, with a warning; whether it did."""
    size = _state_block_size(groups)
    if size is None or getattr(cache_config, "mamba_cache_mode", None) != "align" or cache_config.block_size == size:
        return False
    found = cache_config.block_size
    cache_config.block_size = size
    log.warning(
        "kvferry: vLLM's scheduler block size was %d, not the Mamba block size %d its KV cache is laid out in (vLLM's "
        "CPU platform resets a block_size the user did not set when its engine core starts in a process of its own): "
        "prefill chunks would end between Mamba boundaries and vLLM would hand over no state to store. kvferry set "
        "it back to %d; setting vLLM's block_size explicitly (--block-size, e.g. 128: vLLM still raises it to the "
        "Mamba block size) avoids the reset",
        found,
        size,
        size,
    )
    return True


def warn_of_sparse_state_retention(retention_interval: int | None, groups: Sequence[KVGroup]) -> bool:
    """Warn when a Mamba group runs under ``prefix_cache_retention_interval`` 0 (vLLM's default); whether it did."""
    size = _state_block_size(groups)
    if size is None or retention_interval != 0:
        return False
    log.warning(
        "kvferry: vLLM's prefix_cache_retention_interval is 0 (its default): it hands over a Mamba state at a "
        "prompt's last block boundary only (boundaries fall every %d tokens), so kvferry stores no other. A chat's "
        "next turn then hits up to the previous turn's prompt at most (not its output), and a prompt sharing a "
        "shorter prefix with a stored one misses. Set prefix_cache_retention_interval to %d "
        "(--prefix-cache-retention-interval %d, the Mamba block size; a multiple keeps a state every that many "
        "tokens) for a state at every boundary; vLLM's own prefix cache then keeps those states too",
        size,
        size,
        size,
    )
    return True
