"""KVCopier (cache/radix/copier.py): exact bytes both ways on the CPU; on CUDA (gpu-marked) the
ordering contract of its module docstring: device slots reusable when to_host returns, host
writes landing in issue order, the compute stream (not the host) waiting for a restore."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.cache.kv_pool import KVPool
from tandem.cache.radix.copier import KVCopier

LAYERS, HEADS, DIM = 3, 2, 8


def _pools(device: str, dev_slots: int = 64, host_slots: int = 48, dtype=torch.float32):
    dev = KVPool(dev_slots, 4, LAYERS, HEADS, DIM, dtype=dtype, device=device)
    host = KVPool(host_slots, 4, LAYERS, HEADS, DIM, dtype=dtype, device="cpu", pin_memory=True)
    dev.kv_data.copy_(torch.randn(dev.kv_data.shape, dtype=torch.float32).to(dtype))
    host.kv_data.fill_(float("nan"))
    return dev, host


def _slots(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# runs of pages, a scattered tail and a reversed run
SRC = _slots(list(range(8, 16)) + [40, 33, 35, 21] + list(range(30, 26, -1)))
DST = _slots(list(range(20, 28)) + [4, 5, 6, 7] + [12, 9, 10, 11])


def test_cpu_round_trip_is_exact():
    dev, host = _pools("cpu")
    cp = KVCopier(dev.kv_data, host.kv_data)
    want = dev.kv_data[:, :, SRC].clone()
    cp.to_host(SRC, DST)
    assert torch.equal(host.kv_data[:, :, DST], want)
    dev.kv_data.zero_()
    back = _slots(list(range(44, 60)))
    cp.to_device(DST, back)
    cp.synchronize()
    assert torch.equal(dev.kv_data[:, :, back], want)
    assert cp.in_flight == 0


def test_length_mismatch_raises():
    dev_, host_ = _pools("cpu")
    cp = KVCopier(dev_.kv_data, host_.kv_data)
    with pytest.raises(ValueError, match="3 device slots but 2 host slots"):
        cp.to_host(_slots([1, 2, 3]), _slots([4, 5]))
    with pytest.raises(ValueError, match="2 host slots but 1 device slots"):
        cp.to_device(_slots([4, 5]), _slots([1]))


# ----------------------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_round_trip_is_exact(dtype):
    dev, host = _pools("cuda", dtype=dtype)
    cp = KVCopier(dev.kv_data, host.kv_data)
    want = dev.kv_data[:, :, SRC.cuda()].cpu()
    cp.to_host(SRC, DST)
    cp.synchronize()
    assert torch.equal(host.kv_data[:, :, DST], want)
    back = _slots(list(range(44, 60)))
    dev.kv_data.zero_()
    cp.to_device(DST, back)
    got = dev.kv_data[:, :, back.cuda()].cpu()      # compute stream: ordered after the H2D copy
    assert torch.equal(got, want)
    cp.synchronize()
    assert cp.in_flight == 0


@pytest.mark.gpu
@cuda
def test_cuda_device_slots_reusable_when_to_host_returns():
    dev, host = _pools("cuda")
    cp = KVCopier(dev.kv_data, host.kv_data)
    want = dev.kv_data[:, :, SRC.cuda()].cpu()
    cp.to_host(SRC, DST)
    dev.kv_data[:, :, SRC.cuda()] = -1.0            # the slots' next owner writes at once
    cp.synchronize()
    assert torch.equal(host.kv_data[:, :, DST], want)


@pytest.mark.gpu
@cuda
def test_cuda_host_writes_land_in_issue_order():
    dev, host = _pools("cuda")
    cp = KVCopier(dev.kv_data, host.kv_data)
    h = _slots([0, 1, 2, 3])
    cp.to_host(_slots([8, 9, 10, 11]), h)           # the host slots are freed, then reused
    cp.to_host(_slots([12, 13, 14, 15]), h)
    back = _slots([60, 61, 62, 63])
    cp.to_device(h, back)                           # lands both writes first, in order
    assert torch.equal(dev.kv_data[:, :, back.cuda()], dev.kv_data[:, :, torch.arange(12, 16).cuda()])
    cp.synchronize()
    assert torch.equal(host.kv_data[:, :, h], dev.kv_data[:, :, torch.arange(12, 16).cuda()].cpu())


@pytest.mark.gpu
@cuda
def test_cuda_restore_does_not_block_the_host():
    """A restore issued behind ~0.2 s of queued compute returns at once; the compute stream's
    next read waits for it on the GPU."""
    dev, host = _pools("cuda")
    cp = KVCopier(dev.kv_data, host.kv_data)
    cp.to_host(SRC, DST)
    cp.synchronize()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)                 # ~0.2 s of busy compute stream at ~2 GHz
    t = time.perf_counter()
    back = _slots(list(range(44, 60)))
    cp.to_device(DST, back)
    issued = time.perf_counter() - t
    got = dev.kv_data[:, :, back.cuda()]
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), host.kv_data[:, :, DST])
    assert issued < 0.05, f"to_device blocked the host for {issued:.3f} s"


def test_state_rows_of_any_shape():
    """A state pool's rows ([L, 1, rows, *state]) copy like KV rows."""
    dev = torch.randn(2, 1, 9, 3, 5)
    host = torch.full((2, 1, 6, 3, 5), float("nan"))
    cp = KVCopier(dev, host)
    cp.to_host(_slots([7, 2]), _slots([1, 5]))
    assert torch.equal(host[:, :, [1, 5]], dev[:, :, [7, 2]])
    with pytest.raises(ValueError, match="differ in more than the row count"):
        KVCopier(dev, torch.zeros(2, 1, 6, 3, 4))
