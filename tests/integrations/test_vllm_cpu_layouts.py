"""kvferry's vLLM CPU layouts against vLLM's own cache writes, for every x86 attention ISA and cache dtype.

vLLM's ``cpu_attn_reshape_and_cache`` writes K and V into a ``[NB, NH, BS, 2*HS]`` block the way the chosen ISA's
attention kernel reads them. It only moves memory, so its AVX-512 build runs for every ISA (the AMX path writes
AMX tiles without executing AMX instructions): on a CPU with AVX-512 each layout is checked whatever the CPU. On a
CPU without it vLLM loads its AVX2 build, which has no AMX or fp8 cache writes (vLLM picks neither there), so only
the others are checked. Stores must give objects holding exactly the K and V vLLM was given, token-major;
retrieves must rebuild vLLM's bytes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.integrations.vllm.kv_layout import FORMAT_OF_ISA, recognise
from tests.conftest import poisoned

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra"),
]

LAYERS, BLOCKS, HEADS = 2, 5, 2
# vLLM picks AMX only for bf16 (and fp8 caches of bf16 models); its AMX path is checked for the other dtypes too,
# except fp32, whose tiles do not pair (kvferry refuses that combination: vLLM never makes it).
CASES = [
    (isa, dtype, cache)
    for isa in ("vec", "vec16", "amx")
    for dtype, cache in (
        (torch.bfloat16, "auto"),
        (torch.float16, "auto"),
        (torch.float32, "auto"),
        (torch.bfloat16, "fp8"),
        (torch.bfloat16, "fp8_e5m2"),
    )
    if not (isa == "amx" and dtype == torch.float32)
    if not (isa == "vec16" and cache != "auto")  # vLLM: fp8 caches need a head size that is a multiple of 32
]
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
AVX2_BUILD = not torch.cpu._is_avx512_supported()  # how vLLM chooses between its _C_AVX512 and _C_AVX2 builds


def _kv_values(tokens: int, head_size: int, dtype: torch.dtype, cache: str, seed: int) -> torch.Tensor:
    """[2, tokens, NH, HS] random K and V; for fp8 caches, values fp8 holds exactly (so the bytes are known)."""
    gen = torch.Generator().manual_seed(seed)
    if cache in FP8:
        choices = torch.tensor([0.0, 0.5, 1.0, 1.5, -2.0, 3.0, -0.25, 6.0])
        return choices[torch.randint(0, 8, (2, tokens, HEADS, head_size), generator=gen)].to(dtype)
    return torch.randn(2, tokens, HEADS, head_size, generator=gen).to(dtype)


def _vllm_cache(isa: str, values: torch.Tensor, block_ids: list[int], bs: int, cache: str) -> list[torch.Tensor]:
    """Per layer, the cache vLLM builds when it writes `values` (layer-shifted) into `block_ids`."""
    from vllm import _custom_ops as ops

    head_size = values.shape[-1]
    tensor_dtype = torch.uint8 if cache in FP8 else values.dtype
    buffer = torch.zeros(LAYERS, BLOCKS, HEADS, bs, 2 * head_size, dtype=tensor_dtype)
    slots = torch.tensor([b * bs + t for b in block_ids for t in range(bs)])
    for layer in range(LAYERS):
        kv = buffer[layer].view(BLOCKS, HEADS, 2 * bs, head_size)
        key_cache, value_cache = kv.chunk(2, dim=2)
        k, v = (values[i] + layer for i in range(2))
        ops.cpu_attn_reshape_and_cache(
            k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache
        )
    return list(buffer)


@pytest.mark.parametrize(("isa", "dtype", "cache"), CASES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize(("bs", "head_size"), [(32, 64), (64, 128)])
def test_objects_hold_what_vllm_wrote(isa: str, dtype: torch.dtype, cache: str, bs: int, head_size: int) -> None:
    if AVX2_BUILD and (isa == "amx" or cache in FP8):
        pytest.skip("vLLM's AVX2 build (this CPU has no AVX-512) writes neither AMX tiles nor fp8 caches")
    block_ids = [3, 0, 4]
    tokens = len(block_ids) * bs
    values = _kv_values(tokens, head_size, dtype, cache, seed=bs + head_size)
    layers = _vllm_cache(isa, values, block_ids, bs, cache)
    kv = recognise({f"model.layers.{i}.attn": t for i, t in enumerate(layers)}, isa=isa, kv_cache_dtype=cache)
    assert kv.fmt is FORMAT_OF_ISA[isa] and kv.block_size == bs
    assert kv.kv_dtype == (cache if cache in FP8 else str(dtype).removeprefix("torch."))

    shape = kvferry.object_shape(kv.fmt, kv.layers, tokens)
    want = torch.stack([torch.stack([values[p] + layer for layer in range(LAYERS)]) for p in range(2)])
    want = want.reshape(shape)  # [K/V, layer, token, NH*HS]
    if cache in FP8:
        want = want.to(FP8[cache]).view(torch.uint8)
    for backend in ("reference", "torch", "triton"):
        obj = poisoned(shape, kv.layers[0].dtype)
        kvferry.transfer(kv.layers, [obj], block_ids, Direction.D2H, kv.fmt, tokens, backend=backend)
        assert torch.equal(obj, want), backend

        rebuilt = [torch.zeros_like(t) for t in layers]
        kvferry.transfer(rebuilt, [obj], block_ids, Direction.H2D, kv.fmt, tokens, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(rebuilt, layers, strict=True)), backend


def test_every_x86_isa_of_vllm_has_a_layout() -> None:
    """The ISAs vLLM's CPU backend can pick on x86 (`_get_attn_isa`) all have a declared, checked layout."""
    import inspect

    from vllm.v1.attention.backends import cpu_attn

    source = inspect.getsource(cpu_attn._get_attn_isa)
    x86 = {"vec", "vec16", "amx"}
    assert all(f'"{isa}"' in source for isa in x86)
    assert x86 <= set(FORMAT_OF_ISA)
