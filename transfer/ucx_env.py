"""What NIXL's UCX backend is told through the environment before an agent starts: the transports
(``UCX_TLS``) and the modules not to load (``UCX_MODULES``), and the memory type of a region."""

from __future__ import annotations

import os
from typing import MutableMapping, Sequence

import torch

# tcp must stay: without it NIXL's UCX backend fails to start (NIXL_ERR_BACKEND). cma writes host
# memory of a same-host peer with process_vm_writev, one call per descriptor (bench/transfer.py).
DEFAULT_UCX_TLS = "tcp,sm,cma,self"
# added to the default when a region is in GPU memory: cuda_copy stages device<->host, cuda_ipc
# writes straight into another process's device memory on the same node (NVLink / PCIe peer)
CUDA_UCX_TLS = "cuda_copy,cuda_ipc"

# UCX modules not to load. The wheel's libuct_ib_efa links the system libibverbs/libnl-route-3
# beside the wheel's vendored copies; with Debian's libibverbs1 + ibverbs-providers installed it
# loads, two libnl-route-3 copies share one process, and at exit the vendored copy's destructor
# (rtnl_tc_unregister, from _dl_fini) walks a list the other copy filled: SIGSEGV after a clean run.
# EFA is AWS-only; every other IB module links only the vendored libs. UCX_TLS=^ib cannot help:
# it picks transports after every module is already loaded.
DEFAULT_UCX_MODULES = "^efa"


def memory_type(device: torch.device) -> tuple[str, int]:
    """NIXL's ``(mem_type, dev_id)`` for ``device``: ``("VRAM", index)`` on CUDA, else ``("DRAM", 0)``."""
    device = torch.device(device)
    if device.type == "cuda":
        return "VRAM", device.index or 0
    return "DRAM", 0


def default_ucx_tls(mem_types: Sequence[str] = ()) -> str:
    """:data:`DEFAULT_UCX_TLS`, plus :data:`CUDA_UCX_TLS` when any of ``mem_types`` is VRAM."""
    return f"{DEFAULT_UCX_TLS},{CUDA_UCX_TLS}" if "VRAM" in mem_types else DEFAULT_UCX_TLS


def configure_ucx_tls(ucx_tls: str | None, environ: MutableMapping[str, str] = os.environ,
                      mem_types: Sequence[str] = ()) -> str:
    """Set ``UCX_TLS`` for agents created after this call (explicit, else the user's, else the default
    for ``mem_types``); the value in effect."""
    if ucx_tls is not None:
        environ["UCX_TLS"] = ucx_tls
    return environ.setdefault("UCX_TLS", default_ucx_tls(mem_types))


def configure_ucx_modules(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``UCX_MODULES`` unless the user did; must run before ``nixl`` is imported."""
    return environ.setdefault("UCX_MODULES", DEFAULT_UCX_MODULES)
