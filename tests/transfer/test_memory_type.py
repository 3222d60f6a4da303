"""The NIXL memory type of a region is one function of its tensor's device (issue 36): VRAM with
the device's index on CUDA, DRAM on the CPU; a GPU region adds UCX's CUDA transports to the
default ``UCX_TLS``. A CUDA device is simulated by the pure function (no allocation)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")

from tandem.transfer.agent import KVTransferAgent, Region  # noqa: E402
from tandem.transfer.ucx_env import (  # noqa: E402
    CUDA_UCX_TLS, DEFAULT_UCX_TLS, configure_ucx_tls, default_ucx_tls, memory_type,
)


@pytest.mark.parametrize("device, want", [
    (torch.device("cpu"), ("DRAM", 0)),
    ("cpu", ("DRAM", 0)),
    (torch.device("cuda"), ("VRAM", 0)),
    (torch.device("cuda", 0), ("VRAM", 0)),
    (torch.device("cuda", 3), ("VRAM", 3)),
    ("cuda:1", ("VRAM", 1)),
])
def test_memory_type_follows_the_device(device, want):
    assert memory_type(device) == want


def test_ucx_tls_default_adds_cuda_transports_only_for_vram():
    assert default_ucx_tls() == default_ucx_tls(["DRAM"]) == DEFAULT_UCX_TLS
    assert default_ucx_tls(["DRAM", "VRAM"]) == f"{DEFAULT_UCX_TLS},{CUDA_UCX_TLS}"
    assert set(CUDA_UCX_TLS.split(",")) == {"cuda_copy", "cuda_ipc"}
    env = {}
    assert configure_ucx_tls(None, env, mem_types=["VRAM"]) == env["UCX_TLS"] == default_ucx_tls(["VRAM"])
    # the user's setting and an explicit value still win over the GPU default
    assert configure_ucx_tls(None, {"UCX_TLS": "tcp"}, mem_types=["VRAM"]) == "tcp"
    assert configure_ucx_tls("tcp,self", {}, mem_types=["VRAM"]) == "tcp,self"


def test_cpu_region_registers_as_dram():
    kv = torch.zeros(2, 2, 8, 2, 4)
    info = Region.of("kv", kv, 4).info()
    assert (info.mem_type, info.dev_id, info.base_addr) == ("DRAM", 0, kv.data_ptr())
    agent = KVTransferAgent("memtype-A", [Region.of("kv", kv, 4)])
    try:
        hs = agent.handshake()
        assert [(r.name, r.mem_type) for r in hs.regions] == [("kv", "DRAM")]
        assert len(agent._reg) == 1 and agent._reg[0].getType() == _nixl_seg("DRAM")
    finally:
        agent.close()


def _nixl_seg(mem: str):
    from nixl._api import nixlBind

    return {"DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG}[mem]
