"""The fp8 codec on the GPU data path: every path (staged slices, zero-copy, one-object graphs, a tensor-parallel
rank's heads) writes the torch backend's bytes and reads back its KV."""

from __future__ import annotations

import pytest
import torch

from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe, with_codec
from kvferry.formats.synthetic import ModelDims, make_paged
from kvferry.memory import HostPool
from kvferry.transfer import transfer, transfer_async
from kvferry.transfer.engine_config import EngineConfig
from kvferry.transfer.gpu_engine import TransferEngine
from tests.conftest import POISON, poisoned

pytestmark = pytest.mark.gpu
F = EngineKVFormat
DIMS = ModelDims(nl=4, nh=4, hs=128, plane_widths=(512, 64))


# 96 blocks: the longest request (five chunks of 16 blocks) needs 80 distinct ones
def _paged(fmt: F, seed: int, nb: int = 96, bs: int = 16):  # type: ignore[no-untyped-def]
    return make_paged(fmt, DIMS, nb, bs, torch.bfloat16, "cuda", generator=torch.Generator("cuda").manual_seed(seed))


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_NH_BS_CS, F.NL_X_NB_BS_HS], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["staged", "zero_copy"])
@pytest.mark.parametrize(("chunks", "skip", "last"), [(5, 0, 256), (3, 5, 128), (1, 0, 256)])
def test_gpu_paths_match_torch_backend(fmt: F, mode: str, chunks: int, skip: int, last: int) -> None:
    paged = _paged(fmt, 1)
    coded = with_codec(describe(fmt, paged), "fp8")
    shape = coded.object_shape(256)
    pool = HostPool(64 << 20)
    objs = [pool.alloc(shape if i < chunks - 1 else (*shape[:2], last, shape[3]), torch.uint8) for i in range(chunks)]
    for o in objs:
        o.fill_(POISON)
    n_ids = ((chunks - 1) * 256 + last) // 16
    ids = torch.randperm(96)[:n_ids]
    engine = TransferEngine("cuda", EngineConfig(slot_bytes=4 << 20))  # small slots: objects cut into row ranges
    transfer_async(paged, objs, ids, Direction.D2H, fmt, skip_prefix_blocks=skip, geometry=coded, engine=engine,
                   mode=mode).wait()  # fmt: skip
    for i, o in enumerate(objs):
        want = poisoned(o.shape, torch.uint8, "cuda")
        head = max(0, skip - i * 16)
        transfer(paged, [want], ids[i * 16 : (i + 1) * 16], Direction.D2H, fmt, skip_prefix_blocks=head,
                 backend="torch", geometry=coded)  # fmt: skip
        assert torch.equal(o, want.cpu()), i

    target = _paged(fmt, 2)
    expect = _paged(fmt, 2)
    tgeom, egeom = with_codec(describe(fmt, target), "fp8"), with_codec(describe(fmt, expect), "fp8")
    transfer_async(target, objs, ids, Direction.H2D, fmt, skip_prefix_blocks=skip, geometry=tgeom, engine=engine,
                   mode=mode).wait()  # fmt: skip
    transfer(expect, [o.cuda() for o in objs], ids, Direction.H2D, fmt, skip_prefix_blocks=skip, backend="torch",
             geometry=egeom)  # fmt: skip
    torch.cuda.synchronize()
    for a, b in zip(target, expect, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
