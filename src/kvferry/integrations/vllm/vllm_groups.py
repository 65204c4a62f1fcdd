"""vLLM's KV cache groups (``KVCacheConfig.kv_cache_groups``) read as kvferry's `KVGroup`s, by attribute: the
spec classes' names and fields, so nothing here imports vLLM."""

from __future__ import annotations

from typing import Any

from kvferry.connector.kv_groups import KVGroup, UnsupportedGroups


def groups_of(kv_cache_config: Any) -> list[KVGroup]:
    """The groups of vLLM's ``KVCacheConfig`` (by attribute); UnsupportedGroups for a kind kvferry cannot move."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind_name = type(spec).__name__
        names = tuple(group.layer_names)
        if kind_name == "FullAttentionSpec" or kind_name == "MLAAttentionSpec":
            groups.append(KVGroup(index, "full", spec.block_size, names))
        elif kind_name == "SlidingWindowSpec":
            retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
            groups.append(KVGroup(index, "sliding_window", spec.block_size, names, spec.sliding_window, retained))
        elif kind_name == "ChunkedLocalAttentionSpec":
            groups.append(KVGroup(index, "chunked_local", spec.block_size, names, spec.attention_chunk_size))
        elif kind_name == "MambaSpec" and getattr(spec, "mamba_cache_mode", "none") == "align":
            groups.append(KVGroup(index, "mamba", spec.block_size, names, page_bytes=spec.page_size_bytes))
        else:
            listed = f"{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
            mamba = " with mamba_cache_mode 'align' (turn vLLM's prefix caching on)" if kind_name == "MambaSpec" else ""
            raise UnsupportedGroups(
                f"vLLM's KV cache group {index} ({listed}) is {kind_name}: kvferry moves full, sliding-window and "
                f"chunked-local attention groups and Mamba groups{mamba}"
            )
    return groups


def hybrid_groups(kv_cache_config: Any) -> list[KVGroup]:
    """The groups when the model needs the hybrid path (several groups, or a windowed one); else none."""
    groups = groups_of(kv_cache_config)
    return groups if len(groups) > 1 or groups[0].kind != "full" else []
