"""kvferry's settings and key space under SGLang's HiCache storage config, without importing SGLang."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.page_store import PageKeySpace

# The extra config's keys that are SGLang's (its factory's and controller's), not kvferry's settings.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "allocator"})


class LinkerSettings(ConnectorSettings):
    """The unified-cache linker's ``linker_extra_config``: the HiCache backend's keys, and how a load lands."""

    layer_groups: int = Field(
        1,
        ge=1,
        description="a load lands in this many groups of layers, each handed to SGLang's forward as it lands (the "
        "forward starts on the first while the others move); above 1 each group's pages are objects of their own, "
        "not the HiCache backend's",
    )


def storage_settings(extra_config: dict[str, Any] | None) -> ConnectorSettings:
    """kvferry's settings from SGLang's ``--hicache-storage-backend-extra-config``; ValueError naming a bad key."""
    ours = {key: value for key, value in (extra_config or {}).items() if key not in SGLANG_KEYS}
    try:
        return ConnectorSettings.from_extra_config(ours)
    except ValueError as exc:
        raise ValueError(f"--hicache-storage-backend-extra-config for kvferry: {exc}") from None


def page_key_space(config: Any, settings: ConnectorSettings) -> PageKeySpace:
    """Whose pages these are, from SGLang's ``HiCacheStorageConfig``: the model (``model_id``, else SGLang's model
    name) and this rank's shard."""
    model = settings.model_id or config.model_name
    if not model:
        raise ValueError("kvferry's HiCache storage needs the model's name: SGLang gave none; set \"model_id\"")
    if config.is_mla_model:  # every TP rank holds the whole page; decode context parallelism shards it
        size, rank = config.dcp_size, config.dcp_rank
    else:
        size, rank = config.tp_size, config.tp_rank
    # Pipeline stages hold their own layers, attention context-parallel ranks their own slice of every page.
    shard = config.pp_rank + config.pp_size * config.attn_cp_rank
    return PageKeySpace(model, size * config.pp_size * config.attn_cp_size, rank + size * shard)
