"""Spot checks of the reference against FORMATS.md's own formulas (so the oracle itself is checked)."""

from __future__ import annotations

import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat
from kvferry.formats.synthetic import ModelDims, make_paged
from tests.conftest import poisoned

F = EngineKVFormat


def test_flash_attention_nhd_by_hand() -> None:
    paged = make_paged(F.NL_X_TWO_NB_BS_NH_HS, ModelDims(nl=2, nh=3, hs=4), 6, 4)
    ids = [4, 1]
    obj = poisoned(kvferry.object_shape(F.NL_X_TWO_NB_BS_NH_HS, paged, 8), torch.bfloat16)
    kvferry.transfer(paged, [obj], ids, Direction.D2H, F.NL_X_TWO_NB_BS_NH_HS, 8, backend="reference")
    for k in range(2):
        for layer in range(2):
            for t in range(8):
                want = paged[layer][k, ids[t // 4], t % 4].reshape(-1)
                assert torch.equal(obj[k, layer, t], want)


def test_vllm_cpu_layout_formula() -> None:
    """FORMATS.md: K(b,h,t,d) at b*NH*BS*2HS + h*BS*2HS + d*BS + t; V at ... + BS*HS + t*HS + d."""
    nh, hs, bs = 2, 4, 8
    fmt = F.VLLM_CPU_NL_X_NB_NH_KT_V
    paged = make_paged(fmt, ModelDims(nl=1, nh=nh, hs=hs), 3, bs)
    flat = paged[0].reshape(-1)
    obj = poisoned(kvferry.object_shape(fmt, paged, bs), torch.bfloat16)
    for backend in ("reference", "torch", "triton"):
        kvferry.transfer(paged, [obj], [2], Direction.D2H, fmt, bs, backend=backend)
        b = 2
        for h in range(nh):
            for t in range(bs):
                for d in range(hs):
                    cell = b * nh * bs * 2 * hs + h * bs * 2 * hs
                    assert obj[0, 0, t, h * hs + d] == flat[cell + d * bs + t]
                    assert obj[1, 0, t, h * hs + d] == flat[cell + bs * hs + t * hs + d]


def test_indexer_pages_move_verbatim() -> None:
    fmt = F.NL_X_NB_BSV_BSS
    paged = make_paged(fmt, ModelDims(nl=2, nh=1, hs=132), 5, 4, torch.uint8)
    obj = poisoned(kvferry.object_shape(fmt, paged, 8), torch.uint8)
    kvferry.transfer(paged, [obj], [3, 0], Direction.D2H, fmt, 8, backend="triton")
    for layer in range(2):
        assert torch.equal(obj[0, layer, :4].reshape(-1), paged[layer][3].reshape(-1))
        assert torch.equal(obj[0, layer, 4:].reshape(-1), paged[layer][0].reshape(-1))


def test_fused_keeps_engine_interleave() -> None:
    fmt = F.NL_X_NB_NH_BS_TWO_HS  # [NB, NH, BS, 2, HS]
    paged = make_paged(fmt, ModelDims(nl=1, nh=2, hs=4), 3, 4)
    obj = poisoned(kvferry.object_shape(fmt, paged, 4), torch.bfloat16)
    kvferry.transfer(paged, [obj], [1], Direction.D2H, fmt, 4, backend="torch")
    for t in range(4):
        assert torch.equal(obj[0, 0, t], paged[0][1, :, t].reshape(-1))  # per token: [NH][2][HS]
