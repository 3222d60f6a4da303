"""ReqToTokenPool: writes (one by one and batched) land in the device table and its host mirror
alike; reads come from the host; bounds are checked before anything is written."""

from __future__ import annotations

import pytest
import torch

from tandem.cache.req_to_token import ReqToTokenPool


def _s(xs):
    return torch.tensor(xs, dtype=torch.int64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_write_many_equals_writes(device):
    a, b = ReqToTokenPool(4, 16, device), ReqToTokenPool(4, 16, device)
    rows, starts, slots = [1, 3, 2], [0, 5, 15], [_s([7, 8, 9]), _s([40]), _s([3])]
    for r, st, sl in zip(rows, starts, slots):
        a.write(r, st, sl)
    b.write_many(rows, starts, slots)
    assert torch.equal(a.req_to_token.cpu(), b.req_to_token.cpu())
    assert b.req_to_token.device.type == device and b.req_to_token.dtype == torch.int32
    assert b.read(1, 0, 3).tolist() == [7, 8, 9] and b.read(1, 0, 3).device.type == "cpu"
    assert b.slot(3, 5) == 40 and b.slot(2, 15) == 3
    assert torch.equal(b._host, b.req_to_token.cpu())                 # mirror == device table


def test_bounds_checked_before_writing():
    p = ReqToTokenPool(2, 8)
    with pytest.raises(ValueError, match="positions 6..9 exceeds max_context=8"):
        p.write_many([1, 2], [0, 6], [_s([1]), _s([2, 3, 4])])
    with pytest.raises(ValueError, match="exceeds max_context=8"):
        p.write(1, 7, _s([1, 2]))
    assert p.read(1, 0, 8).tolist() == [0] * 8 and p.read(2, 0, 8).tolist() == [0] * 8
