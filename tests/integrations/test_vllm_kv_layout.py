"""Recognising vLLM's CPU KV cache, and the connector's settings (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from kvferry.connector.engine_kv import UnsupportedKVLayout
from kvferry.connector.settings import ConnectorSettings
from kvferry.formats import EngineKVFormat
from kvferry.integrations.vllm.kv_layout import recognise


def cpu_kv(layers: int = 3, nb: int = 6, nh: int = 2, bs: int = 32, hs: int = 64) -> dict[str, torch.Tensor]:
    """Like vLLM's CPU backend: one buffer, layer outermost, a [NB, NH, BS, 2*HS] view per layer."""
    buf = torch.randn(layers, nb, nh, bs, 2 * hs).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def test_cpu_layout_is_recognised_in_layer_order() -> None:
    kv = cpu_kv()
    shuffled = {name: kv[name] for name in reversed(list(kv))}  # dict order must not decide the layer order
    found = recognise(shuffled, isa="vec", kv_cache_dtype="auto")
    assert found.fmt is EngineKVFormat.VLLM_CPU_NL_X_NB_NH_KT_V
    assert found.layer_names == list(kv)
    assert all(a is b for a, b in zip(found.layers, kv.values(), strict=True))
    assert found.block_size == 32
    assert recognise(kv, isa="vec16", kv_cache_dtype="bfloat16").block_size == 32
    amx = recognise(kv, isa="amx", kv_cache_dtype="auto")
    assert amx.fmt is EngineKVFormat.VLLM_CPU_AMX_NL_X_NB_NH_KV_TILED and amx.kv_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("kwargs", "kv", "message"),
    [
        ({"isa": "neon", "kv_cache_dtype": "auto"}, cpu_kv(), "ISA is 'neon'"),
        ({"isa": "amx", "kv_cache_dtype": "auto"}, cpu_kv(hs=40), "packs HS in tiles of 16"),
        ({"isa": "amx", "kv_cache_dtype": "auto"}, {"l.0.x": torch.randn(6, 2, 32, 64)}, "1 or 2-byte elements"),
        # vLLM's page views (every backend but CPU_ATTN): whatever their strides cannot be one of its layouts
        (
            {"isa": None, "kv_cache_dtype": "auto"},
            {"l.0.x": torch.randn(6, 2, 64, 32).to(torch.bfloat16).transpose(2, 3)},
            "content axis C has stride 32",
        ),
        (
            {"isa": None, "kv_cache_dtype": "auto"},
            {"l.0.x": torch.randn(6, 4096).to(torch.bfloat16).as_strided((6, 2, 32, 64), (4096, 64, 64, 1))},
            "cells would overlap",
        ),
        (
            {"isa": None, "kv_cache_dtype": "auto"},
            {
                "l.0.x": torch.randn(6, 2, 32, 64).to(torch.bfloat16),
                "l.1.x": torch.randn(6, 2, 32, 64).to(torch.bfloat16),
            },
            "not a view of the buffer",
        ),
        ({"isa": None, "kv_cache_dtype": "auto"}, {"l.0.x": torch.randn(6, 2, 32, 63)}, "holds 63 elements"),
        ({"isa": None, "kv_cache_dtype": "auto", "mla": True}, cpu_kv(), "one latent per token, but the views have 2"),
        ({"isa": None, "kv_cache_dtype": "auto", "block_size": 48}, cpu_kv(), "32-token blocks do not divide .* 48"),
        ({"isa": "vec", "kv_cache_dtype": "fp8"}, cpu_kv(), "dtype 'fp8'"),
        ({"isa": "vec", "kv_cache_dtype": "auto"}, {}, "kv_caches is empty"),
        (
            {"isa": "vec", "kv_cache_dtype": "auto"},
            {**cpu_kv(2), "model.layers.9.self_attn.attn": torch.randn(6, 2, 32, 64).to(torch.bfloat16)},
            r"kv_caches\['model.layers.9.self_attn.attn'\] is \(6, 2, 32, 64\)",
        ),
        (
            {"isa": "vec", "kv_cache_dtype": "auto"},
            {"l.0.x": torch.randn(6, 2, 64, 32).to(torch.bfloat16).transpose(2, 3)},
            "contiguous=False",
        ),
    ],
)
def test_unknown_layouts_are_refused_with_the_reason(kwargs: dict, kv: dict, message: str) -> None:
    with pytest.raises(UnsupportedKVLayout, match=message):
        recognise(kv, **kwargs)


def test_settings_parse_and_name_bad_keys() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"mode": "embedded", "config": {"cache": {"chunk_size": 512, "l1_size_gb": 0.5}}, "salt": "tenant-a"}
    )
    config = settings.kvferry_config()
    assert config.cache.chunk_size == 512 and settings.salt == "tenant-a"
    assert ConnectorSettings.from_extra_config(None).mode == "embedded"
    with pytest.raises(ValueError, match="mode: Input should be 'embedded' or 'server'"):
        ConnectorSettings.from_extra_config({"mode": "remote"})
    with pytest.raises(ValueError, match="server_ur: Extra inputs are not permitted"):
        ConnectorSettings.from_extra_config({"server_ur": "tcp://127.0.0.1:1"})


def test_after_load_hook_is_resolved_by_module_path() -> None:
    assert ConnectorSettings().load_after_load_hook() is None
    hook = ConnectorSettings(after_load_hook="json:dumps").load_after_load_hook()
    assert hook is not None and hook([1]) == "[1]"
    with pytest.raises(ValueError, match="must be 'module:function'"):
        ConnectorSettings(after_load_hook="json.dumps").load_after_load_hook()
    with pytest.raises(ValueError, match="nope is not a callable of json"):
        ConnectorSettings(after_load_hook="json:nope").load_after_load_hook()


def test_fp8_encodings_have_key_spaces_of_their_own() -> None:
    from kvferry.connector.backends import KeySpace

    raw = {name: t.view(torch.uint8)[..., : t.shape[-1]].contiguous() for name, t in cpu_kv().items()}
    spaces = {
        cache: KeySpace.of(recognise(raw, isa="vec", kv_cache_dtype=cache), model="m", salt="s").namespace(256)
        for cache in ("fp8_e4m3", "fp8_e5m2")
    }
    assert spaces["fp8_e4m3"].digest != spaces["fp8_e5m2"].digest
    assert [(spaces[c].salt, spaces[c].kv_cache_dtype) for c in spaces] == [("s", "fp8_e4m3"), ("s", "fp8_e5m2")]
    plain = KeySpace.of(recognise(cpu_kv(), isa="vec", kv_cache_dtype="auto"), model="m", salt="s")
    assert (plain.salt, plain.kv_cache_dtype) == ("s", None)


@pytest.mark.parametrize(
    ("local", "model", "tp", "heads"),
    [
        (2, 2, (0, 1), None),  # no tensor parallelism
        (1, 2, (1, 2), (1, 2)),  # an even split
        (2, 8, (3, 4), (6, 8)),
        (1, 2, (3, 4), (1, 2)),  # fewer heads than ranks: ranks 2 and 3 both hold head 1
        (1, 1, (1, 2), None),  # one KV head, replicated: every rank holds the whole KV
    ],
)
def test_a_tensor_parallel_rank_names_its_heads(
    local: int, model: int, tp: tuple[int, int], heads: tuple[int, int] | None
) -> None:
    found = recognise(cpu_kv(nh=local), isa="vec", kv_cache_dtype="auto", tp=tp, model_kv_heads=model)
    assert found.heads == heads


def test_a_rank_of_a_tensor_parallel_engine_keys_as_the_whole_model() -> None:
    from kvferry.connector.backends import KeySpace

    whole = cpu_kv(nh=4)
    rank = {name: t[:, 2:].contiguous() for name, t in whole.items()}  # rank 1 of 2
    spaces = [
        KeySpace.of(recognise(kv, isa=isa, kv_cache_dtype="auto", tp=tp, model_kv_heads=4), model="m", salt="s")
        for kv, tp in ((whole, (0, 1)), (rank, (1, 2)))
        for isa in ("vec", "amx")
    ]
    assert spaces[0] == spaces[2] and spaces[1] == spaces[3]  # per layout, the same for TP=1 and TP=2
    assert spaces[0].namespace(256).digest == spaces[2].namespace(256).digest


@pytest.mark.parametrize(
    ("local", "model", "tp", "message"),
    [
        (3, 8, (0, 2), "holds 3 KV heads of the model's 8 with tensor parallelism 2"),
        (1, 3, (0, 2), "holds 1 KV heads of the model's 3"),
        (2, 4, (2, 2), "rank 2 is not in a group of 2"),
    ],
)
def test_a_head_split_vllm_would_not_make_is_refused(local: int, model: int, tp: tuple[int, int], message: str) -> None:
    with pytest.raises(UnsupportedKVLayout, match=message):
        recognise(cpu_kv(nh=local), isa="vec", kv_cache_dtype="auto", tp=tp, model_kv_heads=model)


def test_an_engine_without_tensor_parallelism_holds_every_head() -> None:
    from types import SimpleNamespace

    from kvferry.integrations.vllm.kv_layout import tensor_parallel_rank

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 8),
    )
    assert tensor_parallel_rank(config) == ((0, 1), None)
